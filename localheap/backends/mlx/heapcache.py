"""A model's heap: one HeapKVCache per full-attention layer, passed to mlx-lm as its cache list."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ...heap import HeapConfig, HeapConfigError, LayerHeap, RepackPlan, combine
from ...heap.stats import HeapStats
from .. import paging
from ..slots import HeapRollback, split_keep_indices
from . import attention, recall
from .cache import HeapKVCache
from .rope import RopeSpec
from .select import EvictionPlan, pinned_scores, plan_eviction


def attention_module(layer):
    for name in ("self_attn", "attention", "attn"):
        mod = getattr(layer, name, None)
        if mod is not None:
            return mod
    raise TypeError(f"cannot find the attention module of {type(layer).__name__}")


def kv_geometry(attn) -> tuple[int, int]:
    """(kv_heads, head_dim) of an mlx-lm attention module."""
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None:
        head_dim = attn.k_proj.weight.shape[0] // n_kv
    return int(n_kv), int(head_dim)


@dataclass
class StagedRepack:
    """An eviction event staged on the device: `arrays` to evaluate, `wire` the one read back."""

    plan: EvictionPlan
    outgoing: Optional[list]     # the page-out's gathers (recall on), else None
    wire: mx.array               # keep indices (and, with recall, the evicted K/V) as one array
    parts: Optional[list]        # the wire's (dtype, count) parts, with recall
    arrays: list


class HeapPromptCache(HeapRollback, list):
    """List of per-layer caches (mlx-lm's prompt-cache shape) plus heap-wide operations."""

    def __init__(self, caches, cfg: HeapConfig):
        super().__init__(caches)
        self.cfg = cfg
        self.heap_layers = [c for c in caches if isinstance(c, HeapKVCache)]
        self.only_heap_layers = len(self.heap_layers) == len(caches)
        self.pages = None           # PageStore when recall is on (paging.attach_pages)
        self.compile_decode = False   # decode steps through compiled.py (--compile-decode)
        self.writer = None          # its background PageWriter
        self.recall_log: list[dict] = []      # one entry per recall: tokens, pages, ms

    def stock_layers(self) -> list:
        """The layers that are mlx-lm's own (sliding windows: its rotating cache)."""
        return [c for c in self if not isinstance(c, HeapKVCache)]

    def copy_stock_state(self, attrs: dict) -> dict:
        """mlx-lm's rotating cache writes into its arrays in place: copies of them."""
        return {k: mx.array(v) if isinstance(v, mx.array) else v for k, v in attrs.items()}

    def stock_window(self, layer) -> int:
        return layer.max_size   # (mlx-lm's rotating cache)

    def host_scores(self, layer) -> np.ndarray:
        """The layer's eviction scores [H_kv, resident] on the host (a rewind's pick)."""
        return np.array(pinned_scores(layer).astype(mx.float32))

    def make_room(self, n_new: int) -> int:
        """Evict where n_new more tokens would not fit; returns how many layers repacked.

        All evicting layers are scored and selected in one batched, lazy pass on the device."""
        plan = self.room_plan(n_new)
        if plan is not None:
            self.repack(plan)
        return 0 if plan is None else len(plan.layers)

    def room_plan(self, n_new: int) -> Optional[EvictionPlan]:
        """The eviction event n_new more tokens need (lazy), or None where they fit."""
        if n_new > self.cfg.append_room:
            raise HeapConfigError(f"{n_new} tokens at once exceed the append room ({self.cfg.append_room}: "
                                  f"max of slack and prefill chunk); chunk them")
        todo = [c for c in self.heap_layers if c.heap.needs_repack(n_new)]
        return plan_eviction(todo) if todo else None

    def repack(self, plan: EvictionPlan) -> None:
        """The one place an eviction event is applied: every layer's gather and re-rotation (lazy),
        evaluated together with the one transfer of keep indices the host's position tables need
        (with recall on, the same transfer carries the evicted K/V to the page store)."""
        staged = self.stage_repack(plan)
        mx.eval(staged.arrays)
        self.finish_repack(staged)

    def stage_repack(self, plan: EvictionPlan) -> "StagedRepack":
        """The device half of an eviction event, lazy: a decode batch evaluates several heaps'
        events at once (batch.py), then each finishes its own."""
        outgoing = recall.gather_evicted(self, plan) if self.pages is not None else None
        kept = [cache.take_kept(group.keep_indices[b], None if group.deltas is None else group.deltas[b])
                for group in plan.groups for b, cache in enumerate(group.layers)]
        if any(c.seat is not None for c in plan.layers):   # in a slab: reads first (cache.take_kept)
            mx.eval(kept, outgoing or [])
        for cache, k in zip((c for group in plan.groups for c in group.layers), kept):
            cache.write_kept(k)
        if outgoing is None:
            wire, parts = mx.concatenate([g.keep_indices.reshape(-1) for g in plan.groups]), None
        else:
            wire, parts = recall.page_out_blob(plan, outgoing)
        return StagedRepack(plan, outgoing, wire, parts, [c.state for c in plan.layers] + [wire])

    def finish_repack(self, staged: "StagedRepack") -> None:
        """The host half, once `staged.arrays` are evaluated: one transfer, then the position tables."""
        plan, host = staged.plan, np.array(staged.wire)
        if staged.outgoing is None:
            indices = split_keep_indices(host, [g.keep_indices.shape for g in plan.groups])
        else:
            indices = recall.page_out_host(self, plan, staged.outgoing, host, staged.parts)
        for cache, idx in zip(plan.layers, indices):
            cache.heap.apply(RepackPlan(keep_indices=idx, deltas=None))

    def evict(self, layers: list) -> None:
        """An eviction event over `layers` now, whatever their fill (recall makes room this way)."""
        self.repack(plan_eviction(layers))

    def to_device(self, host: np.ndarray) -> mx.array:
        """float16 or float32 on the host -> float32 on the device."""
        return mx.array(host).astype(mx.float32)

    def settle(self) -> None:
        mx.eval([c.state for c in self.heap_layers])

    def score_arrays(self) -> list:
        """Arrays the side pass updated; evaluate them with each step's token, so the
        lazy graph stays one step deep and the K/V buffers are updated in place."""
        out = []
        for c in self.heap_layers:
            out += [a for a in (c.scores, c.window, c.counts, c.qsum) if a is not None]
        return out

    @property
    def tokens_seen(self) -> int:
        return self.heap_layers[0].heap.seen if self.heap_layers else 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self if not c.empty())

    @property
    def kv_nbytes(self) -> int:
        return sum(c.kv_nbytes if isinstance(c, HeapKVCache) else c.nbytes for c in self if not c.empty())

    def stats(self) -> HeapStats:
        return combine([c.heap.stats() for c in self.heap_layers], self.kv_nbytes, paging.page_stats(self))


