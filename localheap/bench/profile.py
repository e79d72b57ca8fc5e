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

from ..generation import SamplingParams

HEAP_DIR = str(Path(__file__).resolve().parent.parent / "heap")


def _random_tokens(backend, n: int, seed: int) -> list[int]:
    vocab = backend.tokenizer.vocab_size if hasattr(backend.tokenizer, "vocab_size") else 1000
    return np.random.default_rng(seed).integers(10, max(11, min(vocab, 32000)), n).tolist()


def _sum(stats: dict, name: str, where: str, own: bool = False) -> float:
    """Seconds in functions called `name` whose file path contains `where` (cumulative, or own)."""
    return sum(tt if own else ct for (path, _, fn), (_, _, tt, ct, _) in stats.items()
               if fn == name and where in path)


def profile_decode(backend, cfg, context: int, steps: int = 128, seed: int = 0) -> dict:
    """Profile `steps` sampled decode steps after a prefill of `context` random tokens.

    Also times the same number of steps without the profiler (cProfile inflates Python-heavy
    parts). Shares: the model's matmuls (torch's linear, own time), attention (sdpa, own time),
    the heap's scoring side pass (observe), its appends (the torch layer's update), eviction
    events (make_room), sampling with the host sync, and the rest (Python, the transformers
    layers' glue, RoPE, norms). With --decode-attention fused, the fused kernel's attention and
    scores; with --compile-decode, the compiled graphs (their matmuls inside). The op-level parts
    are torch's; on MLX the lazy graph puts the device work where it is evaluated (sampling)."""
    tokens = _random_tokens(backend, context + 1, seed)
    cache = backend.new_cache(cfg)
    backend.prefill(cache, tokens[:-1])
    params = SamplingParams(temperature=0.7, max_tokens=steps, seed=seed)
    for _ in backend.generate(cache, tokens[-1:], SamplingParams(temperature=0.7, max_tokens=8, seed=seed)):
        pass   # warm-up
    t0 = time.perf_counter()
    for _ in backend.generate(cache, tokens[-1:], params):
        pass
    plain = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in backend.generate(cache, tokens[-1:], params):
        pass
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof).stats
    parts = {
        "matmuls (linear: projections, MLP, head)": _sum(st, "<built-in method torch._C._nn.linear>", "~", own=True),
        "attention (sdpa)": _sum(st, "<built-in method torch._C._nn.scaled_dot_product_attention>", "~",
                                 own=True),
        "fused attention and scores (--decode-attention fused)": _sum(st, "_fused_decode", "backends/torch/attention.py"),
        "compiled graphs (--compile-decode: norms, projections, RoPE, MLP, head, their matmuls)":
            _sum(st, "graph", "backends/torch/compiled.py"),
        "heap scoring side pass (observe)": _sum(st, "observe", "/backends/"),
        "heap appends (cache layer update)": _sum(st, "update", "backends/torch/layer.py"),
        "heap eviction events (make_room)": _sum(st, "make_room", "/backends/"),
        "sampling and host sync": _sum(st, "sample", "/backends/"),
    }
    parts["rest (Python, transformers glue, RoPE, norms)"] = wall - sum(parts.values())
    return {"context": context, "steps": steps, "ms_per_step": 1000 * plain / steps,
            "ms_per_step_profiled": 1000 * wall / steps, "wall_s": wall, "parts_s": parts}


def report_decode(row: dict, backend) -> str:
    wall, steps = row["wall_s"], row["steps"]
    lines = [f"model {backend.model_name} | backend {backend.name} | decode after {row['context']:,} tokens: "
             f"{row['ms_per_step']:.2f} ms/token ({steps} steps), {row['ms_per_step_profiled']:.2f} under cProfile"]
    lines += [f"  {name:46s} {1000 * s / steps:6.2f} ms  {100 * s / wall:5.1f}%"
              for name, s in row["parts_s"].items() if s > 0]   # a part this step does not run: left out
    return "\n".join(lines)


def profile_prefill(backend, cfg, context: int, seed: int = 0) -> dict:
    """Profile backend.prefill of `context` random tokens into a fresh heap; returns seconds per part."""
    tokens = _random_tokens(backend, context, seed)
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
    events = _sum(stats, "make_room", "/backends/")
    heap_own = sum(tt for (path, _, _), (_, _, tt, _, _) in stats.items() if path.startswith(HEAP_DIR))
    observe = _sum(stats, "observe", "/backends/")
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
