"""Sessions: the exact tokens fed to each heap cache, the caches, and a store with spill to disk.

Knows nothing about HTTP, threads or tensors: the engine thread drives it, the backend owns the cache.
"""

from .errors import DiskTotalExceeded, RollbackRefused, SessionBusy, SessionLost, SessionNotFound, SpillFailed
from .match import Match, Prompt, continue_session, match_session
from .session import Session
from .store import SessionStore

__all__ = ["DiskTotalExceeded", "Match", "Prompt", "RollbackRefused", "Session", "SessionBusy", "SessionLost", "SessionNotFound", "SessionStore", "SpillFailed",
           "continue_session", "match_session"]