def check_heap(model, cfg: HeapConfig) -> tuple[list, list, dict]:
    """What a heap of `model` under `cfg` needs, without allocating it: mlx-lm's own caches for
    the model, the indices of the layers the heap takes (mlx-lm's plain KVCache), and each one's
    RoPE where cfg moves keys. Raises what the heap cannot do (no such layer; a rotation it
    cannot move a key by; recall without a RoPE module to store pages before)."""
    layers = list(model.layers)
    stock = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in layers]
    heap_ids = [i for i, c in enumerate(stock) if type(c) is KVCache]
    if not heap_ids:
        raise HeapConfigError(f"{type(model).__module__} has no full-attention KV layers for a heap")
    specs = {}
    for i in heap_ids:
        attn = attention_module(layers[i])
        rope = getattr(attn, "rope", None)
        specs[i] = RopeSpec.from_module(rope) if rope is not None and cfg.moves_keys else None
        if cfg.recall and specs[i] is None:
            raise HeapConfigError(f"recall needs the RoPE module of {type(attn).__name__}; use --recall off")
    return stock, heap_ids, specs


def make_heap_cache(model, cfg: HeapConfig, pages_dir: Optional[Path] = None,
                    budgets: Optional[list] = None, pages_state=None) -> HeapPromptCache:
    """Build the heap for `model`: heap layers where mlx-lm would use a plain KVCache;
    sliding-window layers keep mlx-lm's own (already bounded) rotating cache. With recall on,
    its page store lives in `pages_dir` (default: a temp dir that goes with the cache).
    `budgets`: the heap layers' budgets (default: cfg's profile over them; a pipeline stage
    passes its share of the whole model's). `pages_state`: the saved state its page store opens
    at (a saved heap's; None: a new store)."""
    attention.install()
    stock, heap_ids, specs = check_heap(model, cfg)
    budgets = budgets or cfg.layer_budgets(len(heap_ids))
    caches = list(stock)
    for j, i in enumerate(heap_ids):
        n_kv, head_dim = kv_geometry(attention_module(model.layers[i]))
        caches[i] = HeapKVCache(LayerHeap(cfg, n_kv, budgets[j], layer=j), specs[i])
    cache = HeapPromptCache(caches, cfg)
    if cfg.recall:
        paging.attach_pages(cache, n_kv, head_dim, pages_dir, pages_state)
    return cache
