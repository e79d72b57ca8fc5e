"""Flags shared by commands: model selection and heap settings."""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

from ..generation import (ADAPTIVE_DECAY_MAX, DRY_BASE_MAX, DRY_MULTIPLIER_MAX, DYNATEMP_MAX, MIN_P_RANGE,
                          MIROSTAT_TAU_MAX, PENALTY_RANGE, REPEAT_PENALTY_MAX, TOP_N_SIGMA_MAX)
from ..heap import POLICIES, POSITION_MODES, HeapConfig
from ..heap.config import PAGE_FORMATS, RECALL_SCORES, RECALL_SELECTS, RECALL_SUMMARIES

log = logging.getLogger("localheap")


def add_model_args(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()   # one model: --model with --random-model is an error, not a choice
    which.add_argument("--model", default=None,
                   help="alias from models.toml, local model directory, hub repo id, or random:FAMILY:SIZE "
                        "(default: the small demo model bundled in the package, no download)")
    which.add_argument("--random-model", default=None, metavar="FAMILY:SIZE",
                   help="build a random-weight model of a real architecture locally, no weights needed "
                        "(e.g. llama:tiny); real shapes (llama:1b, llama:8b, qwen3:0.6b, qwen3:8b, qwen2:7b, "
                        "mistral:7b) are built in memory on the device, never saved (torch; meant for GPUs) "
                        "(default: not used)")
    p.add_argument("--backend", default="auto", choices=("auto", "mlx", "torch"),
                   help="auto: mlx on Apple Silicon, torch where it is installed, else mlx")


DECODE_ATTENTION = ("sdpa", "fused")


def add_decode_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-attention", default="sdpa", choices=DECODE_ATTENTION,
                   help="torch backend: a heap's decode step attends with torch's sdpa (the stock path's tokens bit "
                        "for bit) or fused (output and heap scores in one pass, kernels/decode_attention: faster on "
                        "small models, not bit-identical to stock) (default: sdpa)")


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-decode", action="store_true",
                   help="run a decode step's per-token parts (embedding, norms, projections, rotary, MLP, head) "
                        "compiled: torch, as graphs compiled ahead of time by inductor (needs a C++ compiler; the "
                        "first use compiles for tens of seconds, cached on disk by the model's shapes); mlx, with "
                        "mx.compile. The heap's attention and bookkeeping stay as they are; Llama-shaped models "
                        "(llama, mistral, qwen2). torch: serve's and chat's decode batch too (its graphs built "
                        "and checked at startup); mlx: one sequence at a time (serve and chat decode in batches, "
                        "which stay uncompiled there)")


def _ranged(lo: float, hi: float, kind=float):
    def parse(text: str):
        x = kind(text)
        if not lo <= x <= hi:
            raise argparse.ArgumentTypeError(f"{x} is not in [{lo:g}, {hi:g}]")
        return x
    return parse


