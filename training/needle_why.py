"""Why a policy loses the needle: after each episode's answer, which layers still hold every digit
token of the key (the needle states the key twice), and how that goes with the answer being right.

    python training/needle_why.py --policies h2o,random,geometry --prune 0.1 --trials 25

A policy may carry heap settings: h2o:h2o_normalize=1, snapkv:pool_kernel=1. Episodes are the needle bench's own
(seeded; every `100 / trials`-th of its 100 episodes at 4096 tokens), answered the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from localheap.bench import needle  # noqa: E402


def digit_positions(tok, ep) -> tuple[np.ndarray, np.ndarray]:
    span = np.arange(ep.needle_start, ep.needle_start + ep.needle_len)
    digits = span[[tok.decode([ep.tokens[i]]).strip().isdigit() for i in span]]
    return digits[:needle.KEY_DIGITS], digits[needle.KEY_DIGITS:]


def episode(backend, cfg, ep) -> tuple[bool, list[tuple[bool, bool]]]:
    """(answered right, per layer: (first copy intact, second copy intact) in every KV head)."""
    from localheap.generation import SamplingParams

    tok = needle._hf(backend.tokenizer)
    cache = backend.new_cache(cfg)
    out = []
    for t in backend.generate(cache, ep.tokens, SamplingParams(max_tokens=needle.MAX_ANSWER_TOKENS)):
        if t in backend.eos_token_ids:
            break
        out.append(t)
    first, second = digit_positions(tok, ep)
    layers = []
    for layer in cache.heap_layers:
        h = layer.heap
        kept = [h.positions[k, :h.resident] for k in range(h.n_kv_heads)]
        layers.append((all(np.isin(first, k).all() for k in kept), all(np.isin(second, k).all() for k in kept)))
    return needle.read_key(tok.decode(out)) == ep.key, layers


def _share(xs) -> str:
    return f"{np.mean(xs):.0%}" if len(xs) else "-"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--backend", default="torch")
    p.add_argument("--policies", default="h2o,snapkv,geometry,streaming,random", type=lambda t: t.split(","))
    p.add_argument("--prune", type=float, default=0.1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--trials", type=int, default=25)
    args = p.parse_args(argv)

    from localheap.heap import HeapConfig
    from localheap.models import load_backend

    backend = load_backend(args.model, args.backend)
    base = HeapConfig(budget=args.context, recent=64, slack=256)
    budget = needle.budget_for(args.context, args.prune, base.sinks)
    eps = needle.episodes(backend.tokenizer, args.context, 100, 0)[::max(1, 100 // args.trials)][:args.trials]
    for name in args.policies:
        policy, *settings = name.split(":")
        extra = {k: type(getattr(base, k))(float(v)) for k, v in (x.split("=") for x in settings)}
        cfg = base.with_(budget=budget, policy=policy, recent=min(64, budget // 2), **extra)
        res = [episode(backend, cfg, ep) for ep in eps]
        ok = [r[0] for r in res]
        print(f"{name}, pruning {args.prune:.0%}: accuracy {np.mean(ok):.0%} over {len(res)} episodes")
        for i in range(len(res[0][1])):
            print(f"  layer {i}: first copy intact {_share([r[1][i][0] for r in res])}, "
                  f"second copy intact {_share([r[1][i][1] for r in res])}")
        one = [all(a or b for a, b in r[1]) for r in res]
        print(f"  every layer keeps at least one whole copy: {_share(one)}; accuracy then "
              f"{_share([o for o, a in zip(ok, one) if a])}, otherwise {_share([o for o, a in zip(ok, one) if not a])}",
              flush=True)


if __name__ == "__main__":
    main()
