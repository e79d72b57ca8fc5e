"""`localheap bench batch-step`: what one step of a backend's decode batch costs, without a server.

Timed in CPU time, which other processes on a shared machine disturb far less than wall time (they
still share its caches and memory bandwidth): torch, the engine thread's (time.thread_time); MLX, the
process's (time.process_time: MLX evaluates on a stream thread of its own, and the process runs
nothing else). The rows table also gives wall time: with torch at more than one thread the engine
thread's CPU time leaves out its intra-op workers, so there read the wall columns (on a quiet machine).
- rows: one decode step of B sessions holding `context` tokens each (step_rows over a slab),
  B = 1, 2, 4, 8..., interleaved over `repeats` rounds (median); aggregate tokens per CPU second.
- beside: one chat decoding beside a document read, per `--mixed-chunk` size c: the step that
  carries the chat's token and c document tokens, against a decode step alone and 512-token
  chunks alone; "kept" is the share of its alone rate each keeps at that step cost.
- events: B sessions due an eviction event on the same step, their events planned as one batched
  selection (batch.make_rooms) against one session's event after another (make_room), each timed
  on fresh copies of the same heaps, interleaved.
Knows nothing about HTTP: `bench serve` measures what a client sees.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ..generation import SamplingParams


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1000, n).tolist()


def cpu_clock(backend):
    """The clock a step's CPU cost is read on: MLX computes on its own stream thread."""
    return time.process_time if backend.name == "mlx" else time.thread_time


def _cpu(fn, n: int, clock=time.thread_time) -> float:
    """CPU seconds per call of fn, over n calls."""
    t = clock()
    for _ in range(n):
        fn()
    return (clock() - t) / n


def rows_table(backend, cfg, context: int, batch: list[int], steps: int, repeats: int,
               compiled: bool = False, graphs: bool = False, aten: bool = False) -> list[dict]:
    """`compiled` (torch, --compile-decode): each batch size also through the compiled packed
    step, interleaved with the eager one in every round (columns `compiled ms`, `x eager`).
    `graphs` (torch on CUDA, --cuda-graphs): each batch size also as replayed CUDA graphs, the
    same way (`graphed ms`, and wall time: a graph's kernels run on the card, not the thread).
    `aten` (torch, --aten-gemm): each batch size also with aten's linear for the projections of a
    step of several sessions instead of lean.batch_linear's (`aten ms`, `x aten`: the default's
    speed over it)."""
    clock = cpu_clock(backend)
    most = max(batch)
    caches = []
    for i in range(most):
        c = backend.new_cache(cfg)
        backend.prefill(c, _tokens(context + i * 8, seed=i))   # lengths differ: each row its own mask
        caches.append(c)
    params = SamplingParams(max_tokens=10**9)
    rows = [backend.start_row(c, [5], params) for c in caches]
    variant = "compile_decode" if compiled else "cuda_graphs" if graphs else "aten" if aten else None
    if aten:
        from ..backends.torch import lean
        default_gemm = lean.BATCH_GEMM

    def switch(on: bool) -> None:
        if aten:   # a process-wide choice (lean.BATCH_GEMM), not a cache's
            lean.BATCH_GEMM = "aten" if on else default_gemm
        else:
            for c in caches:
                setattr(c, variant, on)

    def step(n: int) -> None:
        assert backend.step_rows(rows[:n]) == [None] * n

    times: dict[int, list[float]] = {n: [] for n in batch}
    walls: dict[int, list[float]] = {n: [] for n in batch}
    other: dict[int, list[float]] = {n: [] for n in batch}
    other_walls: dict[int, list[float]] = {n: [] for n in batch}
    for k in range(repeats):
        for n in batch:
            for r in rows[n:]:
                backend.end_row(r)
            modes = [False, True] if variant else [False]
            for on in modes if k % 2 == 0 else modes[::-1]:
                if variant:
                    switch(on)
                step(n)   # joins (a graph: its first step at this size captures), then steady steps
                w = time.perf_counter()
                t = _cpu(lambda n=n: step(n), steps, clock)
                w = (time.perf_counter() - w) / steps
                (other if on else times)[n].append(t)
                (other_walls if on else walls)[n].append(w)
    for r in rows:
        backend.end_row(r)
    if variant:
        switch(False)
    smallest = min(batch)
    one_rate = smallest / float(np.median(times[smallest]))   # tokens per CPU second at the smallest batch
    one_wall = smallest / float(np.median(walls[smallest]))
    out = []
    for n in batch:
        t, w = float(np.median(times[n])), float(np.median(walls[n]))
        out.append({"rows": n, "step_ms": 1e3 * t, "tok_s": n / t, "vs_one": (n / t) / one_rate,
                    "wall_ms": 1e3 * w, "vs_one_wall": (n / w) / one_wall})
        if not variant:
            continue
        c, cw = float(np.median(other[n])), float(np.median(other_walls[n]))
        if aten:   # the default against aten's: aten's time over the default's
            out[-1].update({"aten_ms": 1e3 * c, "aten_x": c / t, "aten_wall_ms": 1e3 * cw, "aten_wall_x": cw / w,
                            "aten_vs_one": (n / c) / (smallest / float(np.median(other[smallest])))})
        else:
            name = "compiled" if compiled else "graphed"
            out[-1].update({f"{name}_ms": 1e3 * c, f"{name}_x": t / c, f"{name}_wall_ms": 1e3 * cw,
                            f"{name}_wall_x": w / cw})
    return out


