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

from ...heap import PageGeometry, PageStore, PageWriter, SlotView, score_pages, select_pages


def attach_pages(cache, n_kv_heads: int, head_dim: int, root: Optional[Path] = None) -> None:
    """Give `cache` a page store (in `root`, or a temp dir removed with the cache) and a writer."""
    cfg = cache.cfg
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="localheap-pages-"))
        weakref.finalize(cache, shutil.rmtree, str(root), True)   # a moved store is gone from here: no-op
    geometry = PageGeometry(len(cache.heap_layers), n_kv_heads, head_dim, cfg.page_size, cfg.page_format)
    cache.pages = PageStore(root, geometry, cfg.disk_budget)
    cache.writer = PageWriter()


def page_out(cache, events: list[tuple]) -> None:
    """events: [(HeapLayer, RepackPlan)] of one eviction event, before the repacks run."""
    parts, jobs = [], []
    for layer, plan in events:
        slots = layer.heap.evicted_slots(plan)                               # [H_kv, n] numpy
        if slots.shape[1] == 0:
            continue
        D = layer.keys.shape[-1]
        idx = torch.as_tensor(slots, device=layer.device)[..., None].expand(-1, -1, D)
        keys = torch.gather(layer.keys[0].float(), 1, idx)                   # [H_kv, n, D] rotated
        positions = np.take_along_axis(layer.heap.positions[:, : layer.heap.resident], slots, axis=1)
        rotated_at = slots if layer.heap.cfg.positions == "compact" else positions
        parts += [layer.rope.rotate(keys, -rotated_at), torch.gather(layer.values[0].float(), 1, idx)]
        value = np.take_along_axis(plan.scores, slots, axis=1) if plan.scores is not None else None
        jobs.append((layer.heap.layer, positions, value, slots.shape))
    if not parts:
        return
    wire = torch.float32 if cache.cfg.page_format == "f32" else torch.float16
    host = torch.cat([p.reshape(-1) for p in parts]).to("cpu", wire).numpy()   # the event's one transfer
    store = cache.pages

    def write() -> None:
        at = 0
        for layer_id, positions, value, (H, n) in jobs:
            size = H * n * store.g.head_dim
            k = host[at: at + size].reshape(H, n, -1)
            v = host[at + size: at + 2 * size].reshape(H, n, -1)
            at += 2 * size
            store.append(layer_id, positions, k, v, value)

    cache.writer.submit(write)


def evict(cache, layers: list) -> None:
    """One eviction event over `layers`: plans, page-out (when paging), repacks."""
    plans: list[tuple] = []
    for layer in layers:
        view = SlotView(positions=layer.heap.view_positions(),
                        **{k: v.float().cpu().numpy() for k, v in layer.pending_view().items()})
        plans.append((layer, layer.heap.plan(view)))
    if cache.pages is not None:
        page_out(cache, plans)
    for layer, plan in plans:
        layer.repack(plan)


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
    store, kind = cache.pages, cache.cfg.recall_summary
    picked = {}
    for layer in cache.heap_layers:
        i = layer.heap.layer
        slots, *summary = store.summaries(i, kind)
        n_pages = layer.heap.recall_slots // store.g.page_size
        if len(slots) == 0 or n_pages == 0:
            continue
        best = select_pages(score_pages(queries[i], tuple(summary)), n_pages)  # [H_kv, k]
        picked[i] = store.load(i, slots[best])
    r = max((p[0].shape[1] for p in picked.values()), default=0)
    crowded = [layer for layer in cache.heap_layers if layer.heap.resident + r + L > layer.heap.capacity]
    if crowded:
        evict(cache, crowded)   # down to the policy's share: the recall region is free again
    if picked:
        flat = torch.cat([torch.from_numpy(np.concatenate([k.reshape(-1), v.reshape(-1)])) for _, k, v in picked.values()])
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
    return any(layer.heap.evicted > 0 or layer.heap.resident + n_new > layer.heap.capacity
               for layer in cache.heap_layers)
