"""Typed session errors (mapped to HTTP once, in server/errors.py)."""

from __future__ import annotations


class SessionNotFound(LookupError):
    def __init__(self, session_id: str):
        super().__init__(f"no session {session_id!r}; list sessions with GET /v1/sessions")
        self.session_id = session_id


class SessionBusy(RuntimeError):
    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} is serving another request")
        self.session_id = session_id
