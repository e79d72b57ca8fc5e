"""Bookkeeping of one layer's heap: which token sits in which slot, and repack plans.

Integers and numpy only. The backend owns the K/V tensors and applies the plans
this module makes (gather `keep_indices`, rotate keys by `deltas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .config import HeapConfig
from .pages import cut_positions
from .policies import Policy, SlotView, make_policy
from .selection import add_noise_floor, select_keep
from .stats import LayerStats


class HeapOverflow(RuntimeError):
    """More tokens were appended than the slack can hold (internal misuse)."""


@dataclass
class RepackPlan:
    """What the backend does at an eviction event.

    keep_indices: [kv_heads, keep] ascending slot indices to gather to the front.
    deltas: [kv_heads, keep] RoPE position change per kept key (compact mode), else None.
    """

    keep_indices: np.ndarray
    deltas: Optional[np.ndarray]
    scores: Optional[np.ndarray] = None   # [kv_heads, resident] the policy's scores (page values when paging out)

    @property
    def keep(self) -> int:
        return int(self.keep_indices.shape[1])


@dataclass
class MergePlan:
    """Recalled tokens joining the resident ones. order: [kv_heads, n + r] source of each new slot
    (< n_before: a resident slot, else recalled token order - n_before); rotate_by: [kv_heads, n + r]
    RoPE rotation to apply to each source's key (recalled keys arrive pre-RoPE)."""

    order: np.ndarray
    rotate_by: np.ndarray
    n_before: int


