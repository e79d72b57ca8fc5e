"""MLX timings for `localheap bench`: the heap against mlx-lm's own caches, same run."""

from __future__ import annotations

import gc
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.sample_utils import make_sampler

from ...generation import SamplingParams
from ...heap import HeapConfig
from .generate import generate_tokens
from .heapcache import make_heap_cache

STOCK_PREFILL_STEP = 2048   # mlx-lm's default prefill_step_size


def random_prompt(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab_size, n).tolist()


def _timed(tokens_iter, n_decode: int) -> tuple[float, float, int]:
    """(prefill seconds incl. first token, decode seconds, decoded) from a token iterator."""
    t0 = time.perf_counter()
    t_first, count = None, 0
    for _ in tokens_iter:
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
        if count >= n_decode + 1:
            break
    t_end = time.perf_counter()
    return t_first - t0, t_end - t_first, count - 1


def _stock_caches(model, kind: str, max_size: int, keep: int):
    n = len(model.layers)
    if kind == "stock-full":
        return [KVCache() for _ in range(n)]
    # mlx-lm's make_prompt_cache ignores max_kv_size for models with make_cache: build it here
    return [RotatingKVCache(max_size=max_size, keep=keep) for _ in range(n)]


def time_path(backend, kind: str, prompt: list[int], n_decode: int, cfg: HeapConfig) -> dict:
    model = backend.model
    mx.clear_cache()
    mx.reset_peak_memory()
    if kind in ("heap", "heap-paging", "heap-compiled"):   # paging: the recall tier on
        cache = backend.new_cache(cfg.with_(recall=True) if kind == "heap-paging" else cfg)
        cache.compile_decode = kind == "heap-compiled"   # per-token parts mx.compile'd (compiled.py)
        it = generate_tokens(model, cache, prompt, SamplingParams(max_tokens=n_decode + 1))
    else:
        cache = _stock_caches(model, kind, cfg.sinks + cfg.budget, cfg.sinks)
        it = (t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n_decode + 1,
                                          sampler=make_sampler(0.0), prompt_cache=cache,
                                          prefill_step_size=STOCK_PREFILL_STEP))
    t_pre, t_dec, decoded = _timed(it, n_decode)
    row = {"path": kind, "context": len(prompt), "prefill_tok_s": len(prompt) / t_pre,
           "decode_tok_s": decoded / t_dec if t_dec > 0 else None, "peak_bytes": mx.get_peak_memory()}
    del cache, it
    gc.collect()
    return row


def run_speed(backend, contexts: list[int], cfg: HeapConfig, decode_tokens: int = 64,
              paths=("stock-full", "stock-rotating", "heap"), log: Optional[Callable[[str], None]] = None,
              repeats: int = 1) -> list[dict]:
    """Rows per (context, path); the best of `repeats` runs per cell, paths interleaved."""
    rows = []
    vocab = backend.model.args.vocab_size
    for ctx in contexts:
        prompt = random_prompt(vocab, ctx, seed=ctx)
        time_path(backend, "heap", prompt[: min(ctx, 256)], 4, cfg)   # warm-up compile/alloc
        best: dict[str, dict] = {}
        for _ in range(repeats):
            for path in paths:
                if log:
                    log(f"context {ctx:,}: {path} ...")
                r = time_path(backend, path, prompt, decode_tokens, cfg)
                old = best.get(path)
                if old is None or (r["decode_tok_s"] or 0) > (old["decode_tok_s"] or 0):
                    best[path] = {**r, "prefill_tok_s": max(r["prefill_tok_s"], old["prefill_tok_s"] if old else 0)}
        for path in paths:
            rows.append(best[path])
    return rows


def _stream(model, cache, total: int, chunk: int, checkpoints: list[int], vocab: int,
            on_checkpoint: Callable[[int, float], None], progress: Optional[Callable[[int, int], None]],
            make_room: bool) -> None:
    rng = np.random.default_rng(0)
    done = 0
    for stop in checkpoints:
        start, t0 = done, time.perf_counter()
        while done < stop:
            n = min(chunk, stop - done)
            if make_room:
                cache.make_room(n)
            model(mx.array(rng.integers(10, vocab, n), dtype=mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
            done += n
            if progress:
                progress(done, total)
        on_checkpoint(done, (done - start) / (time.perf_counter() - t0))


def run_memory(backend, total: int, checkpoints: list[int], cfg: HeapConfig, stock_limit: int,
               progress: Optional[Callable[[int, int], None]] = None) -> list[dict]:
    """Stream `total` tokens through one heap session (and the stock cache up to stock_limit);
    a row per checkpoint with KV bytes, allocator active/peak and process RSS."""
    import psutil

    proc = psutil.Process()
    model = backend.model
    vocab = model.args.vocab_size
    rows: list[dict] = []

    def snapshot(path, cache, kv_bytes):
        def record(done, tok_s):
            mx.clear_cache()
            rows.append({"path": path, "tokens": done, "kv_bytes": kv_bytes(cache),
                         "active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory(),
                         "rss_bytes": proc.memory_info().rss, "tok_s": tok_s})
        return record

    points = sorted({c for c in checkpoints if c <= total} | {total})
    heap = make_heap_cache(model, cfg)
    mx.clear_cache()
    mx.reset_peak_memory()
    _stream(model, heap, total, cfg.chunk, points, vocab, snapshot("heap", heap, lambda c: c.kv_nbytes),
            progress, make_room=True)
    del heap
    gc.collect()
    stock_points = [p for p in points if p <= stock_limit]
    if stock_points:
        stock = [KVCache() for _ in model.layers]
        mx.clear_cache()
        mx.reset_peak_memory()
        _stream(model, stock, stock_points[-1], STOCK_PREFILL_STEP, stock_points, vocab,
                snapshot("stock-full", stock, lambda c: sum(x.nbytes for x in c)), progress, make_room=False)
    return rows
