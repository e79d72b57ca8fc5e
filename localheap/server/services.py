"""What the routes share: settings, backend (for its tokenizer), engine, session store."""

from __future__ import annotations

import asyncio
import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request

from ..engine import Engine
from ..sessions import SessionNotFound, SessionStore
from ..sessions.session import short_title
from .errors import UnknownModel
from .logprobs import TokenText
from .middleware import request_owner
from .settings import ServerSettings

NAME_TIMEOUT_S = 5.0
RESPONSES_FILE = "responses.jsonl"   # the kept /v1/responses, in the sessions directory
BACKGROUND_DIR = "background"        # beside it: what each background response running has done (background.Progress)
CONVERSATIONS_FILE = "conversations.jsonl"   # /v1/conversations, beside it


@dataclass
class Services:
    settings: ServerSettings
    backend: Any
    engine: Engine
    store: SessionStore
    governor: Any = None
    started: float = field(default_factory=time.time)
    throughput: Any = None               # telemetry.ThroughputHistory (set by the app)
    metrics: Any = None                  # the app's prometheus_client registry
    observers: int = 0                   # open /v1/heap/events streams (event loop only)
    draining: bool = False               # shutting down: the grace period is over, endless streams end
    force_tokens: Any = None             # tests only: () -> a Constraint for each chat request
    lead_tokens: Any = None              # tests only: ids each chat reply begins with, then its own constraint
    _token_text: Optional[TokenText] = None
    _responses: Any = None
    _backgrounds: Any = None
    _conversations: Any = None

    @property
    def model_id(self) -> str:
        """The name replies carry: the first served name (--served-model-name), else the model's own."""
        return self.model_names[0]

    @property
    def model_names(self) -> list[str]:
        """Every name the model answers to (the patterns among --served-model-name's aside)."""
        return [n for n in self.settings.served_model_names if not is_pattern(n)] or [self.backend.model_name]

    def serves(self, model: str) -> bool:
        """Whether `model` names the served model: one of its names, or a match of a served name
        pattern (`claude-*`: Claude Code asks for its small model by Claude's name)."""
        return model in self.model_names or any(fnmatch.fnmatchcase(model, n) for n in self.settings.served_model_names
                                                if is_pattern(n))

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def responses(self) -> Any:
        """The /v1/responses kept for previous_response_id and GET (responses.ResponseLog)."""
        if self._responses is None:
            from .responses import ResponseLog   # (it imports chat.py, which imports this module)

            # kept with the sessions where they outlive a restart (--persist-sessions), else in memory
            path = self.store.spill_dir / RESPONSES_FILE if self.settings.persist_sessions else None
            self._responses = ResponseLog(path=path)
        return self._responses

    @property
    def conversations(self) -> Any:
        """/v1/conversations and their items (conversations.ConversationLog), kept as the responses are."""
        if self._conversations is None:
            from .conversations import ConversationLog

            path = self.store.spill_dir / CONVERSATIONS_FILE if self.settings.persist_sessions else None
            self._conversations = ConversationLog(path=path)
        return self._conversations

    @property
    def backgrounds(self) -> Any:
        """The background responses running, and the latest ended (background.Backgrounds)."""
        if self._backgrounds is None:
            from .background import Backgrounds, Progress

            path = self.responses.path   # their progress beside the kept responses, written by their writer
            self._backgrounds = Backgrounds(progress=None if path is None else
                                            Progress(path.parent / BACKGROUND_DIR, self.responses))
        return self._backgrounds

    @property
    def token_text(self) -> TokenText:
        """Each token id's text and bytes, for replies' logprobs (made once, cached per id)."""
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    async def name_session(self, session_id: str, text: Optional[str]) -> None:
        """Title an untitled session after its first message (on the engine thread, which
        owns sessions; one step's wait at most, and only until the session has a title)."""
        title = short_title(text or "")
        if title is None or session_id not in self.store or self.store.info(session_id).get("title") is not None:
            return
        try:
            name = self.engine.call(lambda: self.store.set_title(session_id, title, replace=False))
            await asyncio.wait_for(asyncio.wrap_future(name), NAME_TIMEOUT_S)
        except (SessionNotFound, asyncio.TimeoutError):
            pass   # gone already (a failed request deletes its session), or the engine is stopping

    def check_model(self, model: Optional[str]) -> None:
        """None or "" (a client that names no model, as llama-server's do; llama.vim sends ""): the served one."""
        if model and not self.serves(model):
            names = " or ".join(repr(n) for n in self.model_names + [n for n in self.settings.served_model_names
                                                                       if is_pattern(n)])
            raise UnknownModel(f"model {model!r} is not served here; this server serves {names} "
                               f"(GET /v1/models)", "model")


def is_pattern(name: str) -> bool:
    """A --served-model-name with a shell wildcard (*, ?, [...]): it matches names, it is not one."""
    return any(c in name for c in "*?[")


def services(request: Request) -> Services:
    return request.app.state.services


def owner(request: Request) -> Optional[str]:
    """The id of the API key that authenticated the request (None: the server has no keys)."""
    return request_owner(request.scope)