class LayerHeap:
    """Slot table of one attention layer: capacity = sinks + budget + max(slack, prefill chunk)."""

    def __init__(self, cfg: HeapConfig, n_kv_heads: int, budget: int, layer: int = 0):
        self.cfg = cfg
        self.n_kv_heads = n_kv_heads
        self.budget = budget
        self.layer = layer
        self.keep = cfg.sinks + budget
        self.capacity = cfg.layer_capacity(budget)
        # recall: part of the budget holds recalled pages; the policy keeps the rest
        page = cfg.page_size
        self.recall_slots = min(cfg.recall_slots, (budget - cfg.recent) // page * page) if cfg.recall else 0
        self._recalled = np.zeros((n_kv_heads, self.capacity), dtype=bool)   # [h, s]: slot holds a recalled token
        self.policy: Policy = make_policy(cfg, layer)
        self.noise_rng = np.random.default_rng(cfg.seed * 7919 + layer)
        # positions[h, s]: original position of the token in slot s of KV head h
        self._positions = np.zeros((n_kv_heads, self.capacity), dtype=np.int64)
        self._later: Optional[tuple] = None   # an event whose kept slots the device has not told yet (apply_later)
        self._spare: Optional[tuple] = None   # the other pair of position/recalled tables
        self.resident = 0
        self.seen = 0
        self.evicted = 0
        self.evictions = 0
        self.repacked_at = 0   # `seen` at the latest repack or recall: the heap rolls back exactly to here
        self.early = 0         # a staggered event's steps ahead of its due one: it keeps that many fewer

    # -- the position table, possibly one event behind -------------------------------
    @property
    def positions(self) -> np.ndarray:
        """[kv_heads, capacity] original position of the token in each slot (settled first)."""
        self.settle()
        return self._positions

    @property
    def recalled(self) -> np.ndarray:
        """[kv_heads, capacity] whether each slot holds a recalled token (settled first)."""
        self.settle()
        return self._recalled

    def apply_later(self, keep: int, resolve: Callable[[], np.ndarray], evicting: bool = True) -> None:
        """An eviction event's bookkeeping without its keep indices yet: the counts now, the
        position table when first read (`resolve()` gives the [kv_heads, keep] indices then: a
        device's copy of them, started at the event, is done by the time anything needs them, so
        nothing waits for the device between events). Appends meanwhile go to the other pair of
        tables; `settle` fills in the kept slots' part from the old pair."""
        self.settle()
        assert keep <= self.resident
        old = (self._positions, self._recalled, self.resident)
        if self._spare is None:
            self._spare = (np.zeros_like(self._positions), np.zeros_like(self._recalled))
        (self._positions, self._recalled), self._spare = self._spare, None
        self._later = (resolve, old, evicting)
        self._count(keep, evicting)

    def settle(self) -> None:
        """The pending event's kept slots into the position table (apply_later)."""
        if self._later is None:
            return
        resolve, (positions, recalled, n), evicting = self._later
        self._later = None
        keep_indices = resolve()
        k = keep_indices.shape[1]
        kept = np.take_along_axis(positions[:, :n], keep_indices, axis=1)
        assert (np.diff(kept, axis=1) > 0).all(), "repack must preserve token order"
        self._positions[:, :k] = kept
        self._recalled[:, :k] = np.take_along_axis(recalled[:, :n], keep_indices, axis=1)
        self._recalled[:, k:] = False
        self._spare = (positions, recalled)

    def _count(self, k: int, evicting: bool) -> None:
        if evicting:
            self.evicted += self.resident - k
            self.evictions += 1
        self.resident = k
        self.repacked_at = self.seen
        self.early = 0

    # -- appends -------------------------------------------------------------------
    def needs_repack(self, n_new: int) -> bool:
        """Decode steps (n_new <= slack) evict when the slack is full, i.e. every `slack`
        tokens; a larger prefill chunk evicts whenever more than sinks + budget are resident."""
        return self.resident + n_new > self.keep + max(self.cfg.slack, n_new)

    def rope_offset(self) -> int:
        """Position the next appended token is rotated at."""
        return self.resident if self.cfg.positions == "compact" else self.seen

    def append(self, n_new: int) -> tuple[int, int]:
        """Reserve slots for n_new tokens; returns the slot range [start, stop)."""
        if self.resident + n_new > self.capacity:
            raise HeapOverflow(
                f"layer {self.layer}: {n_new} new tokens do not fit "
                f"({self.resident} resident, capacity {self.capacity}); make room first"
            )
        start = self.resident
        self._positions[:, start:start + n_new] = np.arange(self.seen, self.seen + n_new)   # no wait for a pending event
        self.resident += n_new
        self.seen += n_new
        return start, self.resident

    # -- eviction ------------------------------------------------------------------
    def plan(self, view: SlotView, keep: Optional[int] = None) -> RepackPlan:
        """Choose the survivors among the resident slots."""
        n = self.resident
        assert view.positions.shape == (self.n_kv_heads, n), view.positions.shape
        scores = self.policy.score(view)
        scores = add_noise_floor(scores, self.cfg.noise, self.noise_rng)
        pinned = self.recalled[:, :n]
        n_pinned = self.n_recalled
        if keep is None:
            keep = self.keep - self.recall_slots + n_pinned - self.early
        if n_pinned:
            # recalled pages stay until the next question's recall replaces them
            scores = np.where(pinned, np.inf, scores)
        keep_indices = select_keep(scores, keep, self.cfg.sinks, self.cfg.recent)
        return RepackPlan(keep_indices=keep_indices, deltas=self._deltas(keep_indices), scores=scores)

    def _deltas(self, keep_indices: np.ndarray) -> Optional[np.ndarray]:
        if self.cfg.positions != "compact":
            return None
        # slot s was rotated at position s; it moves to slot j
        return np.arange(keep_indices.shape[1])[None, :] - keep_indices

    # -- recall --------------------------------------------------------------------
    @property
    def n_recalled(self) -> int:
        n = self.recalled[:, : self.resident].sum(axis=1)
        assert (n == n[0]).all(), "every KV head recalls the same number of tokens"
        return int(n[0]) if len(n) else 0

    def evicted_slots(self, plan: RepackPlan) -> np.ndarray:
        """[kv_heads, n_evicted] ascending slots the plan drops (never recalled ones: those are on disk)."""
        gone = np.ones((self.n_kv_heads, self.resident), dtype=bool)
        np.put_along_axis(gone, plan.keep_indices, False, axis=1)
        assert not (gone & self.recalled[:, : self.resident]).any(), "recalled slots are pinned"
        n_gone = gone.sum(axis=1)
        assert (n_gone == n_gone[0]).all()
        return np.nonzero(gone)[1].reshape(self.n_kv_heads, -1)

    def release_plan(self) -> Optional[RepackPlan]:
        """The repack that drops the recalled slots (their pages stay in the store); None if none."""
        if not self.n_recalled:
            return None
        kept = ~self.recalled[:, : self.resident]
        keep_indices = np.nonzero(kept)[1].reshape(self.n_kv_heads, -1)
        return RepackPlan(keep_indices=keep_indices, deltas=self._deltas(keep_indices))

    def merge(self, recalled_positions: np.ndarray) -> "MergePlan":
        """Insert recalled tokens (positions [kv_heads, r], ascending per head) among the resident ones
        in token order. Returns the order and rotations for the backend; the bookkeeping is done."""
        H, n = self.n_kv_heads, self.resident
        r = recalled_positions.shape[1]
        assert n + r <= self.capacity, (n, r, self.capacity)
        resident_pos = self.positions[:, :n]
        both = np.concatenate([resident_pos, recalled_positions], axis=1)
        order = np.argsort(both, axis=1, kind="stable")                 # [H, n + r] sources of the new slots
        merged = np.take_along_axis(both, order, axis=1)
        assert (np.diff(merged, axis=1) > 0).all(), "a recalled token is already resident"
        # rotation each source carries now: resident slot s at s (compact) or its position; recalled: none
        carried = np.concatenate([np.broadcast_to(np.arange(n), (H, n)) if self.cfg.positions == "compact"
                                  else resident_pos, np.zeros((H, r), np.int64)], axis=1)
        target = np.broadcast_to(np.arange(n + r), (H, n + r)) if self.cfg.positions == "compact" else merged
        rotate_by = target - np.take_along_axis(carried, order, axis=1)
        flags = np.concatenate([self.recalled[:, :n], np.ones((H, r), bool)], axis=1)
        self.positions[:, : n + r] = merged
        self.recalled[:, : n + r] = np.take_along_axis(flags, order, axis=1)
        self.recalled[:, n + r:] = False
        self.resident = n + r
        self.repacked_at = self.seen   # the slots moved: no rollback before this point
        return MergePlan(order=order, rotate_by=rotate_by, n_before=n)

    def apply(self, plan: RepackPlan, evicting: bool = True) -> None:
        """Bookkeeping of a repack; `evicting=False` for a release of recalled slots (not evictions)."""
        k = plan.keep
        assert k <= self.resident
        kept = np.take_along_axis(self.positions[:, : self.resident], plan.keep_indices, axis=1)
        assert (np.diff(kept, axis=1) > 0).all(), "repack must preserve token order"
        self._positions[:, :k] = kept
        flags = np.take_along_axis(self._recalled[:, : self.resident], plan.keep_indices, axis=1)
        self._recalled[:, :k] = flags
        self._recalled[:, k:] = False
        self._count(k, evicting)

    # -- rollback ------------------------------------------------------------------
    def truncate(self, seen: int) -> int:
        """Forget the tokens after the first `seen`; returns the new resident count.

        Exact only back to `repacked_at`: the tokens appended since then sit, in order, in the
        last slots (the backend clears those slots' buffers)."""
        drop = self.seen - seen
        if not 0 <= drop <= self.seen - self.repacked_at:
            raise ValueError(f"layer {self.layer}: cannot roll back to {seen} tokens "
                             f"(exact back to {self.repacked_at}, {self.seen} seen)")
        tail = self.positions[:, self.resident - drop:self.resident]
        assert (tail == np.arange(seen, self.seen)).all(), "the tail must be the tokens appended since the repack"
        self.resident -= drop
        self.seen = seen
        return self.resident

    def rewind_plan(self, seen: int, scores: np.ndarray) -> tuple[RepackPlan, int]:
        """The repack that forgets the tokens after the first `seen` where truncate cannot (an
        eviction since then moved the slots), and how many tokens of those before
        `seen` it drops besides. Every KV head keeps its slots before `seen` (a prefix: positions
        ascend), cut to the fewest any head holds by `scores` [H, resident] (higher = keep; sinks and
        recalled slots first): heads evict apart, so one head kept more of them than another. The
        caller books it: `seen` set, then `apply(plan, evicting=False)`."""
        return self.keep_plan([(0, seen)], scores)

    def keep_plan(self, spans: list, scores: np.ndarray) -> tuple[RepackPlan, int]:
        """The repack that keeps only the resident tokens whose positions lie in `spans` (ascending,
        disjoint [start, stop) pairs, the first from 0), and how many of those it drops besides:
        every KV head is cut to the fewest any head keeps, by `scores` as in rewind_plan."""
        n = self.resident
        pos = self.positions[:, :n]
        inside = np.zeros(pos.shape, dtype=bool)
        for lo, hi in spans:
            inside |= (pos >= lo) & (pos < hi)
        counts = inside.sum(axis=1)
        m = int(counts.min())
        ranked = np.where(self.recalled[:, :n], np.inf, np.asarray(scores, np.float64))
        ranked = np.where(inside, ranked, -np.inf)   # ties: select_keep's stable sort takes the older slot
        first = int((pos < spans[0][1]).sum(axis=1).min()) if n else 0   # slots before the first cut (<= m)
        keep_indices = select_keep(ranked, m, min(self.cfg.sinks, first), 0)
        assert np.take_along_axis(inside, keep_indices, axis=1).all()
        return RepackPlan(keep_indices=keep_indices, deltas=self._deltas(keep_indices)), int(counts.max()) - m

    def renumber(self, spans: list) -> int:
        """After a repack by keep_plan(spans): the kept tokens take the positions they have in the
        spans joined end to end (the history without what lies between them); every token read
        from here on follows them. Recalled slots were released first (HeapRollback.cut). Returns
        the tokens the spans hold (the new `seen`)."""
        assert not self.n_recalled, "release the recalled slots before a cut"
        pos = self.positions[:, : self.resident]
        pos[:] = cut_positions(pos, np.asarray(spans, np.int64).reshape(-1, 2))   # (keep_plan kept only tokens in them)
        at = sum(hi - lo for lo, hi in spans)
        self.seen = self.repacked_at = at
        return at

    def view_positions(self) -> np.ndarray:
        return self.positions[:, : self.resident].copy()

    def stats(self) -> LayerStats:
        sinks = min(self.cfg.sinks, self.resident)
        return LayerStats(layer=self.layer, capacity=self.capacity, budget=self.budget, resident=self.resident,
                          seen=self.seen, evicted=self.evicted, evictions=self.evictions, sinks=sinks,
                          recent=min(self.cfg.recent, self.resident - sinks), recalled=self.n_recalled)

    # -- state ---------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "positions": self.positions[:, : self.resident].copy(),
            "counters": np.array([self.resident, self.seen, self.evicted, self.evictions, self.repacked_at],
                                 dtype=np.int64),
            "recalled": self.recalled[:, : self.resident].copy(),
        }

    def load_state(self, state: dict) -> None:
        counters = [int(x) for x in state["counters"]]
        resident, seen, evicted, evictions = counters[:4]
        assert resident <= self.capacity
        self._later = None   # replaced whole
        self.positions[:, :resident] = state["positions"]
        self.recalled[:] = False
        if "recalled" in state:
            self.recalled[:, :resident] = state["recalled"]
        self.resident, self.seen, self.evicted, self.evictions = resident, seen, evicted, evictions
        # files written before rollback existed have 4 counters: no rollback below what was seen
        self.repacked_at = counters[4] if len(counters) > 4 else seen
