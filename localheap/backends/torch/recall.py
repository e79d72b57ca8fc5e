"""The recall tier on torch: evicted K/V paged out, the best pages recalled per question.

Page-out: at an eviction event the evicted slots of every repacking layer are gathered
and un-rotated to pre-RoPE keys on the device, then leave it in ONE transfer; a
background thread (heap.recall.PageWriter) writes the pages. Recall: the question is
fed once as a probe whose only effect is its queries (the heap is rolled back after),
every layer scores its pages against them, and the best pages are merged into the
heap, in token order, rotated to their new slots (compact) or original positions
(absolute). The question is then fed for real, now seeing the recalled pages.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ...heap import PageGeometry, PageStore, PageWriter, score_pages, select_pages


def attach_pages(cache, n_kv_heads: int, head_dim: int, root: Optional[Path] = None) -> None:
    """Give `cache` a page store (in `root`, or a temp dir removed with the cache) and a writer."""
    cfg = cache.cfg
    cache.pages_owned = root is None   # a temp dir: a save moves it beside the heap file
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="localheap-pages-"))
        weakref.finalize(cache, shutil.rmtree, str(root), True)   # a moved store is gone from here: no-op
    geometry = PageGeometry(len(cache.heap_layers), n_kv_heads, head_dim, cfg.page_size, cfg.page_format)
    cache.pages = PageStore(root, geometry, cfg.disk_budget, cfg.recall_summary)
    cache.writer = PageWriter()


def gather_evicted(cache, plan) -> list[tuple]:
    """Device half of a page-out (no sync), before the repack overwrites the slots: per evicting
    layer (layer, slots [H_kv, n], pre-RoPE keys and values [H_kv, n, D], value [H_kv, n])."""
    wire = torch.float32 if cache.cfg.page_format == "f32" else torch.float16
    out = []
    for group in plan.groups:
        n, keep = group.layers[0].heap.resident, group.keep_indices.shape[-1]
        if n == keep:
            continue
        # evicted slots, ascending: a stable sort puts the True (evicted) slots first, in order
        slots = torch.sort(group.evicted.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., : n - keep]
        for b, layer in enumerate(group.layers):
            idx = slots[b]                                                   # [H_kv, n_ev]
            gather_idx = idx[..., None].expand(-1, -1, layer.keys.shape[-1])
            keys = torch.gather(layer.keys[0, :, :n], 1, gather_idx).float()
            values = torch.gather(layer.values[0, :, :n], 1, gather_idx)
            rotated_at = idx
            if layer.heap.cfg.positions == "absolute":
                rotated_at = torch.gather(torch.as_tensor(layer.heap.positions[:, :n], device=layer.device), 1, idx)
            value = torch.gather(group.scores[b], 1, idx).float()
            out.append((layer, idx, layer.rope.rotate(keys, -rotated_at).to(wire), values.to(wire), value))
    return out


def page_out(cache, plan, outgoing: list[tuple]) -> list[np.ndarray]:
    """The event's ONE device-to-host transfer: the keep indices (returned, per layer, as
    EvictionPlan.host_indices gives them) and the evicted K/V, queued for the page writer."""
    tensors = [g.keep_indices.reshape(-1) for g in plan.groups]
    for _, idx, k, v, value in outgoing:
        tensors += [idx.reshape(-1), k.reshape(-1), v.reshape(-1), value.reshape(-1)]
    blob = torch.cat([t.contiguous().view(torch.uint8) for t in tensors]).cpu().numpy()
    host, at = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        host.append(blob[at: at + size].view(_NUMPY[t.dtype]))
        at += size
    keep = []
    for g, flat in zip(plan.groups, host):
        B, H, k = g.keep_indices.shape
        keep.extend(flat.reshape(B, H, k))
    jobs = []
    for i, (layer, idx, k, _, _) in enumerate(outgoing):
        slots, keys, values, value = host[len(plan.groups) + 4 * i: len(plan.groups) + 4 * i + 4]
        H, n_ev, D = k.shape
        slots = slots.reshape(H, n_ev)
        positions = np.take_along_axis(layer.heap.positions[:, : layer.heap.resident], slots, axis=1)
        jobs.append((layer.heap.layer, positions, keys.reshape(H, n_ev, D), values.reshape(H, n_ev, D),
                     value.reshape(H, n_ev)))
    store = cache.pages

    def write() -> None:
        for job in jobs:
            store.append(*job)

    if jobs:
        cache.writer.submit(write)
    return keep


_NUMPY = {torch.int64: np.int64, torch.float32: np.float32, torch.float16: np.float16}


def recall(model, cache, question: torch.Tensor) -> dict:
    """Before `question` ([L] ids, L <= slack) is fed: release the last recall, probe the question
    for its queries, load each layer's best pages. Returns what was recalled, for the stats."""
    t0 = time.perf_counter()
    L = question.shape[0]
    for layer in cache.heap_layers:
        release = layer.heap.release_plan()
        if release is not None:
            layer.repack(release, evicting=False)
    cache.make_room(L)
    queries = probe(model, cache, question)                                  # {layer: [H_kv, G*L, D]}
    cache.writer.drain()
    store = cache.pages
    picked = {}
    for layer in cache.heap_layers:
        i = layer.heap.layer
        slots, *summary = store.summaries(i)
        n_pages = layer.heap.recall_slots // store.g.page_size
        if len(slots) == 0 or n_pages == 0:
            continue
        best = select_pages(score_pages(queries[i], tuple(summary)), n_pages)  # [H_kv, k]
        picked[i] = store.load(i, slots[best])
    r = max((p[0].shape[1] for p in picked.values()), default=0)
    crowded = [layer for layer in cache.heap_layers if layer.heap.resident + r + L > layer.heap.capacity]
    if crowded:
        cache.evict(crowded)   # down to the policy's share: the recall region is free again
    if picked:
        flat = torch.cat([torch.from_numpy(np.concatenate([k.reshape(-1), v.reshape(-1)]))
                          for _, k, v in picked.values()])
        flat = flat.to(cache.device)                                        # one transfer to the device
        at = 0
        for layer in cache.heap_layers:
            if layer.heap.layer not in picked:
                continue
            pos, k, _ = picked[layer.heap.layer]
            size = k.size
            keys = flat[at: at + size].view(k.shape)
            values = flat[at + size: at + 2 * size].view(k.shape)
            at += 2 * size
            layer.merge(layer.heap.merge(pos), keys, values)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    tokens = sum(p[0].shape[1] for p in picked.values()) // max(1, len(cache.heap_layers))
    event = {"tokens": tokens, "pages": tokens // store.g.page_size,
             "ms": round(1000 * (time.perf_counter() - t0), 2)}
    cache.recall_log.append(event)
    return event


def probe(model, cache, question: torch.Tensor) -> dict:
    """Feed `question` once for its pre-RoPE queries per heap layer, then undo every trace of it."""
    heap_snaps = [layer.snapshot() for layer in cache.heap_layers]
    others = [(layer, dict(vars(layer))) for layer in cache.layers if layer not in cache.heap_layers]
    cache.capture = {}
    try:
        with torch.no_grad():
            model(input_ids=question[None], position_ids=cache.position_ids(question.shape[0]),
                  past_key_values=cache, use_cache=True, logits_to_keep=1, heap=cache)
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


def needs_recall(cache, n_new: int) -> bool:
    """Recall only where something was or will be evicted: otherwise the heap is the stock cache."""
    if cache.pages is None:
        return False
    chunk = cache.cfg.chunk
    for layer in cache.heap_layers:
        heap = layer.heap
        if heap.evicted > 0:
            return True
        resident, left = heap.resident, n_new
        while left > 0:   # prefill's chunks: does one of them make room?
            c = min(chunk, left)
            if resident + c > heap.keep + max(heap.cfg.slack, c):
                return True
            resident, left = resident + c, left - c
    return False
