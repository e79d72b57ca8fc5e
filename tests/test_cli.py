"""The command line itself: help without arguments, --version, a default in every option's
help, and --random-model on an installation without torch (the README's own install)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localheap.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
# Runs the CLI with some modules made unimportable, as on an installation without them.
WITHOUT = "import sys\nfor m in sys.argv[1].split(','): sys.modules[m] = None\n" \
          "from localheap.cli import main\nsys.exit(main(sys.argv[2:]))"


def run_without(modules: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, *args], capture_output=True, text=True,
                          timeout=240, env={**os.environ, **env}, cwd=ROOT)


def parsers(parser: argparse.ArgumentParser, name: str = "localheap"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def test_no_arguments_prints_help_and_exits_0(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: localheap") and "serve" in out and "chat" in out and "demo model" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip().startswith("localheap 0.")


def test_every_option_has_a_help_text_with_its_default():
    seen = 0
    for name, parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert text, f"{name} {action.option_strings[0]} has no help"
            if action.dest not in ("prompt", "prompt_file"):   # the prompt has no default: one of the two is required
                assert "default" in text, f"{name} {action.option_strings[0]}: no default in {text!r}"
            seen += 1
    assert seen > 60
    serve_help = dict(parsers(build_parser()))["localheap serve"].format_help()
    assert "bundled in the package" in " ".join(serve_help.split())


def test_random_model_without_torch_builds_through_mlx_lm(tmp_path):
    pytest.importorskip("mlx_lm")
    r = run_without("torch", "generate", "--random-model", "llama:tiny", "--backend", "mlx", "--prompt", "hello",
                    "--max-tokens", "4", env={"LOCALHEAP_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "tokens seen" in r.stderr and "backend mlx" in r.stderr
    built = tmp_path / "random-models" / "llama-tiny-s0"
    assert (built / "config.json").exists() and list(built.glob("*.safetensors"))


def test_random_model_without_torch_or_mlx_lm_says_what_to_install(tmp_path):
    r = run_without("torch,mlx_lm", "generate", "--random-model", "llama:tiny", "--prompt", "hello",
                    env={"LOCALHEAP_CACHE": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install" in lines[0] and "torch" in lines[0], r.stderr


def test_serve_and_chat_freeze_what_startup_made(monkeypatch):
    """freeze_startup_objects: a full collection, then everything alive out of the collector's
    reach, so that a full collection while serving walks only what serving made (one of the
    unfrozen process took 178 ms inside a decode step); LOCALHEAP_GC_FREEZE=0 leaves it."""
    import gc

    from localheap.commands.common import freeze_startup_objects

    monkeypatch.setenv("LOCALHEAP_GC_FREEZE", "0")
    assert freeze_startup_objects() is False and gc.get_freeze_count() == 0
    monkeypatch.setenv("LOCALHEAP_GC_FREEZE", "1")
    try:
        assert freeze_startup_objects() is True
        assert gc.get_freeze_count() > 1000
        young = [[i] for i in range(1000)]
        assert 0 < len(gc.get_objects()) < gc.get_freeze_count(), "collections walk the young objects only"
        del young
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
