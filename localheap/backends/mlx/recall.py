"""The recall tier's MLX half: the evicted K/V off the device, and a question's queries.

Page-out: at an eviction event the evicted slots of every repacking layer are gathered
and un-rotated to pre-RoPE keys (lazily), then evaluated with the event's gathers and
read back in ONE transfer with its keep indices (every `np.array` of an mx array waits
for the device); backends/paging.py queues them for the background page writer. Recall
(paging.recall) feeds the question once as a probe whose only effect is its queries.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from .. import paging
from ..slots import split_keep_indices
from .cache import HeapKVCache

_NUMPY = {mx.int32: np.int32, mx.float32: np.float32, mx.float16: np.float16}


def gather_evicted(cache, plan) -> list[tuple]:
    """paging.gather_evicted with mx gathers (lazy): per evicting layer (layer, slots [H_kv, n],
    pre-RoPE keys and values [H_kv, n, D], value [H_kv, n])."""
    wire = mx.float32 if cache.cfg.page_format == "f32" else mx.float16

    def take(layer, idx: mx.array, scores: mx.array) -> tuple:
        n = layer.heap.resident
        keys = mx.take_along_axis(layer.keys[0, :, :n, :], idx[..., None], axis=1).astype(mx.float32)
        values = mx.take_along_axis(layer.values[0, :, :n, :], idx[..., None], axis=1)
        rotated_at = idx
        if layer.heap.cfg.positions == "absolute":
            rotated_at = mx.take_along_axis(mx.array(layer.heap.positions[:, :n].astype(np.int32)), idx, axis=1)
        value = mx.take_along_axis(scores, idx, axis=1).astype(mx.float32)
        return layer.rope.rotate(keys, -rotated_at).astype(wire), values.astype(wire), value

    return paging.gather_evicted(plan, take)


def page_out_blob(plan, outgoing: list[tuple]) -> tuple:
    """The device half of a page-out, lazy: the event's ONE device-to-host transfer as (blob uint8,
    its (dtype, count) parts): the keep indices, then the evicted K/V (every layer's)."""
    arrays = [mx.concatenate([g.keep_indices.reshape(-1) for g in plan.groups])]
    arrays += [a.reshape(-1) for o in outgoing for a in o[1:]]
    blob = mx.concatenate([mx.view(a, mx.uint8) for a in arrays])
    return blob, [(_NUMPY[a.dtype], a.size) for a in arrays]


def page_out_host(cache, plan, outgoing: list[tuple], blob: np.ndarray, parts: list) -> list[np.ndarray]:
    """The host half, from the blob read back: the evicted K/V queued for the page writer; returns
    the keep indices per layer (as EvictionPlan.host_indices gives them)."""
    host = paging.split_blob(blob, parts)
    paging.queue_page_out(cache, [o[0] for o in outgoing], host[1:])
    return split_keep_indices(host[0], [g.keep_indices.shape for g in plan.groups])


def probe(model, cache, question: Sequence[int]) -> dict:
    """Feed `question` once for its pre-RoPE queries per heap layer, then undo every trace of it.
    Only the queries are evaluated: the lazy graph never computes the probe's logits."""
    snaps = [c.snapshot() for c in cache.heap_layers]
    # stock layers (sliding windows) edit their arrays in place: keep copies
    others = [(c, {k: mx.array(v) if isinstance(v, mx.array) else v for k, v in vars(c).items()})
              for c in cache if not isinstance(c, HeapKVCache)]
    for c in cache.heap_layers:
        c.capture = []
    try:
        model(mx.array(list(question), dtype=mx.uint32)[None], cache=cache)
        host = np.array(mx.stack([c.capture[0] for c in cache.heap_layers]))   # one transfer, all layers
        queries = {c.heap.layer: q for c, q in zip(cache.heap_layers, host)}
    finally:
        for c, snap in zip(cache.heap_layers, snaps):
            c.capture = None
            c.rollback(snap)
        for c, attrs in others:
            vars(c).clear()
            vars(c).update(attrs)
    return queries