def at_least(lo: int):
    """An argparse type: a whole number >= `lo` (the flag's own name in its error, not a field's)."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*[-+]?[0-9]+\s*", text):   # (int() also reads "1_000" and other scripts' digits)
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        n = int(text)
        if n < lo:
            raise argparse.ArgumentTypeError(f"{n} is less than {lo}")
        return n
    return parse


def _last_n(text: str) -> int:
    n = int(text)
    if n < -1:
        raise argparse.ArgumentTypeError(f"{n} is not -1 (the whole context), 0 (off) or a count of tokens")
    return n


def add_penalty_args(p: argparse.ArgumentParser) -> None:
    """min-p, OpenAI's presence and frequency penalties, llama.cpp's repetition penalty (generation.SamplingParams)."""
    p.add_argument("--min-p", type=_ranged(*MIN_P_RANGE), default=0.0,
                   help="drop tokens under this fraction of the likeliest token's probability, 0: off (default: 0)")
    p.add_argument("--presence-penalty", type=_ranged(*PENALTY_RANGE), default=0.0,
                   help="taken off the logit of every token the reply has written, -2 to 2 (default: 0)")
    p.add_argument("--frequency-penalty", type=_ranged(*PENALTY_RANGE), default=0.0,
                   help="times the number of times the reply has written a token, off its logit, -2 to 2 "
                        "(default: 0)")
    p.add_argument("--repeat-penalty", type=_ranged(1e-3, REPEAT_PENALTY_MAX), default=1.0,
                   help="llama.cpp's repetition penalty: the logit of each token among the context's last "
                        "--repeat-last-n is divided by it where positive, multiplied where not; 1: off (default: 1)")
    p.add_argument("--repeat-last-n", type=_last_n, default=64,
                   help="the tokens the repetition penalty looks back over, the reply's included; -1: the whole "
                        "context (default: 64)")
    for flag, kind, default, text in SAMPLER_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")


# the other samplers the server's routes take (generation.SamplingParams has each one's definition)
SAMPLER_FLAGS = [
    ("--dry-multiplier", _ranged(0.0, DRY_MULTIPLIER_MAX), 0.0,
     "DRY: how much a token that would continue a repeated run loses; 0: off"),
    ("--dry-base", _ranged(1.0, DRY_BASE_MAX), 1.75, "DRY: the penalty grows by this factor a token of run"),
    ("--dry-allowed-length", _ranged(1, 1 << 20, int), 2, "DRY: runs up to this long go unpenalized"),
    ("--dry-penalty-last-n", _last_n, -1, "DRY: the tokens it looks back over; -1: the whole context"),
    ("--typical-p", _ranged(1e-6, 1.0), 1.0, "locally typical sampling's mass; 1: off"),
    ("--top-n-sigma", _ranged(0.0, TOP_N_SIGMA_MAX), 0.0,
     "drop tokens under the max logit less n standard deviations; 0: off"),
    ("--xtc-probability", _ranged(0.0, 1.0), 0.0,
     "XTC: the chance a step drops the likeliest tokens above the threshold; 0: off"),
    ("--xtc-threshold", _ranged(0.0, 0.5), 0.1, "XTC's threshold"),
    ("--dynatemp-range", _ranged(0.0, DYNATEMP_MAX), 0.0,
     "the temperature moves within +-this with the entropy; 0: off"),
    ("--dynatemp-exponent", _ranged(0.0, DYNATEMP_MAX), 1.0, "the dynamic temperature's exponent"),
    ("--mirostat", _ranged(0, 2, int), 0, "Mirostat's version (1 or 2) in place of the cut-offs; 0: off"),
    ("--mirostat-tau", _ranged(1e-6, MIROSTAT_TAU_MAX), 5.0, "Mirostat's target surprise, bits a token"),
    ("--mirostat-eta", _ranged(0.0, 1.0), 0.1, "Mirostat's learning rate"),
    ("--adaptive-target", _ranged(-1.0, 1.0), -1.0,
     "adaptive-p: draw tokens whose probability is near this (steered by the recent draws'); negative: off"),
    ("--adaptive-decay", _ranged(0.0, ADAPTIVE_DECAY_MAX), 0.9, "adaptive-p's memory of recent draws (EMA decay)"),
]


def penalty_params(args, tokenizer=None) -> dict:
    """The sampling fields these flags set (DRY's breakers, llama.cpp's four, from `tokenizer`);
    a flag the namespace lacks takes its default."""
    out = {"min_p": args.min_p, "presence_penalty": args.presence_penalty,
           "frequency_penalty": args.frequency_penalty, "repeat_penalty": args.repeat_penalty,
           "repeat_last_n": args.repeat_last_n}
    for flag, _, default, _ in SAMPLER_FLAGS:
        name = flag[2:].replace("-", "_")
        out[name] = getattr(args, name, default)
    if out["dry_multiplier"] and tokenizer is not None:
        from ..dry import DEFAULT_BREAKERS, breaker_ids

        out["dry_breakers"] = breaker_ids(tokenizer, DEFAULT_BREAKERS)
    return out


def add_graphs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda-graphs", action="store_true",
                   help="torch on CUDA: run the decode batch's steps (sessions decoding together, no prompt riding "
                        "in the step) as CUDA graphs, captured on first use per batch size and span of slots read "
                        "and replayed, so the host issues one launch a step instead of one a kernel (graphed.py). "
                        "Checked at startup against the same step run eagerly; logits within float ulps of the "
                        "eager batch (attention masked over the rows' slots rounded up to 512). Elsewhere a "
                        "warning, and the batch stays eager (default: off)")


def apply_decode_attention(backend, args, batched: bool = False) -> bool:
    """--decode-attention and --compile-decode onto a loaded backend (before its first cache).
    `batched`: the command decodes in the engine's batches (serve, chat): torch builds the packed
    step's graphs now; mlx says they stay uncompiled. Returns whether fused."""
    if getattr(args, "compile_decode", False):
        if getattr(args, "distributed", None):
            raise SystemExit("--compile-decode runs one process's decode step; it is not available with --distributed")
        backend.compile_decode = True
        if batched and hasattr(backend, "prepare_compiled"):
            print("--compile-decode: building the decode batch's compiled graphs (tens of seconds the first time "
                  "for a model's shapes, cached on disk)...", file=sys.stderr, flush=True)
            backend.prepare_compiled()
        elif batched:
            log.warning("--compile-decode: the decode batch stays uncompiled on the %s backend (it compiles one "
                        "sequence's step: generate, bench)", backend.name)
    if batched and getattr(args, "cuda_graphs", False):   # (the benches check it themselves)
        if not hasattr(backend, "prepare_graphs"):
            raise SystemExit(f"--cuda-graphs is a torch backend option (this is the {backend.name} backend)")
        if getattr(args, "distributed", None):
            raise SystemExit("--cuda-graphs runs one process's decode batch; it is not available with --distributed")
        print("--cuda-graphs: checking a captured decode step against the eager one...", file=sys.stderr, flush=True)
        backend.prepare_graphs()
    if getattr(args, "decode_attention", "sdpa") != "fused":
        return False
    if not hasattr(backend, "fused_decode"):
        raise SystemExit(f"--decode-attention fused is a torch backend option (this is the {backend.name} backend)")
    backend.fused_decode = True
    return True


