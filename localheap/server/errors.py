"""Every error a client can see, mapped once to an OpenAI-style body:
{"error": {"message", "type", "param", "code"}} with its status code."""

from __future__ import annotations

import errno
import json
import logging
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineFailed, EngineStopped, InvalidTokens, OverBudget, Overloaded, RankFailed, RankLost
from ..heap import HeapConfigError
from ..sessions import DiskTotalExceeded, RollbackRefused, SessionBusy, SessionLost, SessionNotFound, SpillFailed

log = logging.getLogger("localheap.server")
DISK_REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}   # full or read-only: 507


class ApiError(Exception):
    """An error raised by the server layer itself, already in OpenAI terms."""
    status = 400
    type = "invalid_request_error"
    code: Optional[str] = None

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class BadRequest(ApiError):
    pass


class Conflict(ApiError):
    status = 409


class Unsupported(ApiError):
    code = "unsupported_parameter"


class Unauthorized(ApiError):
    status, code = 401, "invalid_api_key"


class Forbidden(ApiError):
    status, type = 403, "permission_error"


class UnknownModel(ApiError):
    status, code = 404, "model_not_found"


class InvalidUnicode(BadRequest):
    """A text holding a lone surrogate ("\\ud800" in JSON), which no tokenizer encodes."""


class PromptTooLong(ApiError):
    """More prompt tokens than the RAM budget lets one request hold (OpenAI's code for it)."""
    code = "context_length_exceeded"

    def __init__(self, limit: int, at_least: int, param: str = "messages"):
        super().__init__(f"the prompt has at least {at_least:,} tokens; this server takes at most {limit:,} "
                         f"per request (from its RAM budget; see --max-prompt-tokens). Send a long "
                         f"document in parts: POST /v1/sessions/ID/documents appends to a session (the web page's 'Add document' does so).", param)


class NoSlotFree(ApiError):
    """llama-server's /slots?fail_on_no_slot=1 with every slot running (a load balancer's probe)."""
    status, type, code = 503, "unavailable_error", "no_slot_available"


class NotSupported(ApiError):
    """An endpoint another server has and this one does not (llama-server's 501)."""
    status, type, code = 501, "not_supported_error", "not_supported"


class SlotFileUnwritable(ApiError):
    """--slot-save-path refused a slot file (full, read-only, gone): the file of that name is as it was."""
    status, type, code = 507, "server_error", "slot_save_path_unwritable"


