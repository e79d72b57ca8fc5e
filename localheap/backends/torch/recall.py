"""The recall tier's torch half: the evicted K/V off the device, and a question's queries.

Page-out: at an eviction event the evicted slots of every repacking layer are gathered
and un-rotated to pre-RoPE keys on the device, then leave it in ONE transfer with the
event's keep indices; backends/paging.py queues them for the background page writer.
Recall (paging.recall) feeds the question once as a probe whose only effect is its
queries (`probe`: the heap is rolled back after).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import paging
from ..slots import split_keep_indices
from . import slab_cpu
from .attention import cache_kwarg

_NUMPY = {torch.int64: np.int64, torch.float32: np.float32, torch.float16: np.float16}


def gather_evicted(cache, plan) -> list[tuple]:
    """paging.gather_evicted with torch gathers (no sync): per evicting layer (layer, slots
    [H_kv, n], pre-RoPE keys and values [H_kv, n, D], value [H_kv, n])."""
    wire = torch.float32 if cache.cfg.page_format == "f32" else torch.float16

    def take(layer, idx: torch.Tensor, scores: torch.Tensor) -> tuple:
        value = torch.gather(scores, 1, idx).float()
        kernel = (slab_cpu.evicts(layer.keys) if layer.heap.cfg.positions != "absolute" and layer.rope.standard
                  else None)   # the kernel rotates whole heads in split halves
        if kernel is not None:   # gathered and un-rotated in one pass, the same bits
            cos, sin = layer.rope.table(layer.device, layer.keys.shape[2])
            pre, values = kernel.take_rotated(layer.keys[0], layer.values[0], idx.contiguous(), cos, sin)
            return pre.to(wire), values.to(wire), value
        n = layer.heap.resident
        gather_idx = idx[..., None].expand(-1, -1, layer.keys.shape[-1])
        keys = torch.gather(layer.keys[0, :, :n], 1, gather_idx).float()
        values = torch.gather(layer.values[0, :, :n], 1, gather_idx)
        if layer.heap.cfg.positions == "absolute":
            rotated_at = torch.gather(torch.as_tensor(layer.heap.positions[:, :n], device=layer.device), 1, idx)
            pre = layer.rope.rotate(keys, -rotated_at)
        else:   # a key sits rotated at its slot: the cached table of the slot range, the same bits
            pre = layer.rope.shift_back(keys, idx, layer.keys.shape[2])
        return pre.to(wire), values.to(wire), value

    return paging.gather_evicted(plan, take)


def page_out(cache, plan, outgoing: list[tuple]) -> list[np.ndarray]:
    """The event's ONE device-to-host transfer: the keep indices (returned, per layer, as
    EvictionPlan.host_indices gives them) and the evicted K/V, queued for the page writer.
    On the CPU there is nothing to transfer: the host arrays are views of the tensors."""
    tensors = [torch.cat([g.keep_indices.reshape(-1) for g in plan.groups])]
    tensors += [t.reshape(-1) for o in outgoing for t in o[1:]]
    if tensors[0].device.type == "cpu":   # host memory already (fresh tensors nothing else writes): views
        host = [t.contiguous().numpy() for t in tensors]
    else:
        blob = torch.cat([t.contiguous().view(torch.uint8) for t in tensors]).cpu().numpy()
        host = paging.split_blob(blob, [(_NUMPY[t.dtype], t.numel()) for t in tensors])
    paging.queue_page_out(cache, [o[0] for o in outgoing], host[1:])
    return split_keep_indices(host[0], [tuple(g.keep_indices.shape) for g in plan.groups])


def probe(model, cache, question: torch.Tensor) -> dict:
    """Feed `question` once for its pre-RoPE queries per heap layer, then undo every trace of it."""
    heap_snaps = [layer.snapshot() for layer in cache.heap_layers]
    others = [(layer, dict(vars(layer))) for layer in cache.layers if layer not in cache.heap_layers]
    cache.capture = {}
    try:
        with torch.no_grad():
            model(input_ids=question[None], position_ids=cache.position_ids(question.shape[0]),
                  **cache_kwarg(model, cache), use_cache=True, logits_to_keep=1, heap=cache)
        ids = sorted(cache.capture)
        host = torch.stack([cache.capture[i] for i in ids]).cpu().numpy()   # one transfer, all layers
        queries = dict(zip(ids, host))
    finally:
        cache.capture = None
        for layer, snap in zip(cache.heap_layers, heap_snaps):
            layer.rollback(snap)
        for layer, attrs in others:   # sliding layers: their update rebinds new tensors, never edits in place
            vars(layer).clear()
            vars(layer).update(attrs)
    return queries
