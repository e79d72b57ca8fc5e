"""Flags shared by commands: model selection and heap settings."""

from __future__ import annotations

import argparse

from ..heap import POLICIES, POSITION_MODES, HeapConfig


def add_model_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--model", default=None, required=required,
                   help="alias from models.toml, local model directory, hub repo id, or random:FAMILY:SIZE "
                        "(default: the small demo model bundled in the package, no download)")
    p.add_argument("--random-model", default=None, metavar="FAMILY:SIZE",
                   help="build a random-weight model of a real architecture locally, no weights needed, "
                        "e.g. llama:tiny (default: not used)")
    p.add_argument("--backend", default="auto", choices=("auto", "mlx", "torch"),
                   help="auto: mlx on Apple Silicon, torch where it is installed, else mlx")


def model_spec(args) -> str | None:
    if getattr(args, "random_model", None):
        return "random:" + args.random_model
    return args.model


def add_heap_args(p: argparse.ArgumentParser) -> None:
    d = HeapConfig()
    p.add_argument("--budget", type=int, default=d.budget, help="scored KV tokens kept per layer")
    p.add_argument("--sinks", type=int, default=d.sinks, help="first tokens always kept (attention sinks)")
    p.add_argument("--recent", type=int, default=d.recent, help="most recent tokens always kept")
    p.add_argument("--slack", type=int, default=d.slack, help="append room = prefill chunk = decode eviction interval")
    p.add_argument("--policy", default=d.policy, choices=POLICIES, help="how the tokens to keep are ranked")
    p.add_argument("--positions", default=d.positions, choices=POSITION_MODES,
                   help="compact: RoPE positions follow slot order; absolute: original positions")
    p.add_argument("--profile", default=d.profile, choices=("uniform", "pyramid"), help="budget across layers")


def heap_config(args, **overrides) -> HeapConfig:
    recent = min(args.recent, args.budget)
    fields = dict(budget=args.budget, sinks=args.sinks, recent=recent, slack=args.slack,
                  policy=args.policy, positions=args.positions, profile=args.profile)
    fields.update(overrides)
    return HeapConfig(**fields)
