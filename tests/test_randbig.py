"""Real models' shapes with random weights: the configs match the published parameter counts
(built on the meta device: no memory), and the loader builds a usable backend (tiny override)."""

import pytest
import torch

from localheap import randbig

PARAMS = {  # published parameter counts
    "llama:1b": 1_235_814_400, "llama:8b": 8_030_261_248, "qwen3:0.6b": 596_049_920,
    "qwen3:8b": 8_190_735_360, "qwen2:7b": 7_615_616_512, "mistral:7b": 7_248_023_552,
}


@pytest.mark.parametrize("spec", sorted(PARAMS))
def test_shapes_have_the_published_parameter_counts(spec):
    model, tokenizer = randbig.build(spec, device="meta")
    assert sum(p.numel() for p in model.parameters()) == PARAMS[spec]
    assert all(p.device.type == "meta" for p in model.parameters()), "nothing allocated"
    assert tokenizer("hello").input_ids and model.config.vocab_size >= len(tokenizer)


def test_in_memory_backend_generates(monkeypatch, torch_one_thread):
    """The in-memory path end to end, on a shape shrunk to test size (the real ones are for GPUs)."""
    from localheap.generation import SamplingParams
    from localheap.heap import HeapConfig
    from localheap.models import load_backend

    family, fields = randbig.SHAPES["llama:8b"]
    small = dict(fields, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=2048)
    monkeypatch.setitem(randbig.SHAPES, "llama:8b", (family, small))
    backend = load_backend("random:llama:8b", "auto")   # auto takes torch for these shapes
    assert backend.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    cache = backend.new_cache(HeapConfig(budget=32, sinks=4, recent=8, slack=8, prefill_chunk=16))
    out = list(backend.generate(cache, list(range(10, 110)), SamplingParams(max_tokens=5)))
    assert len(out) == 5 and cache.stats().evicted > 0
    assert "in memory" in backend.model_name
    vocab = len(backend.tokenizer)   # the head's rows past the tokenizer are zero: replies are text
    assert vocab < small["vocab_size"] and not backend.model.lm_head.weight[vocab:].any()
    assert backend.model.lm_head.weight[:vocab].abs().sum() > 0
    assert all(t < vocab for t in out)


def test_the_backend_choice_for_in_memory_shapes(monkeypatch):
    """--backend mlx is refused; auto says why torch cannot load rather than falling back to mlx."""
    import sys

    from localheap.models import ModelNotFound, load_backend

    with pytest.raises(ModelNotFound, match="torch backend only"):
        load_backend("random:llama:8b", "mlx")
    import localheap.backends

    monkeypatch.setitem(sys.modules, "localheap.backends.torch", None)   # import fails as without torch
    monkeypatch.delattr(localheap.backends, "torch", raising=False)
    with pytest.raises(ModelNotFound, match="unavailable"):
        load_backend("random:llama:8b", "auto")
