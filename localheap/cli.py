"""`localheap` command line: serve, chat, generate, bench, models. Each command lives in localheap/commands/.

Without --model every command runs the small demo model bundled in the package (no download)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

COMMANDS = ("serve", "chat", "generate", "bench", "models")


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Appends '(default: X)' to every option's help; a None default is described in the help itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if action.option_strings and action.default is False:
            return text + " (default: off)"
        if isinstance(action.default, list):
            shown = ",".join(str(x) for x in action.default) or "none"
            return text + f" (default: {shown})"
        return super()._get_help_string(action)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("localheap")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown"


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelp
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localheap", description=__doc__,
                                     epilog="`localheap COMMAND --help` lists a command's options and defaults.")
    parser.add_argument("--version", action="version", version=f"localheap {version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"localheap.commands.{name}")
        module.add_parser(sub)
    _use_formatter(parser)
    return parser


def main(argv=None) -> int:
    from .errors import UserError

    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:   # `localheap` alone: say what there is
        parser.print_help()
        return 0
    # the program itself (the console script, python -m localheap.cli), not a caller's main([...]):
    # what it does to its interpreter (models.leave_torch_out) touches nothing else
    args.own_process = argv is None
    if args.own_process and args.command != "serve":   # (serve stops its requests on SIGTERM itself)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"localheap: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so that it unwinds as for Ctrl-C (temporary files and
    the servers a bench started go; their cleanup runs) and exits 143, not killed outright."""


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a second SIGTERM kills at once
    raise Terminated()


if __name__ == "__main__":
    sys.exit(main())
