"""`localheap generate`: one prompt through the heap, text and heap stats out."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..generation import SamplingParams, StopMatcher
from .common import (add_compile_arg, at_least, add_decode_arg, add_distributed_arg, add_heap_args, add_model_args,
                     add_penalty_args, apply_decode_attention, check_heap_fits, heap_config, load_model_backend,
                     penalty_params)
from .progress import ProgressBar
from .ranks import StepWatch


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt file through the heap")
    add_model_args(p)
    add_heap_args(p, recall=True)
    add_decode_arg(p)
    add_compile_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    src.add_argument("--prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=at_least(0), default=256, help="most tokens generated")
    p.add_argument("--temperature", type=float, default=0.0, help="0 samples greedily")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest, 0: all")
    add_penalty_args(p)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop sequence, repeatable (default: none)")
    add_distributed_arg(p, steps=True)
    p.set_defaults(func=run)


def read_prompt(path: Path) -> str:
    """--prompt-file's text (UTF-8), or a ValueError that says why not."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ValueError(f"cannot read --prompt-file {path}: {e.strerror or e}") from None


def run(args) -> int:
    text = args.prompt if args.prompt is not None else read_prompt(args.prompt_file)
    heap_config(args)   # bad heap flags fail before the model loads
    backend = load_model_backend(args)
    apply_decode_attention(backend, args)
    if getattr(backend, "rank", 0) != 0:   # a follower rank: the same steps, rank 0 prints
        sys.stdout = sys.stderr = open(os.devnull, "w")
    cfg = heap_config(args, backend)
    check_heap_fits(backend, cfg)
    tok = backend.tokenizer
    if args.chat:
        from ..server.prompts import chat_prompt
        from ..server.schemas import ChatMessage

        from ..server.errors import ApiError

        # as the server renders a chat (transformers 5's apply_chat_template returns a BatchEncoding)
        try:
            tokens = list(chat_prompt(tok, [ChatMessage(role="user", content=text)]).tokens)
        except ApiError as e:   # (its own words are the server's: "use /v1/completions")
            raise ValueError(f"--chat: {str(e).split(';')[0]}; leave --chat out to read the prompt as it is") \
                from None
    else:
        tokens = tok.encode(text)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop,
                            **penalty_params(args, tok)).with_context([], tokens)
    cache = backend.new_cache(cfg)
    bar = ProgressBar("prefill", stream=sys.stderr) if len(tokens) > 4 * cfg.chunk else None
    watch = StepWatch(args.step_timeout, backend.rank) if getattr(backend, "ranks", None) is not None else None
    progress = bar.update if bar else None
    if watch is not None:   # every prefill chunk is a step
        progress = (lambda *a: (watch.tick(), bar.update(*a))) if bar else watch.tick
    t0 = time.perf_counter()
    generated: list[int] = []
    stops = StopMatcher(params.stop)
    shown = ""
    t_first = None
    for token in backend.generate(cache, tokens, params, progress=progress):
        if watch is not None:
            watch.tick()
        if t_first is None:
            t_first = time.perf_counter()
            if bar:
                bar.close()
        if token in backend.eos_token_ids:
            break
        generated.append(token)
        full = tok.decode(generated)
        out, stopped = stops.feed(full[len(shown):])
        shown = full
        sys.stdout.write(out)
        sys.stdout.flush()
        if stopped:
            break
    else:
        sys.stdout.write(stops.flush())
    t_end = time.perf_counter()
    if watch is not None:
        watch.end()
    sys.stdout.write("\n")
    stats = backend.stats(cache)
    prefill_s = (t_first or t_end) - t0
    decode_s = t_end - (t_first or t_end)
    print(f"--- heap: {stats.summary()}", file=sys.stderr)
    print(f"--- prompt {len(tokens):,} tokens in {prefill_s:.2f}s | generated {len(generated):,} tokens "
          f"({len(generated) / decode_s if decode_s > 0 else 0:.1f} tok/s) | policy {cfg.policy}, "
          f"positions {cfg.positions}, backend {backend.name}", file=sys.stderr)
    return 0
