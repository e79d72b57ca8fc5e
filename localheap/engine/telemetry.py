"""Counters and throughput meters the engine keeps for /metrics and the heap event stream.

Written by the engine thread only; other threads read plain numbers (a stale read is fine).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


class RateMeter:
    """Tokens per second over the wall clock: the events of the last `window_s`, each counted
    from when its work began (`took` before it ended; else when the event before it ended).

    When events come further apart than the window (one 512-token prefill chunk over a 32K
    heap takes 4-6 s on a CPU), the last event alone carries the rate, decaying as time passes,
    for three times as long as it took (at least the window, at most `idle_s`); a decode
    token (tens of ms) drops out with the window, so a finished stream reads 0 at once.
    """

    def __init__(self, window_s: float = 5.0, idle_s: float = 30.0):
        self.window_s, self.idle_s = window_s, idle_s
        self.events: deque[tuple[float, float, int]] = deque()   # (began, ended, tokens)
        self.calls = 0             # since the start: events (engine steps), their tokens and their seconds
        self.tokens_total = 0
        self.seconds_total = 0.0

    def add(self, n: int, now: float | None = None, took: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        began = now - took if took is not None else (self.events[-1][1] if self.events else now)
        self.events.append((min(began, now), now, n))
        self.calls += 1
        self.tokens_total += n
        self.seconds_total += now - min(began, now)
        self._trim(now)

    @property
    def average(self) -> float:
        """Tokens per second of work since the start (0 before any)."""
        return self.tokens_total / self.seconds_total if self.seconds_total > 0 else 0.0

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        recent = [e for e in self.events if now - e[1] <= self.window_s]
        if not recent and self.events:
            began, ended, _ = last = self.events[-1]
            if now - ended <= min(self.idle_s, max(self.window_s, 3 * (ended - began))):
                recent = [last]
        if not recent:
            return 0.0
        return sum(n for _, _, n in recent) / max(now - recent[0][0], 0.5)

    def _trim(self, now: float) -> None:
        # the last event stays: it carries the rate between sparse events
        while len(self.events) > 1 and now - self.events[0][1] > self.window_s:
            self.events.popleft()
        if self.events and now - self.events[-1][1] > self.idle_s:
            self.events.clear()


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
    save_failures: int = 0    # saves of a session the disk refused (full, read-only), retries included
    decode: RateMeter = field(default_factory=RateMeter)
    prefill: RateMeter = field(default_factory=RateMeter)
