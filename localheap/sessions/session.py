"""Session = the exact token list fed to one heap cache + the cache + its latest stats.

Only the engine thread mutates a session. Other threads read `snapshot`, a dict that is
replaced whole (never edited in place), so a reader never sees half an update.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..heap import HeapConfig, HeapStats

TOKEN_TYPECODE = "i"   # int32 ids: 4 bytes a token, so a 1M-token session's history is 4 MB
ORIGINS = ("web", "api")   # who opened the session: the web UI's conversations, or any other client
TITLE_CHARS = 80           # an automatic title: the first user message, trimmed to this
HISTORY_POINTS = 240       # (tokens seen, resident) points kept for the UI's sparkline


def token_array(tokens: Sequence[int] = ()) -> array:
    return array(TOKEN_TYPECODE, tokens)


@dataclass
class Reclaims:
    """Space --disk-total took back (sessions/diskbudget.py): pages dropped, checkpoints and sessions removed, bytes."""
    pages: int = 0
    checkpoints: int = 0
    sessions: int = 0
    bytes: int = 0

    def add(self, other: "Reclaims") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


@dataclass(eq=False)
class Session:
    id: str
    cfg: HeapConfig
    fed: array = field(default_factory=token_array)   # every token in the cache, in order
    cache: Any = None                                  # backend cache while resident
    spill_path: Optional[Path] = None                  # heap file of the saved copy on disk, if any
    saved_gen: Optional[int] = None                    # generation of that copy (sessions/disk.py)
    saved_tokens: int = 0                              # len(fed) when it was saved
    saved_crc: Optional[int] = None                    # CRC-32 of those tokens (a cut may have changed fed since)
    saved_points: Optional[tuple] = None               # (rollback_floor, reply_start, cuttable) of that copy
    heap_crc: Optional[int] = None                     # CRC-32 of that heap file (checked on restore)
    dirty: bool = False                                # the cache changed since it was saved
    busy: bool = False
    owner: Optional[str] = None                        # id of the API key that created it (None: no keys)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    turns: int = 0
    unfed_reply: tuple = ()                            # a reply's last tokens, sent, never read (max_tokens)
    ends_in_reply: bool = False                        # its last run a reply (its end of turn never read)
    saved_turns: int = 0                               # turns when it was saved (the index's: a kill keeps those)
    saved_unfed: tuple = ()                            # unfed_reply when it was saved (the index's)
    saved_ends_in_reply: bool = False                  # ends_in_reply when it was saved (the index's)
    saved_stats: Optional[dict] = None                 # its heap's totals when it was saved (the index's, no layers)
    stats: Optional[HeapStats] = None
    snapshot: dict = field(default_factory=dict)
    origin: str = "api"
    title: Optional[str] = None
    # Replaced whole, never edited in place: other threads read it (the heap event stream).
    history: tuple = ()
    rollback_floor: Optional[int] = None   # fewest tokens the cache rolls back to (None: no rollback)
    rollback_mark: Optional[int] = None    # one point below the floor it also rolls back to (sliding layers' mark)
    cuttable: bool = False                 # its cache can be cut to a trimmed history (backends/slots.HeapRollback.cut)
    cut_at_reply: bool = False             # ... only through its whole latest reply or up to its start (sliding layers)
    reply_start: Optional[int] = None      # tokens held before the latest reply began (None: all of them)
    checkpoints: list = field(default_factory=list)   # token counts of its saved checkpoints
    addressed: bool = False   # a client named it (X-Session-Id): never rolled back for another request
    scratch: bool = False     # an editor's completions' (engine.Generate.scratch): a cache for the next one, never
                              # saved, not in the index, dropped rather than spilled; only scratch requests match it
    ephemeral: bool = False   # "store": false: never saved nor matched, deleted when its reply ends
    sized: bool = False       # ephemeral, its heap sized to one input (an embedding's): not one of max_resident
    reclaimed: Reclaims = field(default_factory=Reclaims)   # what --disk-total took back from it
    _text: Optional[str] = None
    _text_tokens: int = -1

    @property
    def saved(self) -> bool:
        """A copy on disk holds exactly what the cache holds (spilling it is free)."""
        return self.spill_path is not None and not self.dirty and self.saved_tokens == len(self.fed)

    @property
    def state(self) -> str:
        if self.cache is not None:
            return "resident"
        return "spilled" if self.spill_path is not None else "empty"

    def extend(self, tokens: Sequence[int]) -> None:
        self.fed.extend(tokens)
        self.unfed_reply = ()

    def truncate(self, tokens: int) -> None:
        """Forget the history after the first `tokens` (the cache was rolled back with it)."""
        del self.fed[tokens:]
        self.unfed_reply, self.ends_in_reply = (), False
        self._text_tokens = -1

    def cut(self, spans: Sequence[tuple[int, int]]) -> None:
        """Keep only the history in `spans`, joined (the cache was cut with it)."""
        kept = token_array()
        for a, b in spans:
            kept.extend(self.fed[a:b])
        self.fed[:] = kept   # in place, as truncate
        self._text_tokens = -1
        self.unfed_reply, self.ends_in_reply = (), False
        self.dirty = True   # as long as the saved copy, perhaps, but not the same tokens

    def text(self, decode: Callable[[list[int]], str]) -> str:
        """The fed tokens decoded (cached until more tokens are fed)."""
        if self._text_tokens != len(self.fed):
            self._text = decode(self.fed.tolist())
            self._text_tokens = len(self.fed)
        return self._text or ""

    def refresh(self, stats: Optional[HeapStats] = None) -> None:
        """Publish a new snapshot for readers on other threads."""
        if stats is not None:
            self.stats = stats
            self._record(stats)
        reclaimed = asdict(self.reclaimed)
        self.snapshot = {
            "id": self.id,
            "object": "session",
            "state": self.state,
            "busy": self.busy,
            "tokens": len(self.fed),
            "turns": self.turns,
            "created": int(self.created),
            "last_used": round(self.last_used, 3),
            "origin": self.origin,
            "title": self.title,
            "heap": self.stats.to_dict() if self.stats is not None else None,
            "checkpoints": list(self.checkpoints),
            "reclaimed": reclaimed if any(reclaimed.values()) else None,
        }

    def _record(self, stats: HeapStats) -> None:
        """One sparkline point per change; when full, every other point goes (the first and
        the latest stay), so the whole story fits in HISTORY_POINTS."""
        point = (stats.tokens_seen, stats.resident)
        if self.history and self.history[-1] == point:
            return
        points = self.history + (point,)
        if len(points) > HISTORY_POINTS:
            points = points[:1] + points[1:-1:2] + points[-1:]
        self.history = points


def short_title(text: str) -> Optional[str]:
    """A title from a message: control characters left out, whitespace collapsed, at most TITLE_CHARS characters."""
    text = " ".join("".join(c if c.isprintable() or c.isspace() else " " for c in text).split())
    if not text:
        return None
    return text if len(text) <= TITLE_CHARS else text[:TITLE_CHARS - 1].rstrip() + "\u2026"