def beside_table(backend, cfg, context: int, chunks: list[int], repeats: int) -> list[dict]:
    clock = cpu_clock(backend)
    chat = backend.new_cache(cfg)
    backend.prefill(chat, _tokens(300, seed=100))
    doc = backend.new_cache(cfg)
    big = 512
    text = _tokens(context + repeats * (4 * big + sum(max(4, 1024 // c) * c for c in chunks)), seed=101)
    backend.prefill(doc, text[:context])
    at = [context]
    row = backend.start_row(chat, [5], SamplingParams(max_tokens=10**9))

    def take(n: int) -> list[int]:
        at[0] += n
        return text[at[0] - n: at[0]]

    decode = lambda: backend.step_rows([row])                                  # noqa: E731
    alone = lambda c: backend.prefill(doc, take(c))                            # noqa: E731
    mixed = lambda c: backend.step_rows([row], [(doc, take(c))])               # noqa: E731
    t = {"decode": [], "chunk": []}
    for _ in range(repeats):
        t["decode"].append(_cpu(decode, 32, clock))
        t["chunk"].append(_cpu(lambda: alone(big), 4, clock) / big)
        for c in chunks:
            t.setdefault(("mixed", c), []).append(_cpu(lambda c=c: mixed(c), max(4, 1024 // c), clock))
    backend.end_row(row)
    dec, per_token = float(np.median(t["decode"])), float(np.median(t["chunk"]))
    out = []
    for c in chunks:
        m = float(np.median(t[("mixed", c)]))
        out.append({"chunk": c, "decode_ms": 1e3 * dec, "mixed_ms": 1e3 * m, "chat_kept": dec / m,
                    "doc_kept": c / m * per_token, "sum": dec / m + c / m * per_token})
    return out


def events_table(backend, cfg, context: int, batch: list[int], repeats: int) -> list[dict]:
    import copy

    from ..backends.torch.batch import make_rooms

    caches = []
    for i in range(max(batch)):
        c = backend.new_cache(cfg.with_(recall=False))   # the selection and repack, not the page writer
        backend.prefill(c, _tokens(context, seed=200 + i))
        while not c.due(cfg.append_room):   # fill the slack: the next append evicts
            backend.prefill(c, _tokens(16, seed=300 + c.tokens_seen))
        caches.append(c)
    n = cfg.append_room
    times: dict = {}
    for _ in range(repeats):
        for b in batch:
            for mode in ("batched", "one by one"):
                heaps = copy.deepcopy(caches[:b])
                t = time.thread_time()
                if mode == "batched":
                    assert make_rooms([(c, n) for c in heaps]) == [None] * b
                else:
                    for c in heaps:
                        c.make_room(n)
                times.setdefault((b, mode), []).append(time.thread_time() - t)
    out = []
    for b in batch:
        batched, alone = (float(np.median(times[(b, m)])) for m in ("batched", "one by one"))
        out.append({"rows": b, "batched_ms": 1e3 * batched, "alone_ms": 1e3 * alone, "gain": alone / batched})
    return out


EVENT_COLUMNS = [("rows", "sessions due", "d"), ("batched_ms", "batched CPU ms", ".1f"),
                 ("alone_ms", "one by one CPU ms", ".1f"), ("gain", "x", ".2f")]
ROW_COLUMNS = [("rows", "rows", "d"), ("step_ms", "step CPU ms", ".2f"), ("tok_s", "tok / CPU s", ",.0f"),
               ("vs_one", "x 1 row", ".2f"), ("wall_ms", "step wall ms", ".2f"), ("vs_one_wall", "x 1 row (wall)", ".2f")]
BESIDE_COLUMNS = [("chunk", "mixed chunk", "d"), ("decode_ms", "decode alone ms", ".2f"),
                  ("mixed_ms", "decode + chunk ms", ".2f"), ("chat_kept", "chat kept", ".2f"),
                  ("doc_kept", "doc kept", ".2f"), ("sum", "sum", ".2f")]


def run(args) -> int:
    from ..commands.bench import set_threads
    from ..commands.common import heap_config, model_spec
    from ..models import load_backend
    from .report import emit, table

    backend = load_backend(model_spec(args), args.backend)
    if getattr(backend, "step_rows", None) is None:
        raise SystemExit(f"the {backend.name} backend has no decode batch")
    set_threads(backend, args)
    kernel = ""
    if backend.name == "torch":   # time the steady state: the slab's CPU kernel built (or not) before the first step
        from ..backends.torch import slab_cpu
        kernel = " | slab kernel " + ("on" if slab_cpu.load(wait=True) is not None else "off")
    cfg = heap_config(args, backend)
    compiled = bool(getattr(args, "compile_decode", False))
    if compiled:
        if backend.name != "torch" or not backend.prepare_compiled():
            raise SystemExit("--compile-decode: the compiled packed step is not available here "
                             "(torch backend, Llama-shaped models, a C++ compiler; see the warning above)")
    graphs = bool(getattr(args, "cuda_graphs", False))
    if graphs and (compiled or backend.name != "torch" or backend.device.type != "cuda"):
        raise SystemExit("--cuda-graphs: replayed CUDA graphs are for torch on a CUDA device (and not with "
                         "--compile-decode)")
    if graphs and not backend.prepare_graphs():   # on the card, but the check failed: the eager rows still
        print("--cuda-graphs: no graphed column (the warning above says why)", file=sys.stderr)
        graphs = False
    aten = bool(getattr(args, "aten_gemm", False))
    if aten and (compiled or graphs or backend.name != "torch"):
        raise SystemExit("--aten-gemm: the torch backend's eager step only (not with --compile-decode or --cuda-graphs)")
    rows = rows_table(backend, cfg, args.context, args.rows, args.steps, args.repeats, compiled, graphs, aten)
    side = beside_table(backend, cfg, args.context, args.mixed_chunks, args.repeats) if args.mixed_chunks != [0] else []
    head = (f"model {backend.model_name} | context {args.context:,} tokens per session | policy {cfg.policy}"
            f" | recall {'on' if cfg.recall else 'off'} | {backend.name}{kernel}"
            + (f" | threads {args.threads or 'default'} | engine thread CPU time" if backend.name == "torch"
               else " | process CPU time"))
    cols = ROW_COLUMNS + ([("compiled_ms", "compiled CPU ms", ".2f"), ("compiled_x", "x eager", ".2f")]
                          if compiled else [])
    cols += ([("aten_ms", "aten CPU ms", ".2f"), ("aten_vs_one", "aten x 1 row", ".2f"), ("aten_x", "x aten", ".2f")]
             if aten else [])
    cols += ([("graphed_ms", "graphed CPU ms", ".2f"), ("graphed_wall_ms", "graphed wall ms", ".2f"),
              ("graphed_wall_x", "x eager (wall)", ".2f")] if graphs else [])
    text = head + "\n" + table(rows, cols)
    if side:
        text += "\n\na chat's decode step with a document's chunk in it (512-token chunks alone: the doc's rate)\n"
        text += table(side, BESIDE_COLUMNS)
    events = events_table(backend, cfg, args.context, args.rows, args.repeats) if args.events else []
    if events:
        text += "\n\neviction events due on the same step (recall off): one batched plan against one by one\n"
        text += table(events, EVENT_COLUMNS)
    emit("batch-step", text, {"model": backend.model_name, "rows": rows, "beside": side, "events": events})
    return 0
