"""Counters and throughput meters the engine keeps for /metrics and the heap event stream.

Written by the engine thread only; other threads read plain numbers (a stale read is fine).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


class RateMeter:
    """Tokens per second over a sliding window."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.events.append((now, n))
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        events = list(self.events)
        if not events:
            return 0.0
        return sum(n for _, n in events) / max(now - events[0][0], 0.5)

    def _trim(self, now: float) -> None:
        while self.events and now - self.events[0][0] > self.window_s:
            self.events.popleft()


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    completion_tokens: int = 0
    decode: RateMeter = field(default_factory=RateMeter)
    prefill: RateMeter = field(default_factory=RateMeter)
