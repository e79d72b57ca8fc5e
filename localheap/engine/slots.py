"""The engine's slots, as llama-server's /slots shows its own.

The engine runs at most `max_active` jobs at once; each admitted run takes the lowest free slot
and gives it back when it leaves (finished, failed or cancelled). A slot remembers the figures of
the last run it held, as a llama-server slot shows its previous task; it keeps figures, not the
run (a run holds its session, and a slot must not keep a heap the store has let go of). Read on
the engine thread (Engine.call), where the runs change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .events import Feed

# the sampling settings a slot shows (llama-server's params: the ones a monitor reads)
SHOWN_PARAMS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "seed", "repeat_penalty", "repeat_last_n",
                "presence_penalty", "frequency_penalty", "dry_multiplier", "mirostat", "stop")


class InvalidSlot(ValueError):
    """A slot id this server does not have (a client's error: 400)."""


@dataclass
class Slot:
    id: int
    run: Any = None                  # the run on it now (engine.runs.Run)
    last: Optional[dict] = None      # the figures of the last run it held, once that one left


class Slots:
    def __init__(self, n: int):
        self.slots = [Slot(i) for i in range(n)]

    def take(self, run, want: Optional[int] = None) -> None:
        """Put `run` on slot `want`, or on the lowest free one (the engine admits no more runs than
        slots, and a run that wants a slot only once that one is free: free)."""
        slot = self.slots[want] if want is not None else next(s for s in self.slots if s.run is None)
        assert slot.run is None, f"slot {slot.id} is taken"
        slot.run, run.slot = run, slot.id

    def leave(self, run) -> None:
        slot = self.slots[run.slot]
        if slot.run is run:
            slot.last, slot.run = figures(run, running=False), None

    def check(self, i: int) -> int:
        """`i` if it is a slot here, else InvalidSlot."""
        if not 0 <= i < len(self.slots):
            raise InvalidSlot(f"Invalid slot ID: {i} (this server has slots 0..{len(self.slots) - 1})")
        return i

    def free(self, i: int) -> bool:
        return self.slots[self.check(i)].run is None

    def hold(self, slot_id: int, session, owner) -> None:
        """The idle slot now holds `session` (a slot file restored into it, slotstate.py): shown as
        the last run's figures are, its tokens all cached."""
        n = len(session.fed)
        self.slots[slot_id].last = {
            "id_task": -1, "session_id": session.id, "owner": owner, "n_prompt_tokens": n,
            "n_prompt_tokens_processed": 0, "n_prompt_tokens_cache": n, "params": {},
            "next_token": {"has_next_token": False, "n_remain": -1, "n_decoded": 0}}

    def view(self) -> list[dict]:
        """One entry a slot: is_processing, and the figures of its run (or of the last one it held)."""
        return [{"id": s.id, "is_processing": s.run is not None,
                 **(figures(s.run, running=True) if s.run is not None else s.last or {})} for s in self.slots]


def figures(run, running: bool) -> dict:
    """What a llama-server slot shows of its task: ids, prompt and reply counts, sampling settings."""
    req = run.request
    feed = isinstance(req, Feed)
    decoded = len(run.completion)
    limit = None if feed else req.params.max_tokens
    return {"id_task": run.job.id, "session_id": run.session.id, "owner": req.owner,
            "n_prompt_tokens": run.prompt_tokens,
            "n_prompt_tokens_processed": run.prompt_tokens - run.cached - run.left,
            "n_prompt_tokens_cache": run.cached,
            "params": {} if feed else {"n_predict": limit, **{k: getattr(req.params, k) for k in SHOWN_PARAMS}},
            "next_token": {"has_next_token": running and run.finish_reason is None,
                           "n_remain": -1 if feed else limit - decoded, "n_decoded": decoded}}
