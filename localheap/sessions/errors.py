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


class SpillFailed(OSError):
    """The sessions directory refused a write (full, unwritable, gone, not a directory)."""

    def __init__(self, directory, cause: BaseException):
        while isinstance(cause, SpillFailed):   # (one wrapped in another: said once)
            cause = cause.cause
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause) or type(cause).__name__
        super().__init__(f"cannot save sessions to {directory}: {reason}")
        self.directory, self.cause = directory, cause


class SessionLost(LookupError):
    """A saved session could not be read back (corrupt or missing file): it is gone."""

    def __init__(self, session_id: str, reason: str):
        super().__init__(f"session {session_id!r} could not be restored ({reason}) and is gone; "
                         "resend the whole conversation without X-Session-Id to start a new session")
        self.session_id = session_id


class DiskTotalExceeded(OSError):
    """A request's session cannot fit under --disk-total even with every idle session's space taken back."""

    def __init__(self, need: int, total: int, held: int, reserved: int = 0):
        from ..heap import format_bytes

        saves = f", and {format_bytes(reserved)} kept for the running sessions' next saves" if reserved else ""
        super().__init__(f"this request needs about {format_bytes(need)} in the sessions directory, and the "
                         f"sessions directory's budget (--disk-total {format_bytes(total)}) is taken by sessions "
                         f"in use ({format_bytes(held)}{saves}) after everything else was reclaimed; retry when they "
                         f"finish, or raise --disk-total")
        self.need, self.total, self.held = need, total, held


class RollbackRefused(RuntimeError):
    """A rollback that did not happen, the cache left as it was (a rewind whose page store refused
    to forget the reply's pages): the request is served in a new session, this one kept."""
