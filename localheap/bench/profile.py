"""`localheap bench profile`: where a long heap prefill spends its time, by cProfile.

Shares of the wall time of one prefill of random tokens:
- eviction events: `make_room` (scoring, selection, gather and re-rotation of all layers, and the
  one host transfer per event). On a CPU this includes the device work, so it is an upper bound
  on the host's share.
- heap bookkeeping: own time of every function in `localheap/heap/` (slot tables, plans), whether
  called from an event or from a forward pass (appends).
- scoring side pass: `observe` (the attention-mass pass policies read), device work.
- the rest: the model's forward.
cProfile's per-call overhead inflates Python-heavy code, so the host's shares are overstated.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

import numpy as np

HEAP_DIR = str(Path(__file__).resolve().parent.parent / "heap")


def profile_prefill(backend, cfg, context: int, seed: int = 0) -> dict:
    """Profile backend.prefill of `context` random tokens into a fresh heap; returns seconds per part."""
    vocab = backend.tokenizer.vocab_size if hasattr(backend.tokenizer, "vocab_size") else 1000
    tokens = np.random.default_rng(seed).integers(10, max(11, min(vocab, 32000)), context).tolist()
    warm = backend.new_cache(cfg)
    backend.prefill(warm, tokens[: min(context, 2 * cfg.chunk)])   # allocations, kernel selection
    del warm
    cache = backend.new_cache(cfg)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    backend.prefill(cache, tokens)
    backend.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    events = sum(ct for (path, _, name), (_, _, _, ct, _) in stats.items()
                 if name == "make_room" and "/backends/" in path)
    heap_own = sum(tt for (path, _, _), (_, _, tt, _, _) in stats.items() if path.startswith(HEAP_DIR))
    observe = sum(ct for (path, _, name), (_, _, _, ct, _) in stats.items()
                  if name == "observe" and "/backends/" in path)
    return {"context": context, "wall_s": wall, "tok_s": context / wall, "events_s": events,
            "heap_bookkeeping_s": heap_own, "observe_s": observe,
            "evictions": backend.stats(cache).evictions, "chunk": cfg.chunk}


def report(row: dict, backend) -> str:
    wall = row["wall_s"]

    def share(key: str) -> str:
        return f"{row[key]:8.2f} s  {100 * row[key] / wall:5.1f}%"

    host = row["events_s"] + row["heap_bookkeeping_s"]
    return "\n".join([
        f"model {backend.model_name} | backend {backend.name} | prefill {row['context']:,} tokens in "
        f"{wall:.1f} s ({row['tok_s']:,.0f} tok/s, under cProfile) | chunk {row['chunk']} | "
        f"{row['evictions']} eviction events",
        f"  eviction events (make_room, all layers)   {share('events_s')}",
        f"  heap bookkeeping (localheap/heap, own)    {share('heap_bookkeeping_s')}",
        f"  scoring side pass (observe, device work)  {share('observe_s')}",
        f"  host-side heap work, upper bound          {host:8.2f} s  {100 * host / wall:5.1f}%",
    ])
