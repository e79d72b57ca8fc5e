"""HeapKVCache: one layer's managed heap, behind mlx-lm's cache protocol.

mlx-lm's model code runs unchanged: it rotates q/k at `cache.offset`, calls
`update_and_fetch`, then attention (patched in attention.py to also call `observe`).
Buffers are allocated once at capacity; eviction is a gather to the front. While the layer's
session decodes in a batch its buffers are a row of a DecodeSlab's (slab.py): the same attributes
read and write that row, so every operation below works the same on it.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ...heap import LayerHeap, MergePlan, RepackPlan
from ..slots import SCORE_ARRAYS, PendingView
from ...kernels.decode_attention import mlx_ops as decode_kernel
from .rope import RopeSpec


class RowArray:
    """A heap layer's buffer: its own array, or while the layer is seated in a decode slab its row
    of the slab's. Reading gives that row; assigning replaces it whole; a range of slots is
    written with HeapKVCache.put (an mx array's `a[i] = v` rebinds `a`, so writing into what a
    read returned would be lost when seated)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        return layer.own[self.name] if layer.seat is None else layer.seat.row(self.name)

    def __set__(self, layer, value) -> None:
        if layer.seat is None:
            layer.own[self.name] = value
        else:
            layer.seat.put(self.name, slice(None), value)


KV = ("keys", "values")


