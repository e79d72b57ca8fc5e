"""`localheap` command line: serve, generate, bench. Each command lives in localheap/commands/."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("serve", "generate", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localheap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"localheap.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    from .errors import UserError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"localheap: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
