"""What the routes share: settings, backend (for its tokenizer), engine, session store."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request

from ..engine import Engine
from ..sessions import SessionStore
from .errors import UnknownModel
from .middleware import request_owner
from .settings import ServerSettings


@dataclass
class Services:
    settings: ServerSettings
    backend: Any
    engine: Engine
    store: SessionStore
    governor: Any = None
    started: float = field(default_factory=time.time)
    metrics: Any = None                  # the app's prometheus_client registry
    observers: int = 0                   # open /v1/heap/events streams (event loop only)

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


def owner(request: Request) -> Optional[str]:
    """The id of the API key that authenticated the request (None: the server has no keys)."""
    return request_owner(request.scope)
