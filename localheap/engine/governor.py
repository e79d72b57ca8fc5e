"""What the engine asks the RAM/thermal governor (localheap/governor implements it).

Before a heap becomes resident: admit (maybe after spilling idle heaps) or refuse; while
recall sessions grow: which idle heaps to spill.
Before a prefill chunk: how big, and how long to pause (thermal pressure).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..governor import Admission, Throttle


class Governor(Protocol):
    def admit(self, resident: int, idle_lru: Sequence[str]) -> Admission:
        """`resident` heaps are in RAM; `idle_lru` may be spilled (least recently used first).
        A governor with a `plan` whose recall_token_bytes is set is also asked with `extra`
        (bytes by session past the planned heap) and `new_heap` False (which sessions to
        spill after recall sessions grew); see localheap/governor/governor.py. A heap smaller
        than a session's (an embedding's) comes with `size`, its bytes."""
        ...

    def throttle(self, chunk: int) -> Throttle: ...

    def snapshot(self) -> dict: ...


class AdmitAll:
    """No budget: every heap is admitted, nothing is throttled."""

    def admit(self, resident: int, idle_lru: Sequence[str], **_) -> Admission:
        return Admission("admit")

    def throttle(self, chunk: int) -> Throttle:
        return Throttle("unknown", chunk, 0.0)

    def snapshot(self) -> dict:
        return {"thermal_state": "unknown"}