class TooManyObservers(ApiError):
    status, type, code = 503, "server_error", "too_many_observers"


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def to_response(exc: Exception) -> JSONResponse:
    """The one place that turns an exception into a status code and body."""
    if isinstance(exc, ApiError):
        headers = {"Retry-After": "5"} if exc.status == 503 else None
        return error_response(exc.status, str(exc), exc.type, exc.param, exc.code, headers=headers)
    if isinstance(exc, SessionNotFound):
        return error_response(404, str(exc), "invalid_request_error", "session_id", "session_not_found")
    if isinstance(exc, SessionLost):
        return error_response(410, str(exc), "invalid_request_error", "session_id", "session_lost")
    if isinstance(exc, DiskTotalExceeded):
        return error_response(507, str(exc), "server_error", None, "disk_total_exceeded", headers={"Retry-After": "30"})
    if isinstance(exc, SpillFailed):   # disk full or sessions dir unwritable: nothing else is wrong
        log.error("%s", exc)
        return error_response(507, str(exc), "server_error", None, "sessions_dir_unwritable",
                              headers={"Retry-After": "30"})
    if isinstance(exc, RollbackRefused):   # a named session's rewind: its page store's disk refused; it is intact
        log.error("%s", exc)
        return error_response(507, str(exc), "server_error", None, "sessions_dir_unwritable",
                              headers={"Retry-After": "30"})
    if isinstance(exc, RankFailed):
        return error_response(503, str(exc), "server_error", None, "rank_failed", headers={"Retry-After": "1"})
    if isinstance(exc, RankLost):
        return error_response(503, str(exc), "server_error", None, "rank_lost", headers={"Retry-After": "30"})
    if isinstance(exc, OSError) and exc.errno in DISK_REFUSED:   # e.g. a checkpoint's own write
        log.error("sessions directory refused a write: %s", exc)
        return error_response(507, f"cannot write to the sessions directory: {exc.strerror}", "server_error", None,
                              "sessions_dir_unwritable", headers={"Retry-After": "30"})
    if isinstance(exc, EngineFailed):
        return error_response(503, str(exc), "server_error", None, "engine_failed", headers={"Retry-After": "5"})
    if isinstance(exc, InvalidTokens):
        return error_response(400, str(exc), "invalid_request_error", "prompt", "invalid_token_id")
    if isinstance(exc, SessionBusy):
        return error_response(409, str(exc), "invalid_request_error", "session_id", "session_busy")
    if isinstance(exc, (Overloaded, OverBudget)):
        code = "overloaded" if isinstance(exc, Overloaded) else "ram_budget_exceeded"
        return error_response(503, str(exc), "server_error", None, code,
                              headers={"Retry-After": str(max(1, round(exc.retry_after)))})
    if isinstance(exc, EngineStopped):
        return error_response(503, str(exc), "server_error", None, "shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, RequestValidationError):
        return _validation(exc)
    if isinstance(exc, RecursionError):   # a body, or a schema in it, nested past what is read (no 500)
        return error_response(400, "the request is nested too deeply to read (its JSON, or a schema in it)",
                              "invalid_request_error", None, "nested_too_deeply")
    if isinstance(exc, StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        headers = getattr(exc, "headers", None)
        return error_response(exc.status_code, str(exc.detail), type_, None, code, headers=headers)
    if isinstance(exc, (HeapConfigError, ValueError)):
        return error_response(400, str(exc), "invalid_request_error")
    # the body says nothing about internals (exception text can hold paths, file names,
    # prompt text); the log has it all, found by the reference
    ref = uuid.uuid4().hex[:12]
    log.error("internal error (reference %s)", ref, exc_info=exc)
    return error_response(500, f"internal server error (reference {ref}; the details are in the server log)",
                          "server_error", None, "internal_error")


def _union_branch(part) -> bool:
    """A loc element naming which member of a Union pydantic tried ("str", "list[...]"), not a field."""
    return part in ("str", "int", "float", "bool", "none") or \
        str(part).startswith(("list[", "tagged-union[", "literal[", "dict[", "function-"))


def _field_path(loc: list, body) -> list[str]:
    """pydantic's error location as the request's own field path: without the names of the union
    members it tried (`str`, `MessageItem`, a tag: `text` in messages.0.content.0.text.text), which
    are found as the steps the body has no such key or index for (the last step, a missing field, kept)."""
    out, node = [], body
    for k, part in enumerate(loc):
        last = k == len(loc) - 1
        if isinstance(node, dict) and not last and part == node.get("type") and loc[k + 1] in node:
            continue   # a tagged union's tag, before the field it names ({"type": "text", "text": 5})
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif _union_branch(part) or (node is not None and not last):
            continue   # a union member's name, not a field
        else:
            node = None
        out.append(str(part))
    return out


def _validation(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # a list where a Union also takes a string: the list's own error says what is wrong, "not a string" does not
    errors = [e for e in errors
              if not (e.get("type") == "string_type" and tuple(e.get("loc", ()))[-1:] == ("str",))] or errors
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = _field_path([p for p in first.get("loc", ()) if p != "body"], getattr(exc, "body", None))
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        detail = str((first.get("ctx") or {}).get("error") or first.get("msg") or "").removeprefix("Invalid JSON: ")
        message, param = f"the request body is not valid JSON{f' ({detail})' if detail else ''}", None
        if "recursion limit" in detail:   # (pydantic's reader stops at about 255 levels)
            message = f"the request body is nested too deeply to read ({detail})"
    elif first.get("type") == "extra_forbidden":
        message = f"unsupported parameter {param!r}: this server does not accept it"
    elif first.get("type") == "missing" and param is None:   # no body at all
        message = "the request body is empty: send a JSON object"
    elif first.get("type") == "missing":
        message = f"missing required parameter {param!r}"
    else:
        message = f"invalid {param or 'request'}: {first.get('msg')}"
    return error_response(400, message, "invalid_request_error", param, first.get("type"))


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_body(response: JSONResponse) -> dict:
    """An error response's body in Anthropic's shape: {"type": "error", "error": {"type", "message"}}
    (OpenAI's param and code kept beside them)."""
    err = json.loads(response.body)["error"]
    status = response.status_code
    type_ = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type_, "message": err["message"], "param": err["param"],
                                       "code": err["code"]}}


def for_path(path: str, response: JSONResponse) -> JSONResponse:
    """Errors of the Anthropic routes in Anthropic's shape, of Ollama's ({"error": message}) in its,
    the rest in OpenAI's."""
    if path.startswith("/v1/messages"):
        body = anthropic_body(response)
    elif path.startswith("/api/"):
        err = json.loads(response.body)["error"]
        body = {"error": err["message"], "localheap": {"param": err["param"], "code": err["code"]}}
    else:
        return response
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


def install(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return for_path(request.url.path, to_response(exc))

    for cls in (ApiError, SessionNotFound, SessionBusy, SessionLost, SpillFailed, RollbackRefused, DiskTotalExceeded,
                OSError, EngineFailed, InvalidTokens, RankFailed, RankLost,
                Overloaded, OverBudget, EngineStopped,
                RequestValidationError, StarletteHTTPException, HeapConfigError, ValueError, RecursionError, Exception):
        app.add_exception_handler(cls, handle)
