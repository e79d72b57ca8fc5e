"""The API's routers. Each is made by `api_router()`: its routes (JsonRoute) read the body once
before FastAPI does, and refuse a lone surrogate in it, naming the field, a body where the route
takes none, and a body that is not UTF-8, naming the byte."""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..errors import BadRequest
from ..tokens import check_surrogates, may_hold_surrogates


class JsonRoute(APIRoute):
    """A route whose JSON body is refused, naming the field, when it holds a lone surrogate: JSON
    allows "\\ud800", Python reads it, and then any field could fail where the text is tokenized or
    written to disk (a 500, or a reply whose record cannot be kept), or pass unused. One check here
    holds every field of every route."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # a route that takes no body (no model of one, nor the request to read it: a checkpoint, a
        # spill, a delete) refuses one that says something: a client that meant it (`{"tokens": N}`
        # sent to checkpoint, which fork takes) would otherwise not learn it was ignored
        takes_none = self.body_field is None and self.dependant.request_param_name is None

        async def checked(request: Request) -> Response:
            if request.method not in ("GET", "HEAD", "OPTIONS"):
                try:
                    body = await request.body()   # (kept on the request: read once)
                except ClientDisconnect:   # gone before its body was whole: nobody to answer, nothing to log
                    raise BadRequest("the client closed the connection before the request body was whole") \
                        from None
                if may_hold_surrogates(body):
                    try:
                        value = await request.json()   # (kept too: the route's own reading takes it)
                    except ValueError:   # not JSON: the route says so
                        value = None
                    check_surrogates(value)
                if takes_none and body.strip() not in (b"", b"{}", b"null"):
                    raise BadRequest(f"{request.method} {self.path} takes no body{_fields(body)}")
            try:
                return await handler(request)
            except HTTPException as e:   # FastAPI's "There was an error parsing the body": say which
                cause = e.__cause__
                if isinstance(cause, UnicodeDecodeError):
                    raise BadRequest(f"the request body is not UTF-8 text ({cause.reason}: byte "
                                     f"{cause.start:,})") from None
                raise

        return checked


def api_router(**kwargs: Any) -> APIRouter:
    return APIRouter(route_class=JsonRoute, **kwargs)


def _fields(body: bytes) -> str:
    try:
        value = json.loads(body)
    except ValueError:
        return ""
    return f" (it was sent one with: {', '.join(map(str, value))})" if isinstance(value, dict) and value else ""