def freeze_startup_objects() -> bool:
    """Before serving: collect once, then move every object alive now (the model's modules, the
    tokenizer's tables, the app) out of the collector's reach (gc.freeze). A full collection
    walks every tracked object: in a served batch one took 178 ms on the demo model (every row's
    next token waited); frozen, it walks only what was made since. Frozen objects are never
    freed, which these never would be. LOCALHEAP_GC_FREEZE=0 turns it off (to compare).
    Returns whether it froze."""
    import gc
    import os

    if os.environ.get("LOCALHEAP_GC_FREEZE", "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    return True


STEP_TIMEOUT_S = 300.0   # --step-timeout: ~5x the slowest legitimate step we can think of (help)


def add_distributed_arg(p: argparse.ArgumentParser, watched: bool = False, steps: bool = False) -> None:
    """--distributed; with `watched` (serve, chat) --rank-timeout and --step-timeout, with `steps`
    (generate) --step-timeout alone."""
    p.add_argument("--distributed", default=None, choices=("tensor", "pipeline"),
                   help="run one shard per rank under `mlx.launch` (mlx backend): tensor splits every layer's "
                        "heads, pipeline splits the layers; each rank keeps the heap of what it holds "
                        "(default: one process)")
    if watched:
        p.add_argument("--rank-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="--distributed: a rank whose heartbeat is silent this long counts as lost (a rank "
                            "whose process ends counts at once); README: a lost rank")
    if watched or steps:
        p.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT_S, metavar="SECONDS",
                       help="--distributed: one step (a prefill chunk, a generated token, a save or restore) rank 0 "
                            "has waited in this long counts as the ranks lost: a rank alive but stuck. A 2048-token "
                            "chunk of a 70B model across two Macs should take seconds, up to about a minute on slow "
                            "hosts or 1 Gb Ethernet (an estimate); raise it for slower ones or a larger "
                            "--prefill-chunk (default: "
                            f"{STEP_TIMEOUT_S:g})")


def load_model_backend(args):
    """The backend for --model/--backend, or this rank's shard with --distributed; on MLX, the
    program's own process leaves torch out (models.leave_torch_out)."""
    from ..models import detect_backend, leave_torch_out, load_backend

    distributed = getattr(args, "distributed", None)
    if distributed and args.backend == "torch":
        raise SystemExit("--distributed runs on the mlx backend (mlx.launch); drop --backend torch")
    if getattr(args, "own_process", False) and (distributed or detect_backend(args.backend) == "mlx"):
        leave_torch_out(model_spec(args))
    if distributed:
        from ..backends.mlx.distributed import load_backend as load_shard
        return load_shard(model_spec(args), args.distributed)
    return load_backend(model_spec(args), args.backend)


def model_spec(args) -> str | None:
    if getattr(args, "random_model", None):
        return "random:" + args.random_model
    return args.model


def add_heap_args(p: argparse.ArgumentParser, recall: bool = False) -> None:
    """The heap flags. `recall`: whether the recall tier is on unless --recall says otherwise (on
    for serve, chat and generate; the benches compare, so they name it)."""
    d = HeapConfig()
    p.add_argument("--budget", type=int, default=d.budget, help="scored KV tokens kept per layer")
    p.add_argument("--sinks", type=int, default=d.sinks, help="first tokens always kept (attention sinks)")
    p.add_argument("--recent", type=int, default=d.recent, help="most recent tokens always kept")
    p.add_argument("--slack", type=int, default=d.slack, help="decode append room = decode eviction interval")
    p.add_argument("--prefill-chunk", type=at_least(0), default=None, metavar="N",
                   help="tokens per prefill forward, evicting before each (default: the backend's for its "
                        "device, e.g. 2048 on CUDA; 0: the slack); the heap holds sinks + budget + max(slack, chunk)")
    p.add_argument("--evict-stagger", default="off", choices=("off", "on"),
                   help="torch: a heap's decode evictions one layer a step instead of every layer at once (a "
                        "decode batch's rows all wait for an event); each layer still evicts once per slack, one "
                        "evicting early keeping as many slots fewer until its due step (default: off)")
    p.add_argument("--rewind", default="on", choices=("off", "on"),
                   help="a turn whose template rewrote the last reply (Qwen3 drops its reasoning) after that reply "
                        "evicted: on, the heap forgets the reply and keeps what it held before it; off, the "
                        "conversation is read again into a new session (default: on)")
    p.add_argument("--policy", default=d.policy, choices=POLICIES, help="how the tokens to keep are ranked")
    p.add_argument("--positions", default=d.positions, choices=POSITION_MODES,
                   help="compact: RoPE positions follow slot order; absolute: original positions")
    p.add_argument("--profile", default=d.profile, choices=("uniform", "pyramid"), help="budget across layers")
    p.add_argument("--recall", default=None, choices=("off", "on"),
                   help="page evicted KV out to disk and recall the best pages for each question (default: "
                        + ("on, unless --budget leaves no room for a recall region)" if recall else "off)"))
    p.set_defaults(recall_default=recall)
    p.add_argument("--recall-budget", type=int, default=None,
                   help=f"slots of --budget reserved for recalled pages (default: half the budget, at most "
                        f"{d.recall_budget:,}, and what --recent leaves)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    p.add_argument("--page-format", default=d.page_format, choices=PAGE_FORMATS,
                   help="how pages are stored: f32 (exact), f16, int8 (per token and head scale)")
    p.add_argument("--recall-summary", default=d.recall_summary, choices=RECALL_SUMMARIES,
                   help="page summary scored against the question: minmax (Quest) or mean key")
    p.add_argument("--recall-score", default=d.recall_score, choices=RECALL_SCORES,
                   help="a page's score: bound (its best summary score over the question's queries) or "
                        "zscore (each query's scores standardized over the pages first)")
    p.add_argument("--recall-select", default=d.recall_select, choices=RECALL_SELECTS,
                   help="spans: every layer and head recalls the same windows of the document, voted by "
                        "all of them; pages: each layer and head loads its own best pages")
    p.add_argument("--disk-budget", default="auto", metavar="SIZE",
                   help="bytes of pages per session (e.g. 20G); past it the lowest-value pages are dropped; "
                        f"0 = none (default auto: 1/{DISK_SHARE} of the free space on the sessions directory's disk "
                        "at start)")


def heap_config(args, backend=None, **overrides) -> HeapConfig:
    """The heap flags as a config. Without --prefill-chunk, the backend's device default
    (the slack when no backend is given yet: `with_backend_chunk` fills it in later)."""
    recent = min(args.recent, args.budget)
    chunk = getattr(args, "prefill_chunk", None)
    if chunk is None and backend is not None:
        chunk = backend.default_prefill_chunk()
    region = args.recall_budget
    if region is not None and region < args.page_size:   # (0 meant off here, on there, and a 2,048 nobody gave)
        raise ValueError(f"--recall-budget {region}: the recall region holds whole pages, at least one "
                         f"(--page-size {args.page_size}); to turn recall off pass --recall off")
    if region is None:
        region = default_recall_budget(args.budget, recent, args.page_size)
        if region == 0 and args.recall == "on":   # (not the default region's size: the budget leaves none)
            raise ValueError(f"--recall on: --budget {args.budget} with --recent {recent} leaves no room for a page "
                             f"of recalled tokens (--page-size {args.page_size}; the region is at most half the "
                             f"budget, and what --recent leaves); a larger --budget, a smaller --recent, or "
                             f"--recall-budget")
    recall = args.recall == "on" if args.recall is not None else getattr(args, "recall_default", False) and region > 0
    disk = disk_budget(args.disk_budget, getattr(args, "sessions_dir", None))   # checked even with recall off
    fields = dict(budget=args.budget, sinks=args.sinks, recent=recent, slack=args.slack,
                  prefill_chunk=chunk or 0, policy=args.policy, positions=args.positions, profile=args.profile,
                  recall=recall, recall_budget=region or HeapConfig.recall_budget, page_size=args.page_size,
                  page_format=args.page_format, recall_summary=args.recall_summary,
                  recall_score=args.recall_score, recall_select=args.recall_select,
                  disk_budget=disk if recall else 0, stagger=getattr(args, "evict_stagger", "off") == "on",
                  rewind=getattr(args, "rewind", "on") == "on")
    fields.update(overrides)
    return HeapConfig(**fields)


DISK_SHARE = 10   # --disk-budget auto: this fraction of the free space, per session


def disk_budget(text: str, where: Optional[Path] = None) -> int:
    """--disk-budget in bytes: a size, 0 (no bound) or auto (1/DISK_SHARE of the free space, now,
    on the disk holding `where`, default the home directory, where the sessions directory is)."""
    from ..governor.budget import parse_size

    text = str(text).strip()
    if text == "0":
        return 0
    if text.lower() != "auto":
        return parse_size(text)
    return max(1, shutil.disk_usage(_existing(where)).free // DISK_SHARE)


TOTAL_SHARE = 4   # --disk-total auto: this fraction of the space the sessions directory can use at start


def disk_total(text: str, where: Optional[Path] = None) -> int:
    """--disk-total in bytes: a size, 0 (no bound) or auto: 1/TOTAL_SHARE of what the sessions
    directory could grow to now (the free space on its disk plus what it already holds, so a
    restart does not shrink the bound by the sessions it kept)."""
    from ..governor.budget import parse_size
    from ..sessions.diskbudget import dir_bytes

    text = str(text).strip()
    if text.lower() != "auto":
        return 0 if text == "0" else parse_size(text)
    held = dir_bytes(Path(where)) if where is not None and Path(where).is_dir() else 0
    return max(1, (shutil.disk_usage(_existing(where)).free + held) // TOTAL_SHARE)


def _existing(where: Optional[Path]) -> Path:
    """`where` or its nearest existing parent (default the home directory, where the sessions directory is)."""
    place = Path(where) if where is not None else Path.home()
    while not place.exists() and place != place.parent:
        place = place.parent
    return place


def default_recall_budget(budget: int, recent: int, page_size: int) -> int:
    """The recall region when --recall-budget is not given: half the budget, at most
    HeapConfig's default, never more than the recent window leaves; whole pages (0: no room)."""
    slots = min(HeapConfig.recall_budget, budget // 2, budget - recent)
    return max(0, slots) // max(1, page_size) * page_size


def with_backend_chunk(cfg: HeapConfig, args, backend) -> HeapConfig:
    """cfg with the backend's default prefill chunk when --prefill-chunk was not given, and
    without --evict-stagger where the backend does not spread its events (MLX: it says so)."""
    if cfg.stagger and getattr(backend, "name", "torch") != "torch":
        log.warning("--evict-stagger: the %s backend evicts every layer at once; the flag is ignored", backend.name)
        cfg = cfg.with_(stagger=False)
    if getattr(args, "prefill_chunk", None) is None and not cfg.prefill_chunk:
        return cfg.with_(prefill_chunk=backend.default_prefill_chunk())
    return cfg


def check_heap_fits(backend, cfg: HeapConfig) -> None:
    """generate and chat (which have no --ram-budget): a heap, with its prefill's activations, that the
    RAM available now cannot hold is refused before it is allocated (a tensor that large fails in the
    allocator, or, where the system overcommits, the machine swaps)."""
    import psutil

    from ..governor.activations import prefill_activations
    from ..governor.setup import largest_budget
    from ..heap.stats import format_bytes

    shapes = backend.model_shapes()

    def need(c: HeapConfig) -> int:
        return int(backend.heap_bytes(c)) + prefill_activations(shapes, c).total

    free = psutil.virtual_memory().available
    if need(cfg) <= free:
        return
    fits = largest_budget(cfg, lambda c: need(c) <= free)
    raise ValueError(f"a heap of --budget {cfg.budget:,} tokens needs {format_bytes(need(cfg))} of RAM (its KV and "
                     f"a prefill chunk's activations) and {format_bytes(free)} is available: give a smaller "
                     f"--budget (about {fits:,} tokens would fit now; the default is {HeapConfig().budget:,})")
