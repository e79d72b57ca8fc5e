"""The lean decode step (backends/torch/lean.py) gives transformers' logits bit for bit."""

import numpy as np
import pytest
import torch

from localheap.backends.torch import TorchBackend, lean
from localheap.backends.torch.generate import generate_steps
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def prompt(n=120):
    return np.random.default_rng(1).integers(10, 1000, n).tolist()


def decode(backend, cfg, enabled, monkeypatch, params=SamplingParams(max_tokens=60)):
    monkeypatch.setattr(lean, "ENABLED", enabled)
    calls = []
    original = lean.LeanDecode.__call__
    monkeypatch.setattr(lean.LeanDecode, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    cache = backend.new_cache(cfg)
    steps = list(generate_steps(backend.model, cache, prompt(), params))
    return [t for t, _ in steps], torch.stack([lg for _, lg in steps]), len(calls), cache.stats()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "glm4"])
@pytest.mark.parametrize("cfg", [HeapConfig(budget=4096), HeapConfig(budget=48, sinks=4, recent=8, slack=16),
                                 HeapConfig(budget=48, sinks=4, recent=8, slack=16, profile="pyramid")],
                         ids=["full", "evicting", "pyramid"])
def test_lean_step_matches_the_full_forward(model_dirs, family, cfg, monkeypatch):
    backend = TorchBackend.load(model_dirs(family), dtype=torch.float32)
    full_tokens, full_logits, full_calls, full_stats = decode(backend, cfg, False, monkeypatch)
    lean_tokens, lean_logits, lean_calls, lean_stats = decode(backend, cfg, True, monkeypatch)
    # every decode step (not the last token's), and once more for the check against the full forward
    assert full_calls == 0 and lean_calls == 59 + 1, "the lean step ran every decode step"
    assert lean_tokens == full_tokens
    assert torch.equal(lean_logits, full_logits)
    assert lean_stats.tokens_seen == full_stats.tokens_seen and lean_stats.evictions == full_stats.evictions


def test_sampled_tokens_match(model_dirs, monkeypatch):
    backend = TorchBackend.load(model_dirs("llama"), dtype=torch.float32)
    cfg = HeapConfig(budget=48, sinks=4, recent=8, slack=16)
    params = SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=5)
    full = decode(backend, cfg, False, monkeypatch, params)
    lean_run = decode(backend, cfg, True, monkeypatch, params)
    assert lean_run[0] == full[0] and torch.equal(lean_run[1], full[1])


def test_a_lean_step_that_differs_here_is_switched_off(model_dirs, monkeypatch, caplog):
    """Where it runs (a device, dtype or kernels the tests never saw), the lean step is checked
    once against the full forward; a difference in the last bit sends every step through the
    full forward, with a warning."""
    backend = TorchBackend.load(model_dirs("llama"), dtype=torch.float32)
    real = lean._rms_norm
    monkeypatch.setattr(lean, "_rms_norm", lambda x, w, eps: real(x, w, eps * 1.0001))
    cache = backend.new_cache(HeapConfig(budget=512))
    with caplog.at_level("WARNING", logger="localheap.torch"):
        assert lean.lean_step(backend.model, cache) is None
    assert "differ" in caplog.text and backend.model.__dict__["_localheap_lean"] is None
    monkeypatch.undo()
    again = TorchBackend.load(model_dirs("llama"), dtype=torch.float32)
    assert lean.lean_step(again.model, again.new_cache(HeapConfig(budget=512))) is not None


def test_other_families_keep_the_full_forward(model_dirs):
    backend = TorchBackend.load(model_dirs("gemma"), dtype=torch.float32)
    assert not lean.LeanDecode.supports(backend.model)
    assert lean.lean_step(backend.model, backend.new_cache(HeapConfig(budget=512))) is None


def test_fused_decode_gives_the_stock_tokens_on_the_demo_model(monkeypatch):
    """The fused decode (one pass for outputs and scores, `bench peer`'s heap-fused) is not bit for
    bit stock sdpa; on the trained demo model its greedy tokens are the same, full budget or evicting."""
    from localheap.models import demo_model_dir

    backend = TorchBackend.load(demo_model_dir(), dtype=torch.float32)
    ids = backend.tokenizer("The heap keeps the tokens that matter most. " * 40)["input_ids"]
    for cfg in (HeapConfig(budget=1024, prefill_chunk=256), HeapConfig(budget=128, recent=32, slack=32)):
        runs = {}
        for fused in (False, True):
            backend.fused_decode = fused
            cache = backend.new_cache(cfg)
            runs[fused] = [t for t, _ in generate_steps(backend.model, cache, ids, SamplingParams(max_tokens=96))]
        assert runs[True] == runs[False]


@pytest.mark.parametrize("slabs", [None, {}], ids=["per-heap", "slab"])
def test_a_packed_step_through_the_lean_forward_matches_the_full_forward(model_dirs, slabs, monkeypatch):
    """The decode batch (batch.step_rows) runs its packed forward through the lean ops: rows of
    different lengths, a one-token turn and a prefill chunk riding beside them, evicting, give
    the full forward's logits and heaps bit for bit, step after step."""
    from localheap.backends.torch import slab_cpu
    from localheap.backends.torch.batch import leave_slab, start_row, step_rows

    slab_cpu.load(wait=True)   # the slab's attention kernel (where it builds) settled: both runs take the same path
    backend = TorchBackend.load(model_dirs("llama"), dtype=torch.float32)
    cfg = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy="snapkv", prefill_chunk=32)
    rng = np.random.default_rng(3)
    doc = rng.integers(10, backend.vocab_size, 900).tolist()
    runs = {}
    for enabled in (False, True):
        monkeypatch.setattr(lean, "ENABLED", enabled)
        calls = []
        original = lean.LeanDecode.run
        monkeypatch.setattr(lean.LeanDecode, "run", lambda self, *a: calls.append(1) or original(self, *a))
        rows = [start_row(backend.model, backend.new_cache(cfg), p, SamplingParams(max_tokens=100), defer=d)
                for p, d in ((prompt(20), False), (prompt(70), False), ([7], True))]
        reader = backend.new_cache(cfg)
        logits = []
        for i in range(0, len(doc), 10):
            assert step_rows(backend.model, rows, [(reader, doc[i:i + 10])], slabs=slabs) == [None] * 4
            logits.append(torch.stack([r.logits for r in rows]))
        for r in rows:
            leave_slab(r)
        runs[enabled] = (torch.stack(logits), [r.cache for r in rows] + [reader], len(calls))
        monkeypatch.undo()
    (full, full_caches, full_calls), (lean_logits, lean_caches, lean_calls) = runs[False], runs[True]
    assert full_calls == 0 and lean_calls >= len(doc) // 10, "every packed step went through the lean forward"
    assert torch.equal(lean_logits, full)
    for a, b in zip(full_caches, lean_caches):
        assert a.stats().evictions == b.stats().evictions > 0
        for la, lb in zip(a.heap_layers, b.heap_layers):
            np.testing.assert_array_equal(la.heap.view_positions(), lb.heap.view_positions())
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
