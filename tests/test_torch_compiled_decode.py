"""--compile-decode (backends/torch/compiled.py): the lean step's per-token parts compiled ahead of
time give the eager lean step's logits and the stock path's greedy tokens on the demo model.

One compile per test session (three graphs, about 20-30 s on a small CPU) into a temporary cache
directory; skipped where torch inductor cannot compile (no C++ compiler)."""

from __future__ import annotations

import pytest
import torch

from localheap.backends.torch import TorchBackend, compiled, lean
from localheap.backends.torch.generate import generate_steps
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

pytestmark = [pytest.mark.usefixtures("torch_one_thread"),
              pytest.mark.skipif(compiled.available() is not None, reason=str(compiled.available()))]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from localheap.models import demo_model_dir

    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALHEAP_COMPILE_CACHE", str(tmp_path_factory.mktemp("compiled")))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = TorchBackend.load(demo_model_dir(), model_name="demo", dtype=torch.float32)
        assert compiled.compiled_step(b.model) is not None   # compiles here, once for the module
        yield b
    finally:
        torch.set_num_threads(n)
        mp.undo()


def run(backend, cfg, ids, compile_decode, fused=False, max_tokens=64, monkeypatch=None):
    """(tokens, logits [n, vocab], compiled steps taken)."""
    calls = []
    original = compiled.CompiledDecode.__call__
    monkeypatch.setattr(compiled.CompiledDecode, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    backend.compile_decode, backend.fused_decode = compile_decode, fused
    try:
        steps = list(generate_steps(backend.model, backend.new_cache(cfg), ids, SamplingParams(max_tokens=max_tokens)))
    finally:
        backend.compile_decode = backend.fused_decode = False
        monkeypatch.undo()
    return [t for t, _ in steps], torch.stack([lg for _, lg in steps]), len(calls)


def text_ids(backend, n=400):
    return backend.tokenizer("The heap keeps the tokens that matter most. " * 60)["input_ids"][:n]


def test_compiled_step_is_the_lean_step_and_stock_at_full_budget(backend, monkeypatch):
    from localheap.backends.torch.bench import stock_tokens
    from transformers import DynamicCache

    ids = text_ids(backend)
    cfg = HeapConfig(budget=1024, prefill_chunk=256)
    eager = run(backend, cfg, ids, False, monkeypatch=monkeypatch)
    comp = run(backend, cfg, ids, True, monkeypatch=monkeypatch)
    assert eager[2] == 0 and comp[2] == 63, "every decode step (not the last token's) ran the compiled step"
    assert comp[0] == eager[0]
    assert torch.equal(comp[1], eager[1]), "logits bit for bit (RMSNorm's mean through aten's kernel)"
    backend.model.set_attn_implementation("sdpa")
    try:
        stock = list(stock_tokens(backend.model, DynamicCache(config=backend.model.config), ids, 64))
    finally:
        backend.model.set_attn_implementation(lean.attention.ATTN_IMPLEMENTATION)
    assert comp[0] == stock


def test_compiled_step_on_an_evicting_heap_and_with_the_fused_decode(backend, monkeypatch):
    ids = text_ids(backend, 300)
    cfg = HeapConfig(budget=96, sinks=4, recent=16, slack=32)
    eager = run(backend, cfg, ids, False, max_tokens=80, monkeypatch=monkeypatch)
    comp = run(backend, cfg, ids, True, max_tokens=80, monkeypatch=monkeypatch)
    assert comp[2] == 79 and comp[0] == eager[0] and torch.equal(comp[1], eager[1])
    fused = run(backend, cfg, ids, False, fused=True, max_tokens=80, monkeypatch=monkeypatch)
    both = run(backend, cfg, ids, True, fused=True, max_tokens=80, monkeypatch=monkeypatch)
    assert both[2] == 79 and both[0] == fused[0] and torch.equal(both[1], fused[1])


def test_the_compiled_graphs_are_cached_by_shape_and_reloaded(backend, tmp_path, monkeypatch):
    """A second model of the same shapes loads the graphs from disk (no compile), and they run
    with its own weights (inputs, not constants)."""
    from localheap.models import demo_model_dir

    folder = compiled._cache_dir()
    packages = sorted(folder.rglob("*.pt2"))
    assert [p.name for p in packages] == ["first.pt2", "last.pt2", "middle.pt2"]
    other = TorchBackend.load(demo_model_dir(), model_name="demo", dtype=torch.float32)
    with torch.no_grad():
        for p in other.model.parameters():
            p.mul_(1.01)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: pytest.fail("compiled again"))
    assert compiled.compiled_step(other.model) is not None
    ids = text_ids(other, 120)
    cfg = HeapConfig(budget=512, prefill_chunk=64)
    eager = run(other, cfg, ids, False, max_tokens=16, monkeypatch=pytest.MonkeyPatch())
    comp = run(other, cfg, ids, True, max_tokens=16, monkeypatch=pytest.MonkeyPatch())
    assert comp[2] == 15 and torch.equal(comp[1], eager[1])
    assert not torch.equal(comp[1], run(backend, cfg, ids, True, max_tokens=16, monkeypatch=pytest.MonkeyPatch())[1])


def test_a_compiled_step_that_differs_here_keeps_the_eager_step(backend, monkeypatch, caplog):
    """Where the once-per-model check finds other logits (a dtype or kernels the tests never saw),
    every step stays eager, with a warning."""
    from localheap.models import demo_model_dir

    other = TorchBackend.load(demo_model_dir(), model_name="demo", dtype=torch.float32)
    monkeypatch.setattr(compiled, "agrees", lambda *a, **k: False)
    with caplog.at_level("WARNING", logger="localheap.torch"):
        assert compiled.compiled_step(other.model) is None
    assert "differ" in caplog.text and other.model.__dict__["_localheap_compiled"] is None
    monkeypatch.undo()
    tokens, _, calls = run(other, HeapConfig(budget=512), text_ids(other, 64), True, max_tokens=8,
                           monkeypatch=pytest.MonkeyPatch())
    assert calls == 0 and len(tokens) == 8
