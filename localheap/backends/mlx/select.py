"""Eviction on the device: every evicting layer's scores, selection and plan as batched MLX work.

`localheap/heap` (numpy) is the specification: `select_keep` returns exactly its keep sets
for the same scores, ties included. MLX's sorts make no stability promise, so the rank key
is composite: the score's order-preserving integer image, then the slot index (the older
slot wins a tie), one int64 per slot; an argpartition then finds the survivors in linear
time. Nothing here reads an array back; the one transfer of an event is `host_indices`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..paging import policy_keep
from ..slots import group_by_shape, split_keep_indices

INDEX_BITS = 24   # slot indices below 2**24 (16M slots per layer) fit beside a 32-bit score image


def rank_key(scores: mx.array, first_index: int = 0) -> mx.array:
    """[..., m] float -> [..., m] int64, ascending = higher score first, then lower slot index."""
    s = scores.astype(mx.float32) + 0.0                          # -0.0 becomes +0.0: they tie, as in numpy
    bits = mx.view(s, mx.int32)
    ordered = mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)   # float order as signed ints
    index = mx.arange(first_index, first_index + s.shape[-1], dtype=mx.int64)
    return (-ordered) * (1 << INDEX_BITS) + index


def select_keep(scores: mx.array, keep: int, sinks: int, recent: int) -> mx.array:
    """scores: [..., n]. Returns [..., min(n, keep)] ascending int32 slot indices: the first `sinks`
    and last `recent` slots, plus the best-scoring others (older wins ties)."""
    n = scores.shape[-1]
    lead = tuple(scores.shape[:-1])
    assert n < 1 << INDEX_BITS, n
    if n <= keep:
        return mx.broadcast_to(mx.arange(n, dtype=mx.int32), (*lead, n))
    lo = min(sinks, n)                                       # candidates are the contiguous middle [lo, hi)
    hi = max(lo, n - recent) if recent > 0 else n
    n_free = keep - (n - (hi - lo))
    assert n_free >= 0, f"keep={keep} smaller than protected slots={n - (hi - lo)}"
    fixed = mx.broadcast_to(mx.concatenate([mx.arange(lo, dtype=mx.int32), mx.arange(hi, n, dtype=mx.int32)]),
                            (*lead, n - (hi - lo)))
    if n_free == 0:
        return fixed
    key = rank_key(scores[..., lo:hi], lo)
    if n_free < hi - lo:
        key = mx.partition(key, n_free - 1, axis=-1)[..., :n_free]   # keys are unique: an exact set
    chosen = (key & ((1 << INDEX_BITS) - 1)).astype(mx.int32)
    return mx.sort(mx.concatenate([fixed, chosen], axis=-1), axis=-1)


def max_pool(x: mx.array, kernel: int) -> mx.array:
    """[H, n] -> [H, n], max over a centred window (numpy's edge padding is equivalent under a max)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    half, n = kernel // 2, x.shape[-1]
    pad = mx.full((x.shape[0], half), -mx.inf, x.dtype)
    padded = mx.concatenate([pad, x, pad], axis=-1)
    out = padded[:, :n]
    for j in range(1, kernel):
        out = mx.maximum(out, padded[:, j:j + n])
    return out


def layer_scores(layer) -> mx.array:
    """[H_kv, resident] importance of one HeapKVCache's slots: its policy's score, on the device.

    float32 throughout (Metal has no float64): normalized h2o and the noise floor may order
    near-ties differently from numpy's float64; the other policies rank exactly alike."""
    heap = layer.heap
    cfg, n, H = heap.cfg, heap.resident, heap.n_kv_heads
    if cfg.policy == "h2o":
        scores = layer.scores[:, :n]
        if cfg.h2o_normalize:
            scores = scores / mx.maximum(layer.counts[:, :n], 1.0)
    elif cfg.policy == "snapkv":
        scores = max_pool(layer.window[:, :n], cfg.pool_kernel)
    elif cfg.policy == "geometry":
        scores = layer._geometry_scores()
    elif cfg.policy == "streaming":
        # the policy scores by original position, which grows with the slot index in every head
        scores = mx.broadcast_to(mx.arange(n, dtype=mx.float32), (H, n))
    elif cfg.policy == "random":
        draws = heap.policy.rng.random((H, n))   # the policy's own float64 draws, ranked here exactly
        scores = mx.array(-np.argsort(np.argsort(-draws, axis=1, kind="stable"), axis=1).astype(np.float32))
    else:
        raise AssertionError(cfg.policy)
    if cfg.noise > 0:
        spread = mx.sqrt(mx.var(scores, axis=-1, keepdims=True)) + 1e-12
        draws = mx.array(heap.noise_rng.standard_normal((H, n)).astype(np.float32))
        scores = scores + draws * cfg.noise * spread
    return scores


@dataclass
class EvictionGroup:
    """Layers that evict together with the same resident count and keep size."""

    layers: list                         # HeapKVCache
    keep_indices: mx.array               # [B, H_kv, keep] int32, ascending
    deltas: Optional[mx.array]           # [B, H_kv, keep] RoPE position change (compact), else None
    scores: Optional[mx.array] = None    # [B, H_kv, resident] what the selection ranked (page values)

    def evicted_slots(self) -> mx.array:
        """[B, H_kv, resident - keep] int32 ascending slots this event drops (for a page-out)."""
        n, keep = self.layers[0].heap.resident, self.keep_indices.shape[-1]
        slot = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (*self.keep_indices.shape[:2], n))
        kept = mx.put_along_axis(mx.zeros(slot.shape, mx.bool_), self.keep_indices, mx.array(True), axis=-1)
        # kept slots sort after every evicted one; the keys are unique, so the order is exact
        return mx.sort(mx.where(kept, slot + n, slot), axis=-1)[..., : n - keep]


@dataclass
class EvictionPlan:
    """One eviction event: every layer that must make room, as device arrays."""

    groups: list[EvictionGroup]

    def host_indices(self) -> list:
        """Keep indices per layer as numpy arrays, in ONE device-to-host transfer for the event."""
        flat = np.array(mx.concatenate([g.keep_indices.reshape(-1) for g in self.groups]))
        return split_keep_indices(flat, [g.keep_indices.shape for g in self.groups])

    @property
    def layers(self) -> list:
        return [layer for g in self.groups for layer in g.layers]


def plan_eviction(layers: list) -> EvictionPlan:
    """Score and select for all `layers` at once: one stacked selection per (resident, keep) group."""
    groups = []
    for (_, keep), members in group_by_shape(layers, policy_keep).items():
        cfg = members[0].heap.cfg
        scores = mx.stack([pinned_scores(layer) for layer in members])            # [B, H_kv, n]
        idx = select_keep(scores, keep, cfg.sinks, cfg.recent)
        deltas = mx.arange(idx.shape[-1], dtype=mx.int32) - idx if cfg.positions == "compact" else None
        groups.append(EvictionGroup(members, idx, deltas, scores))
    return EvictionPlan(groups)


def pinned_scores(layer) -> mx.array:
    """layer_scores, with recalled slots ranked first: they stay until the next recall (LayerHeap.plan)."""
    scores = layer_scores(layer)
    heap = layer.heap
    if heap.n_recalled:
        scores = mx.where(mx.array(heap.recalled[:, : heap.resident]), mx.inf, scores)
    return scores
