"""Incremental detokenization with stop sequences: ids in, text deltas out.

Decodes a short window (from the last stable point) instead of the whole reply per token,
and holds back a trailing incomplete UTF-8 character until its other bytes arrive.
"""

from __future__ import annotations

from typing import Callable

from ..generation import StopMatcher


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0      # window start
        self.read = 0        # ids already turned into emitted text
        self.stops = StopMatcher(stops)

    def _new_text(self) -> str:
        window = self.decode(self.ids[self.prefix:])
        if not window or window.endswith("\ufffd"):
            return ""
        done = self.decode(self.ids[self.prefix:self.read])
        if len(window) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(done):]

    def add(self, token: int) -> tuple[str, bool]:
        """(text safe to send, hit a stop sequence?)"""
        self.ids.append(token)
        return self.stops.feed(self._new_text())

    def flush(self) -> tuple[str, bool]:
        """The rest at the end of generation, incomplete characters included."""
        rest = self.decode(self.ids[self.prefix:])[len(self.decode(self.ids[self.prefix:self.read])):]
        self.prefix = self.read = len(self.ids)
        out, stopped = self.stops.feed(rest)
        return out + self.stops.flush(), stopped
