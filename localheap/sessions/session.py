"""Session = the exact token list fed to one heap cache + the cache + its latest stats.

Only the engine thread mutates a session. Other threads read `snapshot`, a dict that is
replaced whole (never edited in place), so a reader never sees half an update.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..heap import HeapConfig, HeapStats

TOKEN_TYPECODE = "i"   # int32 ids: 4 bytes a token, so a 1M-token session's history is 4 MB


def token_array(tokens: Sequence[int] = ()) -> array:
    return array(TOKEN_TYPECODE, tokens)


@dataclass(eq=False)
class Session:
    id: str
    cfg: HeapConfig
    fed: array = field(default_factory=token_array)   # every token in the cache, in order
    cache: Any = None                                  # backend cache while resident
    spill_path: Optional[Path] = None                  # on disk while spilled
    busy: bool = False
    owner: Optional[str] = None                        # id of the API key that created it (None: no keys)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    turns: int = 0
    stats: Optional[HeapStats] = None
    snapshot: dict = field(default_factory=dict)
    _text: Optional[str] = None
    _text_tokens: int = -1

    @property
    def state(self) -> str:
        if self.cache is not None:
            return "resident"
        return "spilled" if self.spill_path is not None else "empty"

    def extend(self, tokens: Sequence[int]) -> None:
        self.fed.extend(tokens)

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
        self.snapshot = {
            "id": self.id,
            "object": "session",
            "state": self.state,
            "busy": self.busy,
            "tokens": len(self.fed),
            "turns": self.turns,
            "created": int(self.created),
            "last_used": round(self.last_used, 3),
            "heap": self.stats.to_dict() if self.stats is not None else None,
        }
