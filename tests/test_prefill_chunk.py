"""Prefill chunks independent of the slack: the heap evicts before every chunk once full, decode
still evicts every `slack` tokens, and the buffers (and the RAM plan's figure) cover the larger."""

import numpy as np
import pytest

from localheap.generation import SamplingParams
from localheap.heap import HeapConfig, HeapConfigError

CFG = HeapConfig(budget=64, sinks=4, recent=8, slack=16, prefill_chunk=48, policy="snapkv")
PROMPT = 400          # 8 chunks of 48 and one of 16: chunks 3..9 each evict first
DECODE = 49           # the first decode step evicts (slack full), then every 16 tokens


def check_stream(backend, cache):
    assert cache.cfg.chunk == 48 and cache.cfg.append_room == 48
    assert all(layer.heap.capacity == 4 + 64 + 48 for layer in cache.heap_layers)
    prompt = np.random.default_rng(0).integers(10, 1000, PROMPT + 1).tolist()
    backend.prefill(cache, prompt[:-1])
    assert [layer.heap.evictions for layer in cache.heap_layers] == [7] * len(cache.heap_layers)
    assert all(layer.heap.resident == 4 + 64 + 16 for layer in cache.heap_layers)
    out = list(backend.generate(cache, prompt[-1:], SamplingParams(max_tokens=DECODE)))
    assert len(out) == DECODE
    # 1 + 48 tokens fed after the prefill (the last sampled one is not): evictions at steps 1, 17, 33, 49
    assert [layer.heap.evictions for layer in cache.heap_layers] == [7 + 4] * len(cache.heap_layers)
    assert backend.stats(cache).resident <= CFG.layer_capacity(CFG.budget)
    assert cache.nbytes == backend.heap_bytes(CFG), "the RAM plan counts the chunk's room"
    with pytest.raises(HeapConfigError):
        cache.make_room(49)


def test_torch_prefill_chunk(model_dirs, torch_one_thread):
    import torch

    from localheap.backends.torch import TorchBackend

    backend = TorchBackend.load(model_dirs("llama"), dtype=torch.float32)
    check_stream(backend, backend.new_cache(CFG))


def test_mlx_prefill_chunk(model_dirs):
    pytest.importorskip("mlx.core")
    from localheap.backends.mlx import MLXBackend

    backend = MLXBackend.load(model_dirs("llama"))
    check_stream(backend, backend.new_cache(CFG))


def test_cli_default_chunk_comes_from_the_backend():
    import argparse

    from localheap.commands.common import add_heap_args, heap_config, with_backend_chunk

    class Backend:
        def default_prefill_chunk(self):
            return 1024

    p = argparse.ArgumentParser()
    add_heap_args(p)
    args = p.parse_args([])
    assert heap_config(args).prefill_chunk == 0 and heap_config(args).chunk == args.slack
    assert heap_config(args, Backend()).prefill_chunk == 1024
    assert with_backend_chunk(heap_config(args), args, Backend()).prefill_chunk == 1024
    given = p.parse_args(["--prefill-chunk", "300"])
    assert heap_config(given, Backend()).prefill_chunk == 300
    assert with_backend_chunk(heap_config(given), given, Backend()).prefill_chunk == 300
    assert HeapConfig(slack=256, prefill_chunk=1024).layer_capacity(4096) == 4 + 4096 + 1024
    assert HeapConfig(slack=256, prefill_chunk=100).layer_capacity(4096) == 4 + 4096 + 256


@pytest.mark.parametrize("recall", [False, True], ids=["plain", "recall"])
def test_torch_snapkv_window_scored_when_read_equals_every_chunk(model_dirs, torch_one_thread, monkeypatch, recall):
    """Small chunks (several per eviction) then decode, with recall's merges: the window scored
    only when read (the default) gives the same evictions, keys and window, bit for bit, as
    scoring every chunk's window at once."""
    import torch

    from localheap.backends.torch import TorchBackend
    from localheap.backends.torch.layer import HeapLayer

    backend = TorchBackend.load(model_dirs("llama"), dtype=torch.float32)
    cfg = CFG.with_(prefill_chunk=12, recall=recall, recall_budget=32, page_size=8) if recall else CFG.with_(prefill_chunk=12)
    prompt = np.random.default_rng(1).integers(10, 1000, 300).tolist()
    question = np.random.default_rng(2).integers(10, 1000, 20).tolist()
    runs = []
    for lazy in (True, False):
        monkeypatch.setattr(HeapLayer, "lazy_window", lazy)
        cache = backend.new_cache(cfg)
        backend.prefill(cache, prompt)
        tokens = list(backend.generate(cache, question, SamplingParams(max_tokens=20)))
        layers = cache.heap_layers
        assert layers[0].heap.evictions >= 5 and len(cache.recall_log) == recall
        runs.append((tokens, [(l.heap.evictions, l.heap.view_positions().copy(), l.keys.clone(), l.window.clone())
                              for l in layers]))
    (tokens_lazy, lazy_layers), (tokens_eager, eager_layers) = runs
    assert tokens_lazy == tokens_eager
    for (ea, pa, ka, wa), (eb, pb, kb, wb) in zip(lazy_layers, eager_layers):
        assert ea == eb
        np.testing.assert_array_equal(pa, pb)
        assert torch.equal(ka, kb) and torch.equal(wa, wb)


def test_cli_evict_stagger_is_a_torch_option(caplog):
    import argparse

    from localheap.commands.common import add_heap_args, heap_config, with_backend_chunk

    class Backend:
        def __init__(self, name):
            self.name = name

        def default_prefill_chunk(self):
            return 512

    p = argparse.ArgumentParser()
    add_heap_args(p)
    assert heap_config(p.parse_args([])).stagger is False
    args = p.parse_args(["--evict-stagger", "on"])
    assert heap_config(args).stagger is True
    assert with_backend_chunk(heap_config(args), args, Backend("torch")).stagger is True
    assert with_backend_chunk(heap_config(args), args, Backend("mlx")).stagger is False
    assert "--evict-stagger: the mlx backend evicts every layer at once" in caplog.text