class HeapKVCache(PendingView, _BaseCache):
    _copy = staticmethod(mx.array)   # a real copy (a slab row's included)
    keys = RowArray()    # [1, H_kv, capacity, D]
    values = RowArray()  # [1, H_kv, capacity, Dv]
    scores = RowArray()  # [H_kv, capacity] (h2o)
    window = RowArray()  # [H_kv, capacity] (snapkv)
    counts = RowArray()  # [H_kv, capacity] (h2o normalized)

    def __init__(self, heap: LayerHeap, rope: Optional[RopeSpec]):
        self.heap = heap
        self.rope = rope
        self.own: dict = {}
        self.seat = None    # slab.Seat while the layer's session decodes in a slab
        self.keys = self.values = None
        cap, H = heap.capacity, heap.n_kv_heads
        cfg = heap.cfg
        self.scores = mx.zeros((H, cap), mx.float32) if cfg.policy == "h2o" else None
        self.window = mx.zeros((H, cap), mx.float32) if cfg.policy == "snapkv" else None
        self.counts = mx.zeros((H, cap), mx.float32) if cfg.h2o_normalize and cfg.needs_attention else None
        self.qsum: Optional[mx.array] = None    # [H_kv, D] pre-RoPE query sum (geometry)
        self.qcount = 0
        self.capture: Optional[list] = None   # a recall probe's pre-RoPE queries, while it runs

    # -- mlx-lm protocol --------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self.heap.rope_offset()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys: [1, H_kv, L, D] already rotated at self.offset
        B, H, L, D = keys.shape
        assert B == 1, "the heap serves one sequence per cache"
        if self.keys is None:
            cap = self.heap.capacity
            self.keys = mx.zeros((1, H, cap, D), keys.dtype)
            self.values = mx.zeros((1, H, cap, values.shape[3]), values.dtype)
        start, stop = self.heap.append(L)
        self.put("keys", slice(start, stop), keys)
        self.put("values", slice(start, stop), values)
        return self.keys[..., :stop, :], self.values[..., :stop, :]

    def put(self, name: str, slots: slice, value: mx.array) -> None:
        """buffer[..., slots] = value along the slot axis (keys/values: [1, H_kv, n, D]; score
        arrays: [H_kv, n]), in the layer's own array or its slab row, in place."""
        if self.seat is not None:
            self.seat.put(name, slots, value)
        elif name in KV:
            self.own[name][:, :, slots, :] = value
        else:
            self.own[name][:, slots] = value

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return create_attention_mask(N, self.heap.resident, return_array, window_size)

    def size(self) -> int:
        return self.heap.resident

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self):
        if self.keys is None:
            return []
        n = self.heap.resident
        arrays = [self.keys[..., :n, :], self.values[..., :n, :]]
        arrays += [a[..., :n] for a in (self.scores, self.window, self.counts) if a is not None]
        return arrays

    @property
    def nbytes(self) -> int:
        arrays = [self.keys, self.values, self.scores, self.window, self.counts]
        return sum(a.nbytes for a in arrays if a is not None)

    @property
    def kv_nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- scores ---------------------------------------------------------------------
    def observe(self, queries: mx.array, keys: mx.array, scale: float, probs: Optional[mx.array] = None) -> None:
        """Accumulate what the policy needs from this step's attention.

        queries: [1, H_q, L, D] (rotated), keys: [1, H_kv, T, D] as fetched;
        probs: [1, H_kv, G, L, T] when the attention itself produced them, else
        a side pass scores the last `obs_window` queries against the keys.
        """
        cfg = self.heap.cfg
        if self.capture is not None:   # a recall probe: keep the queries, observe nothing
            self.capture.append(self.pre_rope_queries(queries))
            return
        if cfg.needs_query_stats:
            self._observe_queries(queries)
        if not cfg.needs_attention:
            return
        _, Hq, L, D = queries.shape
        H, T = keys.shape[1], keys.shape[2]
        G = Hq // H
        w = L if L == 1 else min(L, max(1, cfg.obs_window))
        if probs is None and L == 1 and decode_kernel.kernel_available():
            # Metal: one fused kernel scores the decode query (self-checked against its reference)
            _, mass = decode_kernel.decode_attention(queries[0, :, 0, :], self.keys[0], self.values[0], scale, T)
            probs = mass[:, None, :]                                   # [H, 1, T]
        elif probs is None:
            probs = self._side_pass(queries[:, :, L - w:, :], keys, scale, T, w).reshape(H, G * w, T)
        else:
            probs = probs[0, :, :, L - w:, :].reshape(H, G * w, T)
        mass = probs.astype(mx.float32).sum(axis=1)                   # [H, T]
        if self.scores is not None:
            self.put("scores", slice(0, T), self.scores[:, :T] + mass)
        if self.counts is not None:
            seen_by = mx.minimum(T - mx.arange(T), w).astype(mx.float32) * G
            self.put("counts", slice(0, T), self.counts[:, :T] + seen_by[None, :])
        if self.window is not None:
            self.put("window", slice(0, T), mass if L > 1 else self.window[:, :T] + mass)

    @staticmethod
    def _side_pass(q: mx.array, keys: mx.array, scale: float, T: int, w: int) -> mx.array:
        """Softmax of the last w queries against all keys: [H, G, w, T] (float32)."""
        _, Hq, _, D = q.shape
        H = keys.shape[1]
        q = q.astype(mx.float32).reshape(H, Hq // H, w, D)
        logits = (q * scale) @ keys[0].astype(mx.float32)[:, None].swapaxes(-1, -2)   # [H, G, w, T]
        if w > 1:
            visible = mx.arange(T)[None, :] <= mx.arange(T - w, T)[:, None]      # [w, T]
            logits = mx.where(visible, logits, -mx.inf)
        return mx.softmax(logits, axis=-1, precise=True)

    def pre_rope_queries(self, queries: mx.array) -> mx.array:
        """queries: [1, H_q, L, D] of the step just appended -> [H_kv, G*L, D] float32, pre-RoPE,
        the G query heads of each KV head's group stacked (mlx-lm's grouping)."""
        _, Hq, L, D = queries.shape
        q = queries[0].astype(mx.float32)                      # [Hq, L, D]
        if self.rope is not None:
            start = self.offset - L  # the queries were rotated before this step's append
            pos = np.broadcast_to(np.arange(start, start + L), (Hq, L))
            q = self.rope.rotate(q, -pos)                       # back to pre-RoPE
        H = self.heap.n_kv_heads
        return q.reshape(H, (Hq // H) * L, D)

    def _observe_queries(self, queries: mx.array) -> None:
        q = self.pre_rope_queries(queries)
        qs = q.sum(axis=1)
        self.qsum = qs if self.qsum is None else self.qsum + qs
        self.qcount += q.shape[1]

    def _geometry_scores(self) -> mx.array:
        """[H, n]: alignment of each pre-RoPE key with the mean pre-RoPE query; else -|k|."""
        n = self.heap.resident
        k = self.keys[0, :, :n, :].astype(mx.float32)
        if self.qsum is None or self.rope is None:
            return -mx.sqrt((k * k).sum(axis=-1))
        rotated_at = np.broadcast_to(np.arange(n), (self.heap.n_kv_heads, n))
        if self.heap.cfg.positions == "absolute":
            rotated_at = self.heap.view_positions()
        k_pre = self.rope.rotate(k, -rotated_at)
        q_mean = self.qsum / self.qcount
        return (k_pre * q_mean[:, None, :]).sum(axis=-1)

    # -- eviction -------------------------------------------------------------------
    def repack(self, plan: RepackPlan, evicting: bool = True) -> None:
        """Apply a host plan (numpy indices and deltas): gather on the device, then the bookkeeping."""
        deltas = None if plan.deltas is None else mx.array(plan.deltas.astype(np.int32))
        self.gather_kept(mx.array(plan.keep_indices.astype(np.int32)), deltas)
        self.heap.apply(plan, evicting)

    def gather_kept(self, idx: mx.array, deltas: Optional[mx.array]) -> None:
        """Device half of a repack: move the kept slots to the front, re-rotating keys in compact mode.

        idx: [H, keep] ascending slot indices, deltas: [H, keep] or None. Lazy, no host sync:
        a zero delta rotates by cos 0 = 1, sin 0 = 0, leaving a key bit for bit."""
        self.write_kept(self.take_kept(idx, deltas))

    def take_kept(self, idx: mx.array, deltas: Optional[mx.array]) -> dict:
        """gather_kept's reads, lazy: the kept slots' keys (re-rotated) and values [1, H_kv, keep, D],
        and scores [H_kv, keep]. A seated layer's are evaluated before write_kept: a view of the
        slab alive at a write makes mlx copy the whole slab instead of updating it in place."""
        n = self.heap.resident
        keys = mx.take_along_axis(self.keys[0, :, :n, :], idx[..., None], axis=1)
        values = mx.take_along_axis(self.values[0, :, :n, :], idx[..., None], axis=1)
        if deltas is not None and self.rope is not None:
            keys = self.rope.rotate(keys, deltas).astype(keys.dtype)
        kept = {"keys": keys[None], "values": values[None]}
        for name in ("scores", "counts"):
            arr = getattr(self, name)
            if arr is not None:
                kept[name] = mx.take_along_axis(arr[:, :n], idx, axis=1)
        return kept

    def write_kept(self, kept: dict) -> None:
        """gather_kept's writes: the kept slots to the front, the scores past them cleared."""
        k = kept["keys"].shape[2]
        for name, value in kept.items():
            self.put(name, slice(0, k), value)
            if name not in KV:
                self.put(name, slice(k, None), mx.array(0, value.dtype))
        if self.window is not None:   # the next observation window starts now
            self.put("window", slice(None), mx.array(0, mx.float32))

    # -- recall ---------------------------------------------------------------------
    def merge(self, plan: MergePlan, keys: mx.array, values: mx.array) -> None:
        """Insert recalled tokens among the resident ones (plan from LayerHeap.merge, already booked).
        keys (pre-RoPE), values: [H_kv, r, D] float32."""
        n, total = plan.n_before, plan.order.shape[1]
        order = mx.array(plan.order.astype(np.int32))                            # [H_kv, n + r]
        k = mx.concatenate([self.keys[0, :, :n, :].astype(mx.float32), keys], axis=1)
        v = mx.concatenate([self.values[0, :, :n, :].astype(mx.float32), values], axis=1)
        k = mx.take_along_axis(k, order[..., None], axis=1)
        v = mx.take_along_axis(v, order[..., None], axis=1)
        merged = {"keys": self.rope.rotate(k, plan.rotate_by).astype(self.keys.dtype)[None],
                  "values": v.astype(self.values.dtype)[None]}
        for name in SCORE_ARRAYS:
            arr = getattr(self, name)
            if arr is not None:   # recalled slots start unscored (they are pinned until released)
                padded = mx.concatenate([arr[:, :n], mx.zeros((arr.shape[0], total - n), arr.dtype)], axis=1)
                merged[name] = mx.take_along_axis(padded, order, axis=1)
        if self.seat is not None:   # reads before writes in a slab (see take_kept)
            mx.eval(merged)
        for name, value in merged.items():
            self.put(name, slice(0, total), value)
