"""HeapLayer: one attention layer's managed heap, behind transformers' cache-layer protocol.

transformers' model code runs unchanged: it rotates q/k at the position_ids we pass,
calls `update`, then the attention function (registered in attention.py, which also
calls `observe`). Buffers are allocated once at capacity and written by index;
eviction is an order-preserving gather to the front. Bookkeeping is LayerHeap's.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from ...heap import LayerHeap, MergePlan, RepackPlan
from ..slots import SCORE_ARRAYS, PendingView
from . import slab_cpu
from .rope import RopeSpec

_NONE = torch.empty(0, 1)   # the kernels' cos/sin when nothing rotates

class HeapLayer(PendingView, CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False
    _copy = staticmethod(torch.clone)
    _window: Optional[torch.Tensor] = None
    _observed: Optional[tuple] = None   # a prefill chunk's window, scored when read (see `window`)
    lazy_window = True                   # False: score every chunk's window at once (tests, benches)

    def __init__(self, heap: LayerHeap, head_dim: int, dtype: torch.dtype, device: torch.device,
                 rope: Optional[RopeSpec]):
        super().__init__()
        self.heap = heap
        self.rope = rope
        self.rope_delta = 0    # layer position minus the model-wide position_ids (set per forward)
        self.dtype, self.device = dtype, torch.device(device)
        H, cap = heap.n_kv_heads, heap.capacity
        self.keys = torch.zeros(1, H, cap, head_dim, dtype=dtype, device=device)    # [1, H_kv, capacity, D]
        self.values = torch.zeros(1, H, cap, head_dim, dtype=dtype, device=device)  # [1, H_kv, capacity, D]
        self.is_initialized = True
        cfg = heap.cfg

        def score_array(wanted: bool) -> Optional[torch.Tensor]:
            return torch.zeros(H, cap, dtype=torch.float32, device=device) if wanted else None   # [H_kv, capacity]

        self.scores = score_array(cfg.policy == "h2o")
        self.window = score_array(cfg.policy == "snapkv")
        self.counts = score_array(cfg.h2o_normalize and cfg.needs_attention)
        self.qsum: Optional[torch.Tensor] = None    # [H_kv, D] pre-RoPE query sum (geometry)
        self.qcount = 0

    # -- transformers' cache-layer protocol -------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("heap buffers are allocated at construction")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states: [1, H_kv, L, D], keys rotated at the model-wide positions.
        Returns the resident keys/values [1, H_kv, resident, D] (views into the buffers)."""
        assert key_states.shape[0] == 1, "the heap serves one sequence per cache"
        if self.rope_delta:
            key_states = self.rope.rotate(key_states, self.rope_delta)
        start, stop = self.heap.append(key_states.shape[2])
        self.keys[:, :, start:stop] = key_states
        self.values[:, :, start:stop] = value_states
        return self.keys[:, :, :stop], self.values[:, :, :stop]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # slots are in token order, so the causal mask lives in slot space: kv_offset 0
        return self.heap.resident + query_length, 0

    def get_seq_length(self) -> int:
        """Resident slots: transformers uses it as the query offset of the mask."""
        return self.heap.resident

    def get_max_length(self) -> int:
        return self.heap.capacity

    def reset(self) -> None:
        cfg, h = self.heap.cfg, self.heap
        self._observed = None
        self.heap = LayerHeap(cfg, h.n_kv_heads, h.budget, layer=h.layer)
        self.keys.zero_()
        self.values.zero_()
        for name in SCORE_ARRAYS:
            if getattr(self, name) is not None:
                getattr(self, name).zero_()
        self.qsum, self.qcount = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the heap serves one sequence; beam search is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("heap layers cannot be cropped")

    @property
    def window(self) -> Optional[torch.Tensor]:
        """snapkv's observation-window mass [H_kv, capacity]. A prefill chunk's window replaces the
        previous one whole, so it is scored when first read (an eviction's selection, a decode step
        adding to it, stats, a save), not per chunk: chunks that a later chunk overwrites before
        anything reads them cost no scoring pass (small chunks riding beside decode). Same values:
        the same ops over the same keys, which nothing writes below the chunk's end until then."""
        if self._observed is not None:
            self._score_window()
        return self._window

    @window.setter
    def window(self, value: Optional[torch.Tensor]) -> None:
        self._observed = None
        self._window = value

    # -- bytes ----------------------------------------------------------------------
    @property
    def kv_nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def nbytes(self) -> int:
        arrays = (self.scores, self.counts, self._window)   # SCORE_ARRAYS, without scoring a pending window
        extra = sum(a.nbytes for a in arrays if a is not None)
        return self.kv_nbytes + extra

    # -- scores ---------------------------------------------------------------------
    def observe(self, queries: torch.Tensor, keys: torch.Tensor, scale: float) -> None:
        """Side pass after the stock attention: accumulate what the policy needs.

        queries: [1, H_q, L, D] rotated at this layer's positions; keys: [1, H_kv, T, D] as `update` returned them.
        """
        cfg = self.heap.cfg
        if cfg.needs_query_stats:
            self._observe_queries(queries)
        if not cfg.needs_attention:
            return
        _, Hq, L, D = queries.shape
        H, T = keys.shape[1], keys.shape[2]
        G = Hq // H
        w = L if L == 1 else min(L, max(1, cfg.obs_window))
        # query head h attends KV head h // G (transformers' repeat_kv layout)
        q = queries[0, :, L - w:, :].float().reshape(H, G * w, D)
        if L > 1 and self.lazy_window and self.scores is None and self.counts is None:
            self._observed = (q, scale, T, w, G)   # a window only: scored when read
            return
        self.accumulate(self._window_mass(q, keys[0], scale, w, G), w, G, new_window=L > 1)

    def _score_window(self) -> None:
        q, scale, T, w, G = self._observed
        self._observed = None
        self._window[:, :T] = self._window_mass(q, self.keys[0, :, :T], scale, w, G)

    @staticmethod
    def _window_mass(q: torch.Tensor, keys: torch.Tensor, scale: float, w: int, G: int) -> torch.Tensor:
        """q: [H_kv, G*w, D] float32, keys: [H_kv, T, D] -> attention mass [H_kv, T] of the w causal queries."""
        H, T = keys.shape[0], keys.shape[1]
        k = keys.float()                                             # [H, T, D]
        logits = torch.matmul(q * scale, k.transpose(-1, -2))        # [H, G*w, T]
        if w > 1:
            qpos = torch.arange(T - w, T, device=k.device)
            hidden = torch.arange(T, device=k.device)[None, :] > qpos[:, None]   # [w, T]
            logits = logits.view(H, G, w, T).masked_fill(hidden, float("-inf")).view(H, G * w, T)
        return torch.softmax(logits, dim=-1).sum(dim=1)

    def accumulate(self, mass: torch.Tensor, w: int, G: int, new_window: bool) -> None:
        """mass: [H_kv, T] attention mass of the last w queries (G query heads each, summed per KV head)."""
        T = mass.shape[1]
        if self.scores is not None:
            self.scores[:, :T] += mass
        if self.counts is not None:
            # query i of the window sees slots [0, T - w + i]: slot t is seen by min(T - t, w) of them
            seen_by = torch.clamp(T - torch.arange(T, device=mass.device), max=w).float() * G
            self.counts[:, :T] += seen_by[None, :]
        if self.window is not None:
            if new_window:
                self.window[:, :T] = mass
            else:
                self.window[:, :T] += mass

    def pre_rope_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """queries: [1, H_q, L, D] of the step just appended -> [H_kv, G*L, D] float32, pre-RoPE,
        the G query heads of each KV head's group stacked (transformers' repeat_kv layout)."""
        _, Hq, L, D = queries.shape
        q = queries[0].float()                                       # [H_q, L, D]
        if self.rope is not None:
            start = self.heap.rope_offset() - L   # the queries were rotated before this step's append
            q = self.rope.rotate(q, -torch.arange(start, start + L, device=q.device))   # back to pre-RoPE
        return q.reshape(self.heap.n_kv_heads, (Hq // self.heap.n_kv_heads) * L, D)

    def _observe_queries(self, queries: torch.Tensor) -> None:
        Hq, L = queries.shape[1], queries.shape[2]
        H = self.heap.n_kv_heads
        qs = self.pre_rope_queries(queries).sum(dim=1)
        self.qsum = qs if self.qsum is None else self.qsum + qs
        self.qcount += (Hq // H) * L

    def _geometry_scores(self) -> torch.Tensor:
        """[H_kv, n]: alignment of each pre-RoPE key with the mean pre-RoPE query; else -|k|."""
        n = self.heap.resident
        k = self.keys[0, :, :n, :].float()
        if self.qsum is None or self.rope is None:
            return -k.norm(dim=-1)
        rotated_at = np.broadcast_to(np.arange(n), (self.heap.n_kv_heads, n))
        if self.heap.cfg.positions == "absolute":
            rotated_at = self.heap.view_positions()
        k_pre = self.rope.rotate(k, -rotated_at)
        q_mean = self.qsum / self.qcount
        return (k_pre * q_mean[:, None, :]).sum(dim=-1)

    # -- eviction -------------------------------------------------------------------
    def repack(self, plan: RepackPlan, evicting: bool = True) -> None:
        """Apply a host plan (numpy indices and deltas): gather on the device, then the bookkeeping."""
        deltas = None if plan.deltas is None else torch.as_tensor(plan.deltas, device=self.device)
        self.gather_kept(torch.as_tensor(plan.keep_indices, device=self.device), deltas)
        self.heap.apply(plan, evicting)

    def gather_kept(self, idx: torch.Tensor, deltas: Optional[torch.Tensor]) -> None:
        """Device half of a repack: move the kept slots to the front, re-rotating keys in compact mode.

        idx: [H_kv, keep] ascending slot indices, deltas: [H_kv, keep] or None, both on the device.
        No host sync: a zero delta rotates by cos 0 = 1, sin 0 = 0, leaving a key bit for bit.
        On the CPU in float32, slab_cpu's `compact` does it in place in one pass (same bits), where
        it is built; deltas are then arange(keep) - idx, as every plan makes them."""
        self._observed = None   # the window restarts below: a pending one is never read
        (H, k), n = idx.shape, self.heap.resident
        cap, D = self.keys.shape[2], self.keys.shape[3]
        rotate = deltas is not None and self.rope is not None
        kernel = slab_cpu.evicts(self.keys) if self.rope is None or self.rope.standard else None
        if kernel is not None:   # in place, one pass over the slots, the same bits (deltas = arange - idx)
            cos, sin = self.rope.table(self.device, n - k) if rotate else (_NONE, _NONE)
            kernel.compact(self.keys[0], self.values[0], idx.contiguous(), cos, sin, rotate)
        else:
            rows = (idx + torch.arange(H, device=idx.device)[:, None] * cap).reshape(-1)   # [H_kv * keep] into [H_kv * cap]
            # whole rows by one index_select over the flattened heads (2-3x faster than advanced indexing on the CPU)
            keys = self.keys[0].reshape(H * cap, D).index_select(0, rows).view(H, k, D)   # [H_kv, keep, D]
            values = self.values[0].reshape(H * cap, D).index_select(0, rows).view(H, k, D)
            if rotate:
                keys = self.rope.shift_back(keys, -deltas, n - k)
            self.keys[0, :, :k] = keys
            self.values[0, :, :k] = values
        for name in ("scores", "counts"):
            arr = getattr(self, name)
            if arr is not None:
                arr[:, :k] = torch.gather(arr[:, :n], 1, idx)
                arr[:, k:] = 0
        if self.window is not None:
            self.window.zero_()   # the next observation window starts now

    # -- recall ---------------------------------------------------------------------
    def merge(self, plan: MergePlan, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Insert recalled tokens among the resident ones (plan from LayerHeap.merge, already booked).
        keys (pre-RoPE), values: [H_kv, r, D] float32 on this layer's device."""
        if self._observed is not None:
            self._score_window()   # over the keys as they are before the merge moves them
        n, D = plan.n_before, self.keys.shape[-1]
        total = plan.order.shape[1]
        idx = torch.as_tensor(plan.order, device=self.device)                   # [H_kv, n + r]
        gather_idx = idx[..., None].expand(-1, -1, D)
        k = torch.gather(torch.cat([self.keys[0, :, :n].float(), keys], dim=1), 1, gather_idx)
        v = torch.gather(torch.cat([self.values[0, :, :n].float(), values], dim=1), 1, gather_idx)
        self.keys[0, :, :total] = self.rope.rotate_ahead(k, plan.rotate_by).to(self.dtype)
        self.values[0, :, :total] = v.to(self.dtype)
        for name in SCORE_ARRAYS:
            arr = getattr(self, name)
            if arr is not None:   # recalled slots start unscored (they are pinned until released)
                padded = torch.cat([arr[:, :n], torch.zeros_like(arr[:, : total - n])], dim=1)
                arr[:, :total] = torch.gather(padded, 1, idx)
