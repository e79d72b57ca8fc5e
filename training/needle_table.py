"""Measure the needle table in parts (parallel processes on a small CPU), then merge and plot.

    python training/needle_table.py part --model demo --out runs/needle/short.json --long-contexts ""
    python training/needle_table.py part --model demo --out runs/needle/long.json --prune ""
    python training/needle_table.py merge runs/needle/short.json runs/needle/long.json --plots docs/

`localheap bench needle` runs the same `run_needle` in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from localheap.bench import needle  # noqa: E402


class _Named:
    def __init__(self, name, backend):
        self.model_name, self.name = name, backend


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def part(args) -> None:
    import torch

    from localheap.heap import HeapConfig
    from localheap.models import load_backend

    torch.set_num_threads(args.threads)
    backend = load_backend(args.model, args.backend)
    base = HeapConfig(budget=args.budget, recent=args.recent, slack=args.slack, prefill_chunk=args.prefill_chunk)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result = needle.run_needle(backend, base, context=args.context, prune=_floats(args.prune),
                               policies=args.policies.split(",") if args.policies else None,
                               trials=args.trials, long_contexts=_ints(args.long_contexts),
                               long_trials=args.long_trials, long_full=_ints(args.long_full), seed=args.seed,
                               positions=args.positions.split(","), keys=args.keys, filler=args.filler, log=log)
    result["backend"], result["model"] = backend.name, backend.model_name
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result) + "\n")


def merge(args) -> None:
    parts = [json.loads(Path(p).read_text()) for p in args.parts]
    merged = needle.merge(parts)
    paths = needle.plot(merged, args.plots) if args.plots else []
    if args.out:
        Path(args.out).write_text(json.dumps({"model": parts[0]["model"], "backend": parts[0]["backend"],
                                              **merged, "plots": paths}) + "\n")
    needle.report(merged, _Named(parts[0]["model"], parts[0]["backend"]), paths)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("part")
    a.add_argument("--model", default="demo")
    a.add_argument("--backend", default="torch")
    a.add_argument("--out", required=True)
    a.add_argument("--context", type=int, default=4096)
    a.add_argument("--prune", default="0.1,0.3,0.5,0.7,0.9")
    a.add_argument("--policies", default="")
    a.add_argument("--trials", type=int, default=100)
    a.add_argument("--long-contexts", default="16384,65536")
    a.add_argument("--long-trials", type=int, default=20)
    a.add_argument("--long-full", default="", help="long contexts that also get a full-cache cell")
    a.add_argument("--budget", type=int, default=4096)
    a.add_argument("--recent", type=int, default=64)
    a.add_argument("--slack", type=int, default=256)
    a.add_argument("--prefill-chunk", type=int, default=0, help="0: the slack (the table before issue 11)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--keys", type=int, default=1, help="named facts per episode (1: the single pass key)")
    a.add_argument("--filler", default="pydoc", help="pydoc (the v1 table's), heldout or digits")
    a.add_argument("--positions", default="compact,absolute")
    a.add_argument("--threads", type=int, default=1)
    a.set_defaults(func=part)
    m = sub.add_parser("merge")
    m.add_argument("parts", nargs="+")
    m.add_argument("--plots", default="")
    m.add_argument("--out", default="", help="write the merged result (JSON) here")
    m.set_defaults(func=merge)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
