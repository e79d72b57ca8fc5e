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
    packages = {p.name for p in folder.rglob("*.pt2")}
    assert {"first.pt2", "last.pt2", "middle.pt2"} <= packages
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


def test_the_decode_batch_compiled_is_the_eager_batch(backend, monkeypatch):
    """serve's and chat's packed step: three rows of different lengths in a slab, evicting at
    different steps, and a document's chunks riding beside them for half the steps. Every step's
    logits through the packed graphs equal the eager packed step's, bit for bit."""
    from localheap.backends.torch.batch import start_row, step_rows

    cfg = HeapConfig(budget=64, sinks=4, recent=8, slack=16, prefill_chunk=32, recall=False)
    ids = text_ids(backend, 300)
    prompts = [ids[:40], ids[10:100], ids[50:170]]

    def run_batch(on: bool):
        backend.compile_decode = on
        try:
            caches = [backend.new_cache(cfg) for _ in prompts]
            rows = [start_row(backend.model, c, p, SamplingParams(max_tokens=10**6)) for c, p in zip(caches, prompts)]
            doc = backend.new_cache(cfg)
            backend.prefill(doc, ids[:60])
            slabs, out = {}, []
            for step in range(40):
                chunks = [(doc, ids[100 + 3 * step: 103 + 3 * step])] if step < 20 else []
                assert step_rows(backend.model, rows, chunks, slabs=slabs) == [None] * (len(rows) + len(chunks))
                out.append(torch.stack([r.logits for r in rows]))
            return torch.stack(out), [c.heap_layers[0].heap.evictions for c in caches + [doc]]
        finally:
            backend.compile_decode = False

    assert compiled.compiled_packed(backend.model) is not None   # built and checked before counting
    calls = []
    original = compiled.CompiledDecode.run
    monkeypatch.setattr(compiled.CompiledDecode, "run", lambda self, *a: calls.append(1) or original(self, *a))
    eager, evictions = run_batch(False)
    assert not calls
    comp, again = run_batch(True)
    assert len(calls) == 40, "every step through the packed graphs"
    assert torch.equal(comp, eager) and again == evictions
    assert len(set(evictions[:3]) - {0}) >= 2 and evictions[3] > 0, "rows and the document evicted"


def test_serve_and_chat_build_the_batch_graphs_at_startup(backend, monkeypatch, caplog):
    """--compile-decode on serve or chat builds and checks the packed graphs before the first
    request (torch); on a backend without them (mlx) it says the batch stays uncompiled."""
    from types import SimpleNamespace

    from localheap.cli import build_parser
    from localheap.commands.common import apply_decode_attention

    built = []
    monkeypatch.setattr(compiled, "compiled_packed", lambda model: built.append(model) or object())
    for command in ("serve", "chat"):
        args = build_parser().parse_args([command, "--compile-decode"])
        try:
            apply_decode_attention(backend, args, batched=True)
            assert backend.compile_decode
        finally:
            backend.compile_decode = False
    assert built == [backend.model, backend.model]
    mlx = SimpleNamespace(name="mlx", compile_decode=False)
    with caplog.at_level("WARNING", logger="localheap"):
        apply_decode_attention(mlx, build_parser().parse_args(["serve", "--compile-decode"]), batched=True)
    assert mlx.compile_decode and "stays uncompiled on the mlx backend" in caplog.text


def test_a_packed_step_that_differs_here_stays_eager(backend, monkeypatch, caplog):
    """Where the packed graphs' check finds other logits, packed steps run the eager lean step."""
    from localheap.models import demo_model_dir

    other = TorchBackend.load(demo_model_dir(), model_name="demo", dtype=torch.float32)
    monkeypatch.setattr(compiled, "agrees_packed", lambda *a, **k: False)
    with caplog.at_level("WARNING", logger="localheap.torch"):
        assert compiled.compiled_packed(other.model) is None
    assert "packed step stays eager" in caplog.text
    other.compile_decode = True
    cache = other.new_cache(HeapConfig(budget=64, recent=8, slack=16))
    step = lean.lean_packed(other.model, [cache])
    assert step is not None and not isinstance(step, compiled.CompiledDecode)


def test_batch_step_bench_times_the_compiled_packed_step(backend, monkeypatch):
    """bench batch-step --compile-decode: each batch size eager and through the packed graphs,
    and every heap back to eager after."""
    from localheap.bench.batch_step import rows_table

    assert compiled.compiled_packed(backend.model) is not None
    calls = []
    original = compiled.CompiledDecode.run
    monkeypatch.setattr(compiled.CompiledDecode, "run", lambda self, *a: calls.append(1) or original(self, *a))
    cfg = HeapConfig(budget=64, sinks=4, recent=16, slack=16, prefill_chunk=48, recall=False)
    rows = rows_table(backend, cfg, 100, [1, 2], steps=2, repeats=2, compiled=True)
    assert [r["rows"] for r in rows] == [1, 2] and all(r["compiled_ms"] > 0 and r["compiled_x"] > 0 for r in rows)
    assert len(calls) == 2 * 2 * (1 + 2), "rounds x sizes x (the joining step + the timed ones)"
