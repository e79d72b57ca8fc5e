"""Bookkeeping of one layer's heap: which token sits in which slot, and repack plans.

Integers and numpy only. The backend owns the K/V tensors and applies the plans
this module makes (gather `keep_indices`, rotate keys by `deltas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .config import HeapConfig
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

    @property
    def keep(self) -> int:
        return int(self.keep_indices.shape[1])


class LayerHeap:
    """Slot table of one attention layer: capacity = sinks + budget + max(slack, prefill chunk)."""

    def __init__(self, cfg: HeapConfig, n_kv_heads: int, budget: int, layer: int = 0):
        self.cfg = cfg
        self.n_kv_heads = n_kv_heads
        self.budget = budget
        self.layer = layer
        self.keep = cfg.sinks + budget
        self.capacity = cfg.layer_capacity(budget)
        self.policy: Policy = make_policy(cfg, layer)
        self.noise_rng = np.random.default_rng(cfg.seed * 7919 + layer)
        # positions[h, s]: original position of the token in slot s of KV head h
        self.positions = np.zeros((n_kv_heads, self.capacity), dtype=np.int64)
        self.resident = 0
        self.seen = 0
        self.evicted = 0
        self.evictions = 0

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
        self.positions[:, start:start + n_new] = np.arange(self.seen, self.seen + n_new)
        self.resident += n_new
        self.seen += n_new
        return start, self.resident

    # -- eviction ------------------------------------------------------------------
    def plan(self, view: SlotView, keep: Optional[int] = None) -> RepackPlan:
        """Choose the survivors among the resident slots."""
        keep = self.keep if keep is None else keep
        n = self.resident
        assert view.positions.shape == (self.n_kv_heads, n), view.positions.shape
        scores = self.policy.score(view)
        scores = add_noise_floor(scores, self.cfg.noise, self.noise_rng)
        keep_indices = select_keep(scores, keep, self.cfg.sinks, self.cfg.recent)
        deltas = None
        if self.cfg.positions == "compact":
            # slot s was rotated at position s; it moves to slot j
            deltas = np.arange(keep_indices.shape[1])[None, :] - keep_indices
        return RepackPlan(keep_indices=keep_indices, deltas=deltas)

    def apply(self, plan: RepackPlan) -> None:
        k = plan.keep
        assert k <= self.resident
        kept = np.take_along_axis(self.positions[:, : self.resident], plan.keep_indices, axis=1)
        assert (np.diff(kept, axis=1) > 0).all(), "repack must preserve token order"
        self.positions[:, :k] = kept
        self.evicted += self.resident - k
        self.resident = k
        self.evictions += 1

    def view_positions(self) -> np.ndarray:
        return self.positions[:, : self.resident].copy()

    def stats(self) -> LayerStats:
        sinks = min(self.cfg.sinks, self.resident)
        return LayerStats(layer=self.layer, capacity=self.capacity, budget=self.budget, resident=self.resident,
                          seen=self.seen, evicted=self.evicted, evictions=self.evictions, sinks=sinks,
                          recent=min(self.cfg.recent, self.resident - sinks))

    # -- state ---------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "positions": self.positions[:, : self.resident].copy(),
            "counters": np.array([self.resident, self.seen, self.evicted, self.evictions], dtype=np.int64),
        }

    def load_state(self, state: dict) -> None:
        resident, seen, evicted, evictions = (int(x) for x in state["counters"])
        assert resident <= self.capacity
        self.positions[:, :resident] = state["positions"]
        self.resident, self.seen, self.evicted, self.evictions = resident, seen, evicted, evictions
