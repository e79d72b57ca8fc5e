"""What the routes share: settings, backend (for its tokenizer), engine, session store."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..engine import Engine
from ..sessions import SessionStore
from .errors import UnknownModel
from .settings import ServerSettings


@dataclass
class Services:
    settings: ServerSettings
    backend: Any
    engine: Engine
    store: SessionStore
    governor: Any = None
    started: float = field(default_factory=time.time)

    @property
    def model_id(self) -> str:
        return self.backend.model_name

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise UnknownModel(f"model {model!r} is not served here; this server serves {self.model_id!r} "
                               f"(GET /v1/models)", "model")


def services(request: Request) -> Services:
    return request.app.state.services
