"""ASGI middleware: API key check and request body limit. Errors go through errors.to_response."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import Unauthorized, to_response

PROTECTED_PREFIXES = ("/v1/", "/metrics")


class RequireApiKey:
    """Bearer key on /v1/* and /metrics; /health and the web page stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing API key: send 'Authorization: Bearer KEY'" if not given else "incorrect API key"
                await to_response(Unauthorized(message))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitBody:
    """413 for bodies over max_bytes: at once from Content-Length, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> HTTPException:
        return HTTPException(413, f"request body too large: the limit is {self.max_bytes:,} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await to_response(self._error())(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()   # FastAPI passes HTTPExceptions from body reading through
            return message

        await self.app(scope, limited, send)
