"""`localheap bench speed|memory|needle|attention-mass|serve|batch-step|turns|trim`: the heap against the stock path (serve: the
batched engine against the round-robin one), in one run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..bench.facts import FILLERS as NEEDLE_FILLERS
from ..bench.facts import PLACEMENTS as NEEDLE_PLACEMENTS
from ..bench.needle import LONG_CONTEXTS as NEEDLE_LONG_CONTEXTS
from ..bench.needle import PRUNE as NEEDLE_PRUNE
from ..bench.peer import MORE_PATHS as PEER_MORE_PATHS
from ..bench.peer import PATHS as PEER_PATHS
from ..bench.report import emit, table
from ..heap.stats import format_bytes
from ..models import resolve_model
from .common import (add_compile_arg, add_decode_arg, add_distributed_arg, add_heap_args, add_model_args,
                     apply_decode_attention, heap_config, load_model_backend, model_spec)
from .progress import ProgressBar


def _count(part: str, least: int = 1) -> int:
    """One count: a whole number, or with k (x1024) or m (x1,000,000): 8k, 1m, 1.5m."""
    text = part.strip().lower()
    mult = {"m": 1_000_000, "k": 1024}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        value = None
    if value is None or value != value or value in (float("inf"), float("-inf")) or value != int(value):
        raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a whole number (e.g. 4096, 8k or 1m)")
    if value < least:
        raise argparse.ArgumentTypeError(f"{part.strip()!r}: must be >= {least}")
    return int(value)


def _ints(text: str, least: int = 1) -> list[int]:
    """A comma-separated list of counts, each >= `least`: 2048,8k,1m."""
    parts = text.split(",")
    if not text.strip() or any(not p.strip() for p in parts):   # "4096,," is a typo, not a list of one
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more numbers, comma-separated (e.g. 4096,8k)")
    return [_count(p, least) for p in parts]


def _ints0(text: str) -> list[int]:
    """As _ints, where 0 means: skip that table."""
    return _ints(text, least=0)


def _one_int(least: int = 1):
    """A single count (8k, 1m accepted) as a list of one: for flags whose value the command reads
    once (a list's later values were dropped without a word)."""
    def parse(text: str) -> list[int]:
        if "," in text:
            raise argparse.ArgumentTypeError(f"{text!r}: this flag takes one number, not a list")
        return [_count(text, least)]
    return parse


def _some_ints(text: str) -> list[int]:
    """As _ints, where an empty list ("") means: none."""
    return _ints(text) if text.strip() else []


def _positive(text: str) -> int:
    return _count(text, 1)


def _natural(text: str) -> int:
    return _count(text, 0)


def _choices(options):
    """A parser of a comma-separated list of some of `options`."""
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out or any(x not in options for x in out):
            raise argparse.ArgumentTypeError(f"some of {', '.join(options)}: {text!r}")
        return out

    return parse


def _policies(text: str) -> list[str]:
    from ..heap import POLICIES

    return _choices(POLICIES)(text)


def _texts(text: str) -> list[str]:
    parts = [t.strip() for t in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more names, comma-separated")
    return parts


def _fractions(text: str) -> list[float]:
    try:
        parts = [x.strip() for x in text.split(",")]
        out = [float(x.rstrip("%")) / (100 if x.endswith("%") else 1) for x in parts]
    except ValueError:
        out = []
    if not out or any(not 0.0 <= x < 1.0 for x in out):
        raise argparse.ArgumentTypeError(f"pruning levels are fractions in [0, 1) or percentages, comma-separated "
                                         f"(e.g. 0,0.5,90%): {text!r}")
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against the stock path, measured in the same run")
    bsub = p.add_subparsers(dest="bench", required=True)
    speed = bsub.add_parser("speed", help="prefill and decode tokens/s: heap vs stock caches")
    add_model_args(speed)
    add_heap_args(speed)
    add_decode_arg(speed)
    add_compile_arg(speed)
    speed.add_argument("--cuda-graphs", action="store_true",
                       help="torch on CUDA: also decode as serve's engine does for one session, eagerly (heap-batch) "
                            "and as replayed CUDA graphs (heap-graphed, serve's --cuda-graphs), in the same run")
    speed.add_argument("--contexts", type=_ints, default=[2048, 8192, 32768], help="prompt lengths measured (8k, 1m accepted)")
    speed.add_argument("--decode-tokens", type=_positive, default=64, help="tokens decoded per cell")
    speed.add_argument("--repeats", type=_positive, default=1, help="best of N per cell")
    add_threads_arg(speed)
    add_distributed_arg(speed)
    speed.set_defaults(func=run_speed)
    mem = bsub.add_parser("memory", help="stream many tokens through one session; KV, allocator, RSS")
    add_model_args(mem)
    add_heap_args(mem)
    mem.add_argument("--tokens", type=_one_int(), default=[1_000_000], help="tokens streamed through the session")
    mem.add_argument("--checkpoints", type=_ints, default=[4096, 8192, 65536, 262144, 1_000_000],
                     help="token counts at which memory is measured")
    mem.add_argument("--stock-tokens", type=_one_int(), default=[65536],
                     help="stream the stock full cache this far (it grows without bound)")
    add_threads_arg(mem)
    mem.add_argument("--ram-budget", default=None, metavar="SIZE",
                     help="hold the run to this budget as `serve` would (allocator limits) and check RSS against it "
                          "(default: no budget)")
    mem.set_defaults(func=run_memory)
    needle = bsub.add_parser("needle", help="pass-key retrieval under eviction, per policy and pruning level")
    add_model_args(needle)
    add_heap_args(needle)
    needle.add_argument("--context", type=_positive, default=4096, help="document length of the main table")
    needle.add_argument("--prune", type=_fractions, default=list(NEEDLE_PRUNE),
                        help="pruning levels at --context: 0.1,0.5 or 10%%,50%% (budget = the rest)")
    needle.add_argument("--trials", type=_positive, default=100, help="episodes per cell at --context")
    needle.add_argument("--long-contexts", type=_some_ints, default=list(NEEDLE_LONG_CONTEXTS),
                        help="longer documents, at fewer trials (\"\": none)")
    needle.add_argument("--long-trials", type=_positive, default=20, help="episodes per cell at the long contexts")
    needle.add_argument("--long-full", type=_some_ints, default=[],
                        help="long contexts that also get a full-cache cell (slow: attention over the whole context)")
    needle.add_argument("--seed", type=int, default=0, help="seed of the episodes")
    needle.add_argument("--keys", type=_positive, default=1,
                        help="named facts per episode, one asked about (1: the single pass key)")
    needle.add_argument("--filler", type=_choices(NEEDLE_FILLERS), default=["heldout"],
                        help="comma-separated filler kinds, each its own long-context cell: heldout: documents "
                             "training never saw, digits removed; digits: the same with their numbers (a key is not "
                             "the only number); licenses, man, comments: licence texts, manual pages, installed "
                             "packages' source comments (+digits keeps their numbers); pydoc: the v1 table's filler. "
                             "The --context table uses the first")
    needle.add_argument("--placement", type=_choices(NEEDLE_PLACEMENTS), default=["uniform"],
                        help="comma-separated fact placements at the long contexts (--keys >= 2): uniform, cluster "
                             "(all in one 5%% region), start (right after the sinks), end (in the recent window)")
    needle.add_argument("--turns", type=_positive, default=1,
                        help="questions per long-context episode, asked in one session as a chat continues (--keys >= 2)")
    needle.add_argument("--policies", type=_policies, default=None,
                        help="comma-separated subset of the policies (default: all)")
    add_threads_arg(needle)
    needle.add_argument("--plots", default="needle-plots", help="directory for the PNG plots (needs matplotlib)")
    needle.set_defaults(func=run_needle_bench, model="demo")

    prof = bsub.add_parser("profile", help="where a long heap prefill spends its time (cProfile)")
    add_model_args(prof)
    add_heap_args(prof)
    prof.add_argument("--context", type=_ints, default=[65536], help="prompt length profiled (64k, 1m accepted)")
    prof.add_argument("--decode-tokens", type=_natural, default=0,
                      help="profile this many decode steps after the prompt instead of the prefill")
    add_decode_arg(prof)
    add_compile_arg(prof)
    add_threads_arg(prof)
    prof.set_defaults(func=run_profile_bench, model="demo")

    st = bsub.add_parser("structured", help="constrained decoding (a JSON schema) against unconstrained, per token")
    add_model_args(st)
    add_heap_args(st)
    st.add_argument("--tokens", type=_positive, default=128, help="most tokens decoded per run (default 128)")
    st.add_argument("--repeats", type=_positive, default=3, help="runs per path, interleaved (default 3)")
    st.add_argument("--tool-repeats", type=_positive, default=10,
                    help="runs per tool-call path, interleaved, each its own seed (default 10)")
    st.add_argument("--mask-vocab", type=_positive, default=None,
                    help="time the masks alone on a tokenizer trained to this vocabulary size, e.g. 32000 "
                         "(default: the model's own tokenizer)")
    add_threads_arg(st)
    st.set_defaults(func=run_structured_bench, model="demo")

    turns = _conversation_parser(bsub, "turns", "a conversation whose template rewrites each reply, past the heap: "
                                                "rewinding against reading it again (--rewind on/off)",
                                 turns=12, question=400, answer=100, answer_help="each reply's answer",
                                 facts_help="pass keys planted in the first message and asked after the last turn, "
                                            "in each arm: what rewinding costs the answers")
    turns.add_argument("--reasoning", type=_positive, default=600, metavar="TOKENS",
                       help="tokens of each reply's reasoning, which the client does not send back (about; default 600)")
    turns.set_defaults(func=run_turns_bench, model="demo")

    trim = _conversation_parser(bsub, "trim", "a client that trims its oldest messages to fit its window: cutting "
                                              "the session to the shorter history (serve --cache-reuse) against "
                                              "reading it again",
                                turns=24, question=200, answer=100, answer_help="each reply",
                                facts_help="pass keys in the system message, asked after the last turn in each "
                                           "arm: what a cut heap costs the answers")
    trim.add_argument("--window", type=_positive, default=3072, metavar="TOKENS",
                      help="tokens the client's prompt may hold; older exchanges are dropped (default 3072)")
    trim.add_argument("--cache-reuse", type=_positive, default=64, metavar="N",
                      help="the reuse arm's serve --cache-reuse (default 64)")
    trim.add_argument("--facts-in", choices=("system", "message"), default="system",
                      help="where the pass keys are: the system message, which no trim drops, or the user message "
                           "of the middle turn, which the window still holds at the end and the heap has evicted "
                           "(recall brings it back) (default system)")
    trim.set_defaults(func=run_trim_bench, model="demo")

    slots = bsub.add_parser("slots", help="a long session's next turn on a server that does not hold it: its slot "
                                          "file (serve --slot-save-path) restored first, against the prompt read again")
    add_model_args(slots)
    add_heap_args(slots)
    slots.add_argument("--contexts", type=_ints, default=[4096, 16384, 65536],
                       help="session lengths measured (8k, 1m accepted; default 4096,16384,65536)")
    slots.add_argument("--repeats", type=_positive, default=3, help="runs of each arm per length, interleaved (default 3)")
    add_threads_arg(slots)
    slots.set_defaults(func=run_slots_bench, model="demo")

    mass = bsub.add_parser("attention-mass", help="share of the true attention mass each policy's kept set captures")
    add_model_args(mass)
    add_heap_args(mass)
    mass.add_argument("--context", type=_positive, default=4096, help="document length")
    mass.add_argument("--prune", type=_fractions, default=[0.5, 0.9], help="pruning levels (budget = the rest)")
    mass.add_argument("--trials", type=_positive, default=4, help="documents (needle episodes) averaged")
    mass.add_argument("--seed", type=int, default=0, help="seed of the documents")
    mass.set_defaults(func=run_attention_mass_bench, model="demo")
    ppl = bsub.add_parser("perplexity", help="what eviction costs the predictions of a long text, per policy and "
                                            "budget, against the full cache")
    add_model_args(ppl)
    add_heap_args(ppl)
    ppl.add_argument("--context", type=_positive, default=4096, help="tokens of each text read")
    ppl.add_argument("--budgets", type=_ints, default=[512, 1024], help="heap budgets (each under the context)")
    ppl.add_argument("--policies", type=_policies, default=None, help="policies to compare (default: all)")
    ppl.add_argument("--texts", type=_texts, default=["corpus", "licenses"],
                     help="texts, comma-separated: corpus (the demo model's training text), licenses, man, comments "
                          "(text on this machine nobody tuned to), or a file path (default: corpus,licenses)")
    ppl.set_defaults(func=run_perplexity_bench, model="demo")
    serve = bsub.add_parser("serve", help="N concurrent clients against servers: batched engine vs round-robin")
    add_model_args(serve)
    serve.add_argument("--clients", type=_ints, default=[1, 2, 4, 8, 16], help="concurrent clients per round")
    serve.add_argument("--context", type=_one_int(), default=[4096],
                       help="tokens of document each client's session holds before it asks (one value)")
    serve.add_argument("--stagger", type=_natural, default=256,
                       help="session i of N holds context + i x STAGGER / N tokens, so their decode eviction events "
                            "(every --slack tokens) fall on different steps as real sessions' do; 0: all aligned "
                            "(default: 256, serve's default slack)")
    serve.add_argument("--decode-tokens", type=_positive, default=64, help="tokens each client asks for")
    serve.add_argument("--doc-tokens", type=_one_int(0), default=[65536],
                       help="the document read beside a decoding chat (0: skip that table)")
    serve.add_argument("--engines", default="batched,round-robin",
                       help="engines compared, interleaved per round: batched (serve's default), mixed (batched, --prefill-lane off), passive (batched, OMP_WAIT_POLICY=PASSIVE), round-robin (default: batched,round-robin)")
    serve.add_argument("--max-batch", type=_positive, default=None, help="the batched server's --max-batch (default: serve's default)")
    serve.add_argument("--mixed-chunk", type=_positive, default=None, help="the batched server's --mixed-chunk (default: serve's default)")
    serve.add_argument("--persist", action="store_true",
                       help="the servers save every turn to their sessions directory, as serve does by default "
                            "(default: --no-persist, nothing written)")
    serve.add_argument("--serve-args", default="", metavar="ARGS",
                       help="more flags for both servers, one string, e.g. \"--budget 2048\" (default: none)")
    add_threads_arg(serve)
    serve.set_defaults(func=run_serve_bench)
    peer = bsub.add_parser("peer", help="the heap against llama.cpp (llama-cpp-python) on the same weights as GGUF")
    add_model_args(peer)
    add_heap_args(peer)
    peer.add_argument("--contexts", type=_ints, default=[4096, 32768], help="prompt lengths measured (32k accepted)")
    peer.add_argument("--threads", type=_ints, default=[1, os.cpu_count() or 1],
                      help="thread counts, each engine run at each (default: 1 and all cores)")
    peer.add_argument("--decode-tokens", type=_positive, default=32, help="greedy tokens decoded per cell")
    peer.add_argument("--repeats", type=_positive, default=1, help="runs per cell, order reversed every other run")
    peer.add_argument("--paths", type=_choices(PEER_PATHS + PEER_MORE_PATHS), default=list(PEER_PATHS),
                      help=f"what runs (default: {','.join(PEER_PATHS)}; also {','.join(PEER_MORE_PATHS)})")
    peer.set_defaults(func=run_peer_bench)

    step = bsub.add_parser("batch-step", help="CPU cost of one decode-batch step (torch or MLX) by rows, "
                                              "and of a chunk beside a decode")
    add_model_args(step)
    add_heap_args(step, recall=True)
    step.add_argument("--context", type=_positive, default=4096, help="tokens each session holds (default 4096)")
    step.add_argument("--rows", type=_ints, default=[1, 2, 4, 8], help="batch sizes (default 1,2,4,8)")
    step.add_argument("--steps", type=_positive, default=40, help="steps timed per batch size and round (default 40)")
    step.add_argument("--repeats", type=_positive, default=3, help="interleaved rounds, median (default 3)")
    step.add_argument("--mixed-chunks", type=_ints0, default=[16, 32, 64, 128],
                      help="document tokens riding beside a decoding chat (0: skip that table; default 16,32,64,128)")
    step.add_argument("--events", action="store_true",
                      help="also time eviction events due on the same step: one batched plan against one by one")
    step.add_argument("--compile-decode", action="store_true",
                      help="torch: also time each batch size through the compiled packed step (serve's "
                           "--compile-decode), interleaved with the eager one")
    step.add_argument("--aten-gemm", action="store_true",
                      help="torch: also time each batch size with aten's matmuls for a step of several sessions "
                           "(LOCALHEAP_BATCH_GEMM=aten) instead of oneDNN's, interleaved with the default")
    step.add_argument("--cuda-graphs", action="store_true",
                      help="torch on CUDA: also time each batch size as replayed CUDA graphs (serve's --cuda-graphs), "
                           "interleaved with the eager step; read the wall columns")
    add_threads_arg(step)
    step.set_defaults(func=run_batch_step_bench, model="demo")


def add_threads_arg(parser) -> None:
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch intra-op threads, 1 is steadier on a small shared CPU (default: torch's own)")


def set_threads(backend, args) -> None:
    """--threads for the torch backend (MLX has no intra-op thread setting)."""
    if backend.name == "torch" and args.threads:
        import torch
        torch.set_num_threads(args.threads)


def peak_rss() -> int:
    """The process's peak resident set since it started (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _bench_module(backend):
    if backend.name == "mlx":
        from ..backends.mlx import bench
    else:
        from ..backends.torch import bench
    return bench


def run_speed(args) -> int:
    backend = load_model_backend(args)
    cfg = heap_config(args, backend)
    extra = {"threads": args.threads} if backend.name == "torch" else {}
    if cfg.recall:   # paging on against off, same run
        extra["paths"] = ("stock-full", "heap", "heap-paging")
        cfg = cfg.with_(recall=False)
    if apply_decode_attention(backend, args):   # the fused step beside the default one, same run
        extra["paths"] = (*extra.get("paths", ("stock-full", "heap")), "heap-fused")
    if args.compile_decode:   # the compiled step beside each eager one, same run
        paths = extra.get("paths", ("stock-full", "heap"))
        extra["paths"] = (*paths, *(p + "-compiled" for p in paths if p in ("heap", "heap-fused")))
    if getattr(args, "cuda_graphs", False):
        if backend.name != "torch" or args.distributed or backend.device.type != "cuda":
            raise SystemExit("--cuda-graphs: replayed CUDA graphs are for torch on a CUDA device")
        graphed = backend.prepare_graphs()   # False: the warning says why; heap-batch still runs
        extra["paths"] = (*extra.get("paths", ("stock-full", "heap")), "heap-batch",
                          *(("heap-graphed",) if graphed else ()))
    bench = _bench_module(backend)
    if args.distributed:   # the shards against one process (on rank 0), same run; rank 0 reports
        from ..backends.mlx import distributed as bench
        extra = {"paths": extra.get("paths", ("stock-full", "heap")), "model_dir": resolve_model(model_spec(args))[0]}
        if backend.rank != 0:
            sys.stdout = open(os.devnull, "w")
    rows = bench.run_speed(backend, args.contexts, cfg, args.decode_tokens,
                                            log=lambda m: print(m, file=sys.stderr), repeats=args.repeats, **extra)
    by = {(r["context"], r["path"]): r for r in rows}
    for r in rows:
        base = by.get((r["context"], rows[0]["path"]))
        r["prefill_vs_stock"] = r["prefill_tok_s"] / base["prefill_tok_s"] if base else None
        if base and r["decode_tok_s"] and base["decode_tok_s"]:
            r["decode_vs_stock"] = r["decode_tok_s"] / base["decode_tok_s"]
    cols = [("context", "context", ","), ("path", "path", ""), ("prefill_tok_s", "prefill tok/s", ",.0f"),
            ("decode_tok_s", "decode tok/s", ",.1f"), ("prefill_vs_stock", "prefill x stock", ".2f"),
            ("decode_vs_stock", "decode x stock", ".2f")]
    if any("question_ms" in r for r in rows):   # paging rows: the next question's recall, after the decode
        cols += [("recall_ms", "recall ms", ".1f"), ("question_ms", "question ms", ".1f")]
    bound = ""
    if rows and "bound_tok_s" in rows[0]:   # CUDA: the memory-bandwidth bound, measured in this run
        cols += [("bound_tok_s", "bandwidth bound tok/s", ",.0f"), ("share_of_bound", "share of bound", ".2f")]
        bound = (f" | copy bandwidth {rows[0]['bandwidth_bytes_s'] / 1e9:,.0f} GB/s, "
                 f"weights {format_bytes(backend.weights_bytes)}")
    text = (f"model {backend.model_name} | backend {backend.name} | budget {cfg.budget} | policy {cfg.policy} | "
            f"positions {cfg.positions} | prefill chunk {cfg.chunk}{bound}\n" + table(rows, cols))
    emit("speed", text, {"model": backend.model_name, "backend": backend.name, "heap": cfg.to_dict(), "rows": rows})
    return 0


def run_memory(args) -> int:
    from ..models import load_backend

    backend = load_backend(model_spec(args), args.backend)
    set_threads(backend, args)
    cfg = heap_config(args, backend)
    total = args.tokens[0]
    budget = None
    if args.ram_budget:
        from ..governor import governor_for, parse_size, plan_for

        plan = plan_for(backend, cfg, parse_size(args.ram_budget))   # BudgetTooSmall: says what fits
        governor_for(backend, plan)                                   # the allocator limits serve sets
        budget = plan.budget
    bar = ProgressBar("streaming")
    rows = _bench_module(backend).run_memory(backend, total, args.checkpoints, cfg, args.stock_tokens[0],
                                             progress=bar.update)
    bar.close()
    max_rss = peak_rss()
    for r in rows:
        for k in ("kv_bytes", "active_bytes", "peak_bytes", "rss_bytes"):
            r[k.replace("_bytes", "")] = format_bytes(r[k])
        if budget is not None:
            r["within_budget"] = "yes" if r["rss_bytes"] <= budget else "NO"
    cols = [("path", "path", ""), ("tokens", "tokens", ","), ("kv", "KV", ""), ("active", "allocator active", ""),
            ("peak", "allocator peak", ""), ("rss", "process RSS", ""),
            ("tok_s", "tok/s since previous", ",.0f")]
    if budget is not None:
        cols.append(("within_budget", f"RSS <= {format_bytes(budget)}", ""))
    per_token = backend.kv_bytes_per_token()
    text = (f"model {backend.model_name} | backend {backend.name} | heap capacity/layer "
            f"{cfg.layer_capacity(cfg.budget)} (prefill chunk {cfg.chunk}) | stock KV grows {format_bytes(per_token)}/token "
            f"(would be {format_bytes(per_token * total)} at {total:,})\n" + table(rows, cols)
            + _rate_ratio(rows)
            + f"\nprocess peak RSS over the whole run: {format_bytes(max_rss)}"
            + ("" if budget is None else f" ({'within' if max_rss <= budget else 'OVER'} the {format_bytes(budget)} budget)"))
    emit("memory", text, {"model": backend.model_name, "backend": backend.name, "heap": cfg.to_dict(),
                          "kv_bytes_per_token": per_token, "ram_budget_bytes": budget, "peak_rss_bytes": max_rss,
                          "rows": [{k: v for k, v in r.items() if not isinstance(v, str) or k in ("path", "within_budget")}
                                   for r in rows]})
    return 0


def _rate_ratio(rows: list[dict], at: int = 8192) -> str:
    """The heap's prefill rate over its last interval against its rate over the interval ending at
    `at` tokens: flat means per-token cost does not grow with the tokens seen (checkpoint 4096 too,
    so that interval is all evicting)."""
    heap = [r for r in rows if r["path"] == "heap"]
    ref = next((r for r in heap if r["tokens"] == at), None)
    if ref is None or heap[-1] is ref or not ref["tok_s"]:
        return ""
    prev = heap[heap.index(ref) - 1]["tokens"] if heap.index(ref) else 0
    last = heap[-1]
    return (f"\nheap prefill rate over ({heap[-2]['tokens']:,}, {last['tokens']:,}] is "
            f"{last['tok_s'] / ref['tok_s']:.2f}x its rate over ({prev:,}, {at:,}]")


def run_needle_bench(args) -> int:
    from ..bench.needle import plot, report, run_needle
    from ..models import load_backend

    try:   # a plots path that cannot be a directory: said before the run, not after it
        import matplotlib  # noqa: F401
        Path(args.plots).mkdir(parents=True, exist_ok=True)
    except ImportError:
        pass
    except OSError as e:
        raise ValueError(f"--plots {args.plots}: cannot make that directory ({e.strerror or e})") from None
    backend = load_backend(model_spec(args), args.backend)
    set_threads(backend, args)
    result = run_needle(backend, heap_config(args, backend), context=args.context, prune=args.prune, trials=args.trials,
                        long_contexts=args.long_contexts, long_trials=args.long_trials, long_full=args.long_full,
                        seed=args.seed, keys=args.keys, filler=args.filler, placements=args.placement,
                        turns=args.turns, policies=args.policies,
                        log=lambda m: print(m, file=sys.stderr))
    paths = plot(result, args.plots)
    if not paths:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]' in localheap's checkout)", file=sys.stderr)
    report(result, backend, paths)
    return 0


def run_profile_bench(args) -> int:
    from ..bench.profile import profile_decode, profile_prefill, report, report_decode
    from ..models import load_backend

    backend = load_backend(model_spec(args), args.backend)
    set_threads(backend, args)
    apply_decode_attention(backend, args)
    cfg = heap_config(args, backend)
    for context in args.context:
        if args.decode_tokens > 0:
            row = profile_decode(backend, cfg, context, args.decode_tokens)
            emit("profile", report_decode(row, backend), {"model": backend.model_name, "backend": backend.name,
                                                          "heap": cfg.to_dict(), **row})
            continue
        row = profile_prefill(backend, cfg, context)
        emit("profile", report(row, backend), {"model": backend.model_name, "backend": backend.name,
                                               "heap": cfg.to_dict(), **row})
    return 0


def run_attention_mass_bench(args) -> int:
    from ..bench.attention_mass import report, run_attention_mass
    from ..models import load_backend

    backend = load_backend(model_spec(args), args.backend)
    result = run_attention_mass(backend, heap_config(args, backend), context=args.context, prune=args.prune,
                                trials=args.trials, seed=args.seed, log=lambda m: print(m, file=sys.stderr))
    report(result, backend)
    return 0


def run_perplexity_bench(args) -> int:
    from ..bench.perplexity import report, run_perplexity
    from ..models import load_backend

    if args.recall == "on":
        raise SystemExit("bench perplexity: the recall tier answers a question, not each token read; "
                         "leave --recall off")
    backend = load_backend(model_spec(args), args.backend)
    if getattr(backend, "prefill_scored", None) is None:
        raise SystemExit(f"bench perplexity: the {backend.name} backend here reads no prompt logprobs")
    try:
        result = run_perplexity(backend, heap_config(args, backend, recall=False), context=args.context,
                                budgets=args.budgets, policies=args.policies, sources=args.texts,
                                log=lambda m: print(m, file=sys.stderr))
    except (ValueError, OSError) as e:
        raise SystemExit(f"bench perplexity: {e}") from e
    report(result, backend)
    return 0


def run_structured_bench(args) -> int:
    from ..bench.structured import report, run_decode, run_masks, run_tools
    from ..models import load_backend

    backend = load_backend(model_spec(args), args.backend)
    set_threads(backend, args)
    decode = run_decode(backend, heap_config(args, backend), args.tokens, args.repeats,
                        log=lambda m: print(m, file=sys.stderr))
    tools = run_tools(backend, heap_config(args, backend), args.tokens, args.tool_repeats,
                      log=lambda m: print(m, file=sys.stderr))
    tokenizer, vocab = backend.tokenizer, len(backend.tokenizer)
    if args.mask_vocab:
        import tempfile

        from transformers import AutoTokenizer

        from ..randmodel import build_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            build_tokenizer(tmp, vocab_size=args.mask_vocab)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
        vocab = len(tokenizer)
    masks = run_masks(tokenizer, backend.eos_token_ids, args.repeats)
    emit("structured", report(decode, tools, masks, backend, vocab, table),
         {"model": backend.model_name, "backend": backend.name, "vocab": vocab, "decode": decode, "tools": tools,
          "masks": masks})
    return 0


def _conversation_parser(bsub, name: str, help: str, turns: int, question: int, answer: int, answer_help: str,
                         facts_help: str):
    """A bench of a conversation through the server, turn by turn in two arms (turns, trim)."""
    p = bsub.add_parser(name, help=help)
    add_model_args(p)
    add_heap_args(p)
    p.add_argument("--turns", type=_positive, default=turns, help=f"turns of the conversation (default {turns})")
    p.add_argument("--question", type=_positive, default=question, metavar="TOKENS",
                   help=f"tokens of each user message (about; default {question})")
    p.add_argument("--answer", type=_positive, default=answer, metavar="TOKENS",
                   help=f"tokens of {answer_help} (about; default {answer})")
    p.add_argument("--facts", type=_natural, default=0, metavar="K", help=f"{facts_help} (0: none; default 0)")
    add_threads_arg(p)
    return p


def _conversation_backend(args):
    """A conversation bench's backend (threads set) and heap config."""
    from ..models import load_backend

    if args.facts < 0:
        raise SystemExit("--facts must be >= 0")
    backend = load_backend(model_spec(args), args.backend)
    set_threads(backend, args)
    return backend, heap_config(args, backend)


def run_turns_bench(args) -> int:
    from ..bench.turns import report, run

    backend, cfg = _conversation_backend(args)
    result = run(backend, cfg, args.turns, args.question, args.reasoning, args.answer,
                 log=lambda m: print(m, file=sys.stderr), facts=args.facts)
    emit("turns", report(result, cfg, table), {"model": backend.model_name, "backend": backend.name,
                                               "heap": cfg.to_dict(), **result})
    return 0


def run_trim_bench(args) -> int:
    from ..bench.trim import report, run

    backend, cfg = _conversation_backend(args)
    result = run(backend, cfg, args.turns, args.window, args.question, args.answer, args.cache_reuse,
                 log=lambda m: print(m, file=sys.stderr), facts=args.facts, facts_in=args.facts_in)
    emit("trim", report(result, cfg, args.window, args.cache_reuse, table),
         {"model": backend.model_name, "backend": backend.name, "heap": cfg.to_dict(), **result})
    return 0


def run_slots_bench(args) -> int:
    from ..bench.slotfile import report, run
    from ..models import load_backend

    backend = load_backend(model_spec(args), args.backend)
    set_threads(backend, args)
    cfg = heap_config(args, backend)
    result = run(backend, cfg, args.contexts, args.repeats, log=lambda m: print(m, file=sys.stderr))
    emit("slots", report(result, cfg, table), {"model": backend.model_name, "backend": backend.name,
                                               "heap": cfg.to_dict(), **result})
    return 0


def run_batch_step_bench(args) -> int:
    from ..bench.batch_step import run

    return run(args)


def run_peer_bench(args) -> int:
    from ..bench.peer import run_peer

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("bench peer needs llama-cpp-python and gguf: pip install -e '.[peer]' in localheap's checkout")
    spec = model_spec(args)
    model_dir, name = resolve_model(spec)
    cfg = heap_config(args).with_(recall=False)
    result = run_peer(spec, Path(model_dir), cfg.to_dict(), args.contexts, args.threads, args.decode_tokens,
                      tuple(args.paths), args.repeats, log=lambda m: print(m, file=sys.stderr))
    rows = result["rows"]
    for r in rows:
        r["rss"], r["rss_load"] = format_bytes(r["peak_rss"]), format_bytes(r["rss_loaded"])
    cols = [("context", "context", ","), ("threads", "threads", ""), ("path", "path", ""),
            ("prefill_tok_s", "prefill tok/s", ",.0f"), ("decode_tok_s", "decode tok/s", ",.1f"),
            ("prefill_vs_llama", "prefill x llama.cpp", ".2f"), ("decode_vs_llama", "decode x llama.cpp", ".2f"),
            ("decode_mixed_tok_s", "interleaved decode tok/s", ",.1f"),
            ("decode_mixed_vs_llama", "interleaved x llama.cpp", ".2f"),
            ("rss_load", "RSS loaded", ""), ("rss", "peak RSS", "")]
    check = result["check"]
    lines = [f"model {name} | heap budget {cfg.budget}, policy {cfg.policy}, prefill chunk "
             f"{cfg.prefill_chunk or 'backend default'} | llama.cpp: {result['gguf']} (f16 weights), batch 512, flash attention off unless -fa or q8kv | "
             f"{args.decode_tokens} greedy decode steps, decode tok/s = 1 / median step; interleaved: every path "
             f"in one more process, their decode steps taken in turn (the fairer ratio on a busy machine)"]
    lines += [f"  {k}: {v}" for k, v in result["versions"].items()]
    if check:
        lines.append(f"greedy check (llama.cpp f16 vs transformers stock f32, {check['tokens']} tokens): "
                     f"first {check['matching_prefix']} identical; tokenizer ids agree: {check['tokenizer_agrees']}")
    emit("peer", "\n".join(lines) + "\n" + table(rows, cols),
         {"model": name, "heap": cfg.to_dict(), **{k: v for k, v in result.items() if k != "rows"},
          "rows": [{k: v for k, v in r.items() if k not in ("rss", "rss_load")} for r in rows]})
    return 0


def run_serve_bench(args) -> int:
    from ..bench.serve import run

    return run(args)
