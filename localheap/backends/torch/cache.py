"""HeapCache: a transformers `Cache` whose full-attention layers are heaps.

Passed to the model as `past_key_values`. Sliding-window layers (gemma3) keep
transformers' own, already bounded, sliding layer. The heap makes room before every
forward pass and hands the model explicit position_ids, so RoPE positions are final
before anything is rotated; layers whose position differs from the model-wide one
(pyramid budgets, sliding layers in compact mode) rotate by the difference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from ...heap import HeapConfig, HeapConfigError, LayerHeap, RepackPlan, combine
from ...heap.stats import HeapStats
from .. import paging
from ..slots import HeapRollback
from . import attention, recall
from .layer import HeapLayer
from .rope import RopeSpec
from .select import EvictionPlan, pinned_scores, plan_eviction


class SlidingLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer, at absolute positions even when the heap compacts."""

    def __init__(self, sliding_window: int, rope: RopeSpec | None):
        super().__init__(sliding_window=sliding_window)
        self.rope = rope
        self.rope_delta = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.rope_delta:
            key_states = self.rope.rotate(key_states, self.rope_delta)
        return super().update(key_states, value_states, *args, **kwargs)

    @property
    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes


class HeapCache(HeapRollback, Cache):
    """One cache layer per model layer (heap or sliding) plus heap-wide operations."""

    def __init__(self, layers: list, cfg: HeapConfig):
        super().__init__(layers=layers)
        self.cfg = cfg
        self.heap_layers = [layer for layer in layers if isinstance(layer, HeapLayer)]
        self.only_heap_layers = len(self.heap_layers) == len(layers)
        self.device = self.heap_layers[0].device
        self.fused_decode = False   # decode outputs from kernels/decode_attention instead of stock sdpa
        self.lean_decode = True     # decode steps through lean.py where the model allows (False: transformers' forward)
        self.compile_decode = False   # the lean step's per-token parts compiled (compiled.py; opt-in)
        self.cuda_graphs = False      # a slab's decode step as a replayed CUDA graph (graphed.py; opt-in)
        self.pages = None           # PageStore when recall is on (paging.attach_pages)
        self.writer = None          # its background PageWriter
        self.capture: Optional[dict] = None   # a recall probe's queries per heap layer, while it runs
        self.recall_log: list[dict] = []      # one entry per recall: tokens, pages, ms

    def stock_layers(self) -> list:
        """The layers that are transformers' own (sliding windows)."""
        return [layer for layer in self.layers if not isinstance(layer, HeapLayer)]

    def stock_window(self, layer) -> int:
        return layer.sliding_window

    def host_scores(self, layer) -> np.ndarray:
        """The layer's eviction scores [H_kv, resident] on the host (a rewind's pick)."""
        return pinned_scores(layer).float().cpu().numpy()

    def make_room(self, n_new: int) -> int:
        """Evict where n_new more tokens would not fit; returns how many layers repacked.

        All evicting layers are scored and selected in one batched pass on the device."""
        todo = self.due(n_new)
        if todo:
            self.repack(plan_eviction(todo))
        return len(todo)

    def due(self, n_new: int) -> list:
        """The heap layers that must evict before n_new more tokens fit (make_room's event)."""
        if n_new > self.cfg.append_room:
            raise HeapConfigError(f"{n_new} tokens at once exceed the append room ({self.cfg.append_room}: "
                                  f"max of slack and prefill chunk); chunk them")
        if n_new == 1 and self.cfg.stagger and len(self.heap_layers) > 1:
            return self._staggered()
        return [layer for layer in self.heap_layers if layer.heap.needs_repack(n_new)]

    def _staggered(self) -> list:
        """A decode step's evicting layers with events spread one layer a step (cfg.stagger). Layers
        due together (their slack full on the same step) evict on consecutive steps ending at
        that one, the first L - 1 early; a layer `e` steps early keeps `e` slots fewer, so that on
        its due step it holds what it would have and the layers line up again (the same slots and
        positions in every layer between events: no per-layer position shift, nothing to rotate).
        Each layer gets the latest step at or before its due one that no layer after it in that
        order has taken, and evicts when that step is this one. One layer's event costs a step
        about 1/L of a whole one: in a decode batch every row waits for every event
        (docs/serve_bench.md, "Eighth round")."""
        layers = self.heap_layers
        due_in = [max(0, layer.heap.keep + self.cfg.slack - layer.heap.resident) for layer in layers]
        if min(due_in) >= len(due_in):   # nothing due within as many steps as there are layers
            return []
        at, later = [0] * len(due_in), None
        for i in sorted(range(len(due_in)), key=lambda i: (due_in[i], i), reverse=True):
            later = due_in[i] if later is None else min(due_in[i], later - 1)
            at[i] = later
        now = [i for i, step in enumerate(at) if step <= 0]
        for i in now:
            layers[i].heap.early = due_in[i]
        return [layers[i] for i in now]

    def repack(self, plan: EvictionPlan) -> None:
        """The one place an eviction event is applied: every layer's gather and re-rotation on the
        device (no sync), then the host's position tables from one transfer of the keep indices
        (with recall on, the same transfer carries the evicted K/V to the page store)."""
        outgoing = recall.gather_evicted(self, plan) if self.pages is not None else None
        for group in plan.groups:
            for b, layer in enumerate(group.layers):
                layer.gather_kept(group.keep_indices[b], None if group.deltas is None else group.deltas[b])
        if (outgoing is None or not outgoing) and defers_positions(self.device):
            resolve = plan.host_indices_later()   # nothing to page out: the host's tables wait, not the host
            for j, (layer, keep) in enumerate(zip(plan.layers, plan.keeps())):
                layer.heap.apply_later(keep, lambda j=j: resolve()[j])
            return
        indices = plan.host_indices() if outgoing is None else recall.page_out(self, plan, outgoing)
        for layer, idx in zip(plan.layers, indices):
            layer.heap.apply(RepackPlan(keep_indices=idx, deltas=None))

    def evict(self, layers: list) -> None:
        """An eviction event over `layers` now, whatever their fill (recall makes room this way)."""
        self.repack(plan_eviction(layers))

    def to_device(self, host: np.ndarray) -> torch.Tensor:
        """float16 or float32 on the host -> float32 on the device (float16 crosses as float16)."""
        return torch.from_numpy(host).to(self.device).float()

    def settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def position_ids(self, n_new: int) -> torch.Tensor:
        """[1, n_new] positions for the next forward; sets each layer's offset from them."""
        base = self.heap_layers[0].heap.rope_offset()
        for layer in self.layers:
            own = layer.heap.rope_offset() if isinstance(layer, HeapLayer) else layer.get_seq_length()
            layer.rope_delta = own - base
            assert not layer.rope_delta or layer.rope is not None, "a position shift needs the RoPE spec"
        return torch.arange(base, base + n_new, device=self.device)[None]

    @property
    def tokens_seen(self) -> int:
        return self.heap_layers[0].heap.seen

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def kv_nbytes(self) -> int:
        return sum(layer.kv_nbytes if isinstance(layer, HeapLayer) else layer.nbytes for layer in self.layers)

    def stats(self) -> HeapStats:
        return combine([layer.heap.stats() for layer in self.heap_layers], self.kv_nbytes, self.page_stats())

    def page_stats(self) -> Optional[dict]:
        return paging.page_stats(self)


