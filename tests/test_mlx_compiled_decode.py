"""--compile-decode on MLX (backends/mlx/compiled.py): the mx.compile'd decode step gives mlx-lm's
tokens and logprobs bit for bit (full budget: stock; evicting: the uncompiled heap step)."""

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm import load  # noqa: E402

from localheap.backends.mlx import compiled, make_heap_cache  # noqa: E402
from localheap.generation import SamplingParams  # noqa: E402
from localheap.heap import HeapConfig  # noqa: E402

from test_mlx_equivalence import SLACK, assert_same_steps, heap_steps, prompt_ids, stock_steps  # noqa: E402


def steps(model, cfg, prompt, n, compile_decode, monkeypatch):
    calls = []
    original = compiled.CompiledDecode.__call__
    monkeypatch.setattr(compiled.CompiledDecode, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    cache = make_heap_cache(model, cfg)
    cache.compile_decode = compile_decode
    out = heap_steps(model, cache, prompt, n)
    monkeypatch.undo()
    return out, len(calls), cache.stats()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_step_gives_the_stock_tokens_at_full_budget(model_dirs, family, monkeypatch):
    model, tokenizer = load(str(model_dirs(family)))
    prompt = prompt_ids(tokenizer)
    got, calls, _ = steps(model, HeapConfig(budget=1024, slack=SLACK, recent=64), prompt, 96, True, monkeypatch)
    assert calls == 96 + 1, "every decode step, and once in the check against mlx-lm's forward"
    assert_same_steps(got, stock_steps(model, prompt, 96))


def test_compiled_step_on_an_evicting_heap_and_the_demo_model(monkeypatch):
    from localheap.models import demo_model_dir

    model, tokenizer = load(str(demo_model_dir()))
    prompt = prompt_ids(tokenizer)
    cfg = HeapConfig(budget=96, sinks=4, recent=16, slack=32)
    plain, plain_calls, plain_stats = steps(model, cfg, prompt, 80, False, monkeypatch)
    got, calls, stats = steps(model, cfg, prompt, 80, True, monkeypatch)
    assert plain_calls == 0 and calls == 80 + 1
    assert_same_steps(got, plain)
    assert stats.evictions == plain_stats.evictions > 0


def test_models_it_does_not_know_keep_the_forward(model_dirs, caplog):
    model, _ = load(str(model_dirs("gemma")))
    cache = make_heap_cache(model, HeapConfig(budget=256))
    with caplog.at_level("WARNING", logger="localheap.mlx"):
        assert compiled.compiled_step(model, cache) is None
    assert "not a Llama-shaped" in caplog.text


def test_a_compiled_step_that_differs_is_switched_off(model_dirs, monkeypatch, caplog):
    model, _ = load(str(model_dirs("llama")))
    monkeypatch.setattr(compiled, "_post", lambda layer, real=compiled._post: (
        lambda x, out, f=real(layer): f(x, out) * 1.0001))
    cache = make_heap_cache(model, HeapConfig(budget=256))
    with caplog.at_level("WARNING", logger="localheap.mlx"):
        assert compiled.compiled_step(model, cache) is None
    assert "differ" in caplog.text
