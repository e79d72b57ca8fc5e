"""Torch timings for `localheap bench`: the heap against transformers' stock DynamicCache, same run.

Both paths run the same loop (chunked prefill, then one forward per greedy token with
the logits of the last position only); the stock rows use transformers' own sdpa
attention function and DynamicCache, the heap rows the heap. Quote ratios, not tok/s.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from transformers import DynamicCache

from ...generation import SamplingParams
from ...heap import HeapConfig
from . import attention
from .generate import generate_tokens

STOCK_PREFILL_CHUNK = 2048   # transformers' generate feeds the prompt whole; chunk it to bound the peak


def random_prompt(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab_size, n).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stock_tokens(model, cache: DynamicCache, prompt: list[int], max_tokens: int) -> Iterator[int]:
    """Greedy tokens through transformers' stock cache and attention (the loop generate runs)."""
    device = next(model.parameters()).device

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():   # per call: a generator must not leak no_grad to its caller
            return model(input_ids=ids, **attention.cache_kwarg(model, cache), use_cache=True, logits_to_keep=1).logits

    ids = torch.tensor([prompt], device=device)
    for start in range(0, len(prompt), STOCK_PREFILL_CHUNK):
        logits = step(ids[:, start:start + STOCK_PREFILL_CHUNK])
    for n in range(max_tokens):
        token = int(torch.argmax(logits[0, -1].float()))
        yield token
        if n + 1 < max_tokens:
            logits = step(torch.tensor([[token]], device=device))


def _stock_kv_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def _session(backend, path: str, prompt: list[int], max_tokens: int, cfg: HeapConfig):
    """(token iterator, KV bytes function) for `stock-full` (DynamicCache), `heap`,
    `heap-fused` (decode outputs from the fused kernel), `heap-paging` (the recall tier on) or
    `heap-transformers` (every decode step through transformers' forward, not the lean step);
    `-compiled` after heap or heap-fused: the lean step's per-token parts compiled (compiled.py);
    `heap-batch` (decode as serve's engine runs one session: a row of the decode batch, its heap
    in a one-row slab) and `heap-graphed` (the same with --cuda-graphs: replayed CUDA graphs)."""
    if path == "stock-full":
        cache = DynamicCache(config=backend.model.config)
        return stock_tokens(backend.model, cache, prompt, max_tokens), lambda: _stock_kv_bytes(cache), None
    heap = backend.new_cache(cfg.with_(recall=True) if path == "heap-paging" else cfg)   # paging: recall tier on
    if path in ("heap-batch", "heap-graphed"):
        return _batch_tokens(backend, heap, prompt, max_tokens, path == "heap-graphed"), lambda: heap.kv_nbytes, heap
    heap.fused_decode = path.startswith("heap-fused")
    heap.compile_decode = path.endswith("-compiled")
    heap.lean_decode = path != "heap-transformers"
    tokens = generate_tokens(backend.model, heap, prompt, SamplingParams(max_tokens=max_tokens))
    return tokens, lambda: heap.kv_nbytes, heap


def _batch_tokens(backend, heap, prompt: list[int], max_tokens: int, graphs: bool) -> Iterator[int]:
    from .batch import leave_slab, start_row, step_rows

    heap.cuda_graphs = graphs
    row = start_row(backend.model, heap, prompt, SamplingParams(max_tokens=max_tokens))
    slabs: dict = {}
    try:
        yield row.token
        for _ in range(max_tokens - 1):
            assert step_rows(backend.model, [row], slabs=slabs) == [None]
            yield row.token
    finally:
        leave_slab(row)


QUESTION_TOKENS = 16


def time_question(backend, heap, seed: int) -> dict:
    """After a paging session's decode: one more turn, a 16-token question answered with one
    token, as a chat's next question. The recall tier runs at the turn's start (when the heap has
    evicted): its own time (recall_ms, from the heap's recall log) and the turn's first token
    (question_ms: recall, the question's prefill, the first sample)."""
    before = len(heap.recall_log)
    question = random_prompt(backend.model.config.get_text_config().vocab_size, QUESTION_TOKENS, seed=seed)
    t0 = time.perf_counter()
    for _ in generate_tokens(backend.model, heap, question, SamplingParams(max_tokens=1)):
        pass
    _sync(backend.device)
    took = time.perf_counter() - t0
    recalled = heap.recall_log[before:]
    return {"question_ms": 1e3 * took, "recall_ms": recalled[-1]["ms"] if recalled else None,
            "recall_parts": recalled[-1].get("parts") if recalled else None,
            "recalled_tokens": recalled[-1]["tokens"] if recalled else 0}