DEFER_POSITIONS = os.environ.get("LOCALHEAP_DEFER_POSITIONS", "cuda")   # cuda, always (tests), never


def defers_positions(device: torch.device) -> bool:
    """Whether an eviction event leaves the host's position tables to settle when first read
    (LayerHeap.apply_later) instead of waiting for the device's keep indices: on CUDA, where that
    wait drains the stream at every prefill chunk and the host then launches the next chunk's
    kernels onto an idle card. On the CPU the indices are host memory already: nothing to wait for."""
    return DEFER_POSITIONS == "always" or (DEFER_POSITIONS == "cuda" and device.type == "cuda")


def decoder_layers(model) -> list:
    return list(model.get_decoder().layers)


def kv_geometry(model) -> tuple[int, int]:
    """(kv_heads, head_dim) of the model's attention layers."""
    attn = decoder_layers(model)[0].self_attn
    text = model.config.get_text_config()
    n_kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads   # phi3 projects q, k, v in one
    return int(n_kv), int(attn.head_dim)


def model_ropes(model, kinds: set, head_dim: int) -> dict:
    """The model's rotation per layer kind, one RopeSpec shared by all its caches, so that the
    cos/sin tables of re-rotation and page-out are built once per model, not in each session's
    first eviction."""
    have = model.__dict__.setdefault("_localheap_ropes", {})
    for kind in kinds:
        if (kind, head_dim) not in have:
            have[(kind, head_dim)] = RopeSpec.from_model(model, kind, head_dim)
    return {kind: have[(kind, head_dim)] for kind in kinds}


def check_heap(model, cfg: HeapConfig) -> tuple[list, list, dict]:
    """What a heap of `model` under `cfg` needs, without allocating it: its layer kinds, their
    kwargs, and the RoPE of each kind where cfg moves keys. Raises what the heap cannot do
    (no full-attention layer; a rotation it cannot move a key by)."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(model.config.get_text_config())
    if "full_attention" not in layer_types:
        raise HeapConfigError(f"{type(model).__name__} has no full-attention KV layers for a heap")
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise HeapConfigError(f"layer type {sorted(unknown)[0]!r} ({type(model).__name__}) is not supported by the heap")
    ropes = model_ropes(model, set(layer_types), kv_geometry(model)[1]) if cfg.moves_keys else {}
    return layer_types, layer_kwargs, ropes


def make_heap_cache(model, cfg: HeapConfig, pages_dir: Optional[Path] = None, pages_state=None) -> HeapCache:
    """Build the heap for `model`: heap layers where transformers would use a full-attention
    layer; sliding-window layers keep transformers' own bounded cache layer. With recall on,
    its page store lives in `pages_dir` (default: a temp dir that goes with the cache), opened at
    `pages_state` (a saved heap's; None: a new store)."""
    attention.install(model)
    layer_types, layer_kwargs, ropes = check_heap(model, cfg)
    budgets = iter(cfg.layer_budgets(sum(t == "full_attention" for t in layer_types)))
    n_kv, head_dim = kv_geometry(model)
    weight = decoder_layers(model)[0].self_attn.o_proj.weight
    layers = []
    for kind, kwargs in zip(layer_types, layer_kwargs):
        if kind == "full_attention":
            heap = LayerHeap(cfg, n_kv, next(budgets), layer=sum(isinstance(x, HeapLayer) for x in layers))
            layers.append(HeapLayer(heap, head_dim, weight.dtype, weight.device, ropes.get(kind)))
        else:   # sliding_attention (check_heap refused any other kind)
            layers.append(SlidingLayer(kwargs["sliding_window"], ropes.get(kind)))
    cache = HeapCache(layers, cfg)
    if cfg.recall:
        paging.attach_pages(cache, n_kv, head_dim, pages_dir, pages_state)
    return cache

