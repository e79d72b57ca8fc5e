"""--decode-attention and --compile-decode: the fused and the compiled decode steps are opt-in on serve,
generate, chat and bench speed, and the flags reach the backend (its caches, and the decode steps of a
real generate run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from localheap.cli import build_parser, main
from localheap.commands.common import apply_decode_attention

COMMANDS = (["serve"], ["generate", "--prompt", "x"], ["chat"], ["bench", "speed"])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_decoding_command_takes_the_flag_and_defaults_to_sdpa(command):
    parser = build_parser()
    assert parser.parse_args(command).decode_attention == "sdpa"
    assert parser.parse_args([*command, "--decode-attention", "fused"]).decode_attention == "fused"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--decode-attention", "flash"])


def test_fused_reaches_the_torch_backend_and_its_caches(torch_one_thread):
    from localheap.backends.torch import TorchBackend
    from localheap.heap import HeapConfig

    backend = TorchBackend.load("localheap/demo_model", model_name="demo")
    assert apply_decode_attention(backend, SimpleNamespace(decode_attention="sdpa")) is False
    assert backend.fused_decode is False and backend.new_cache(HeapConfig(recall=False)).fused_decode is False
    assert apply_decode_attention(backend, SimpleNamespace(decode_attention="fused")) is True
    assert backend.fused_decode is True and backend.new_cache(HeapConfig(recall=False)).fused_decode is True
    with pytest.raises(SystemExit, match="torch backend"):
        apply_decode_attention(SimpleNamespace(name="mlx"), SimpleNamespace(decode_attention="fused"))


@pytest.mark.parametrize("flag", ["sdpa", "fused"])
def test_generate_decodes_through_the_fused_kernel_only_when_asked(flag, torch_one_thread, monkeypatch, capsys):
    """A real `localheap generate` run on the demo model: its decode steps call the fused kernel
    with --decode-attention fused, and never without it."""
    from localheap.backends.torch import attention

    calls = []
    fused = attention._fused_decode
    monkeypatch.setattr(attention, "_fused_decode", lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    assert main(["generate", "--backend", "torch", "--prompt", "The heap keeps", "--max-tokens", "6",
                 "--recall", "off", "--decode-attention", flag]) == 0
    assert capsys.readouterr().out.strip()
    assert (len(calls) > 0) == (flag == "fused"), calls


@pytest.mark.parametrize("command", COMMANDS + (["bench", "profile"],), ids=lambda c: " ".join(c[:2]))
def test_compile_decode_is_off_by_default_on_every_command(command):
    """generate and the benches decode one sequence (the compiled step); serve and chat decode in
    batches (the compiled packed step); every command takes the flag, off by default."""
    parser = build_parser()
    assert parser.parse_args(command).compile_decode is False
    assert parser.parse_args([*command, "--compile-decode"]).compile_decode is True


def test_compile_decode_reaches_the_torch_backend_and_its_caches(torch_one_thread):
    from localheap.backends.torch import TorchBackend
    from localheap.heap import HeapConfig

    backend = TorchBackend.load("localheap/demo_model", model_name="demo")
    apply_decode_attention(backend, SimpleNamespace(decode_attention="sdpa", compile_decode=False))
    assert backend.new_cache(HeapConfig(recall=False)).compile_decode is False
    assert apply_decode_attention(backend, SimpleNamespace(decode_attention="sdpa", compile_decode=True)) is False
    assert backend.compile_decode is True and backend.new_cache(HeapConfig(recall=False)).compile_decode is True
    with pytest.raises(SystemExit, match="distributed"):
        apply_decode_attention(backend, SimpleNamespace(decode_attention="sdpa", compile_decode=True,
                                                        distributed="tensor"))


def test_compile_decode_reaches_the_mlx_backend_and_its_caches():
    pytest.importorskip("mlx.core")
    from localheap.heap import HeapConfig
    from localheap.models import load_backend

    backend = load_backend("demo", "mlx")
    assert backend.new_cache(HeapConfig(recall=False)).compile_decode is False
    apply_decode_attention(backend, SimpleNamespace(decode_attention="sdpa", compile_decode=True))
    assert backend.new_cache(HeapConfig(recall=False)).compile_decode is True
