"""What the engine asks before a session heap becomes resident. The RAM-budget governor
(localheap/governor) implements this; until then every heap is admitted."""

from __future__ import annotations

from typing import Protocol


class Governor(Protocol):
    def admit(self, session_bytes: int, resident_bytes: int) -> None:
        """Called on the engine thread before a heap of session_bytes is allocated or
        restored, with resident_bytes already held by other heaps. Raise OverBudget to refuse."""
        ...


class AdmitAll:
    def admit(self, session_bytes: int, resident_bytes: int) -> None:
        return None