def time_paths(backend, paths, prompt: list[int], n_decode: int, cfg: HeapConfig) -> list[dict]:
    """One row per path. Prefills run one after the other; decode steps then alternate between
    the paths, so that bursts of load from other processes hit every path alike."""
    model, device = backend.model, backend.device

    def use(path):   # stock rows run transformers' own attention (sdpa, eager where it has none), switched outside the timers
        impl = attention.stock_implementation(model) if path == "stock-full" else attention.heap_implementation(model)
        if model.config._attn_implementation != impl:
            model.set_attn_implementation(impl)

    sessions, prefill_s, steps = {}, {}, {p: [] for p in paths}
    try:
        for path in paths:
            use(path)
            t0 = time.perf_counter()
            sessions[path] = _session(backend, path, prompt, n_decode + 1, cfg)
            next(sessions[path][0])   # the whole prompt, then the first token
            _sync(device)
            prefill_s[path] = time.perf_counter() - t0
        for _ in range(n_decode):
            for path in paths:
                use(path)
                t0 = time.perf_counter()
                next(sessions[path][0])
                _sync(device)
                steps[path].append(time.perf_counter() - t0)
        use("heap")
        asked = {}
        for path in paths:   # paging sessions: the next question's recall
            heap = sessions[path][2]
            if heap is not None and heap.pages is not None:
                for _ in sessions[path][0]:   # the decode turn ends
                    pass
                asked[path] = time_question(backend, heap, seed=len(prompt))
                # the same again, right after: a first question that takes far longer than this one
                # paid a warm-up (a new shape's kernels), not the recall (JSON only)
                again = time_question(backend, heap, seed=len(prompt) + 1)
                asked[path]["question_again_ms"] = again["question_ms"]
    finally:
        use("heap")
    rows = [{"path": p, "context": len(prompt), "prefill_tok_s": len(prompt) / prefill_s[p],
             # the median step resists load bursts; the mean includes eviction steps
             "decode_tok_s": 1.0 / float(np.median(steps[p])), "decode_tok_s_mean": n_decode / sum(steps[p]),
             "kv_bytes": sessions[p][1](), "peak_bytes": backend.memory()["peak"], **asked.get(p, {})}
            for p in paths]
    del sessions
    gc.collect()
    return rows


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device memory bandwidth in bytes/s: the best of `repeats` copies of `nbytes` (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def add_bandwidth_bound(rows: list[dict], weights_bytes: int, bandwidth: float) -> None:
    """Decode reads every weight and every resident K/V once per token: bound = bandwidth / those bytes.
    Each row gets that bound (tok/s) and the share of it its decode reached."""
    for r in rows:
        r["bandwidth_bytes_s"] = bandwidth
        r["bound_tok_s"] = bandwidth / (weights_bytes + r["kv_bytes"])
        r["share_of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]


def run_speed(backend, contexts: list[int], cfg: HeapConfig, decode_tokens: int = 64,
              paths=("stock-full", "heap"), log: Optional[Callable[[str], None]] = None,
              repeats: int = 1, threads: Optional[int] = None, bound: Optional[bool] = None) -> list[dict]:
    """Rows per (context, path), best of `repeats`. Decode tokens/s = 1 / median step after the
    first token, steps of all paths interleaved. `threads` sets torch's intra-op threads for the
    run (1 is far steadier on a small, busy CPU). `bound` (default: on CUDA) adds the memory-
    bandwidth bound, the device's copy bandwidth measured in this run."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        rows = []
        vocab = backend.model.config.get_text_config().vocab_size
        for ctx in contexts:
            prompt = random_prompt(vocab, ctx, seed=ctx)
            # warm-up: on CUDA through full chunks and an eviction event (first uses of their shapes
            # and kernels cost seconds: an H200 run without it read 4K prefill at a third of 32K's)
            warm = cfg.sinks + cfg.budget + 2 * cfg.chunk if backend.device.type == "cuda" else 256
            time_paths(backend, paths, prompt[: min(ctx, warm)], 4, cfg)
            best: dict[str, dict] = {}
            for i in range(repeats):
                if log:
                    log(f"context {ctx:,}: {', '.join(paths)} (run {i + 1}/{repeats}) ...")
                for r in time_paths(backend, paths, prompt, decode_tokens, cfg):
                    old = best.get(r["path"])
                    if old is None or r["decode_tok_s"] > old["decode_tok_s"]:
                        best[r["path"]] = {**r, "prefill_tok_s": max(r["prefill_tok_s"], old["prefill_tok_s"] if old else 0)}
            rows.extend(best[p] for p in paths)
        if bound if bound is not None else backend.device.type == "cuda":
            nbytes = (1 << 30) if backend.device.type == "cuda" else (64 << 20)
            add_bandwidth_bound(rows, backend.weights_bytes, copy_bandwidth(backend.device, nbytes))
        return rows
    finally:
        torch.set_num_threads(previous)


def speed_ratios(rows: list[dict], baseline: str = "stock-full") -> list[dict]:
    """Each row's decode and prefill tokens/s divided by the baseline's at the same context."""
    base = {r["context"]: r for r in rows if r["path"] == baseline}
    out = []
    for r in rows:
        b = base.get(r["context"])
        out.append({**r, "decode_vs_stock": (r["decode_tok_s"] / b["decode_tok_s"]) if b else None,
                    "prefill_vs_stock": (r["prefill_tok_s"] / b["prefill_tok_s"]) if b else None})
    return out


def run_memory(backend, total: int, checkpoints: list[int], cfg: HeapConfig, stock_limit: int,
               progress: Optional[Callable[[int, int], None]] = None) -> list[dict]:
    """Stream `total` tokens through one heap session (and the stock cache up to stock_limit);
    a row per checkpoint with KV bytes, allocator active/peak (CUDA) and process RSS."""
    import psutil

    proc = psutil.Process()
    model, device = backend.model, backend.device
    vocab = model.config.get_text_config().vocab_size
    points = sorted({c for c in checkpoints if c <= total} | {total})
    rows: list[dict] = []

    def record(path: str, done: int, kv_bytes: int, tok_s: float) -> None:
        mem = backend.memory()
        rows.append({"path": path, "tokens": done, "kv_bytes": kv_bytes, "active_bytes": mem["active"],
                     "peak_bytes": mem["peak"], "rss_bytes": proc.memory_info().rss, "tok_s": tok_s})

    def stream(path: str, step, kv_bytes, stops: list[int], chunk: int) -> None:
        """tok_s per row: prefill rate over the tokens since the previous checkpoint."""
        rng, done = np.random.default_rng(0), 0
        for stop in stops:
            start, t0 = done, time.perf_counter()
            while done < stop:
                n = min(chunk, stop - done)
                step(torch.as_tensor(rng.integers(10, vocab, n), device=device))
                done += n
                if progress:
                    progress(done, stops[-1])   # the stock run stops early
            _sync(device)
            record(path, done, kv_bytes(), (done - start) / (time.perf_counter() - t0))

    from .generate import forward

    heap = backend.new_cache(cfg)
    stream("heap", lambda ids: forward(model, heap, ids), lambda: heap.kv_nbytes, points, cfg.chunk)
    heap = None   # free it before the stock run
    gc.collect()
    stock_points = [p for p in points if p <= stock_limit]
    if stock_points:
        model.set_attn_implementation(attention.stock_implementation(model))
        try:
            stock = DynamicCache(config=model.config)

            def stock_step(ids):
                with torch.no_grad():
                    model(input_ids=ids[None], **attention.cache_kwarg(model, stock), use_cache=True, logits_to_keep=1)

            stream("stock-full", stock_step, lambda: _stock_kv_bytes(stock), stock_points, STOCK_PREFILL_CHUNK)
        finally:
            model.set_attn_implementation(attention.heap_implementation(model))
    return rows


def main(argv=None) -> None:
    """python -m localheap.backends.torch.bench: decode speed vs stock on a random-weight model."""
    import argparse

    from ...randmodel import random_model_dir
    from .backend import TorchBackend

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--random-model", default="llama:small")
    p.add_argument("--model", default=None, help="a model spec instead (e.g. demo)")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--budgets", default="1024,8448", help="one table per heap budget")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--paths", default="stock-full,heap,heap-fused")
    args = p.parse_args(argv)
    if args.model:
        from ...models import load_backend

        backend = load_backend(args.model, "torch")
        args.random_model = backend.model_name
    else:
        backend = TorchBackend.load(random_model_dir(args.random_model))
    contexts = [int(c) for c in args.contexts.split(",")]
    for budget in (int(b) for b in args.budgets.split(",")):
        paths = tuple(args.paths.split(","))
        rows = speed_ratios(run_speed(backend, contexts, HeapConfig(budget=budget), args.decode_tokens,
                                      paths, repeats=args.repeats, threads=args.threads), baseline=paths[0])
        print(f"{args.random_model} | {backend.device} | threads {args.threads} | budget {budget} | "
              f"decode tok/s = 1 / median step, paths interleaved step by step")
        for r in rows:
            print(f"  ctx {r['context']:>6,} {r['path']:<19} decode {r['decode_tok_s']:7.1f} tok/s "
                  f"(x {paths[0]} {r['decode_vs_stock']:.2f}, mean-based {r['decode_tok_s_mean']:.1f})  "
                  f"prefill {r['prefill_tok_s']:7.0f} tok/s (x {paths[0]} {r['prefill_vs_stock']:.2f})  "
                  f"KV {r['kv_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
