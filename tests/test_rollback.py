"""Rolling a heap back to a shorter prefix: exact back to the latest repack, on both backends.

A rolled-back heap that is then fed a different continuation gives the same tokens as a
fresh heap fed the prefix and that continuation (budget >= context: the stock equivalence)."""

from __future__ import annotations

import numpy as np
import pytest

from localheap.generation import SamplingParams
from localheap.heap import HeapConfig, LayerHeap

WIDE = HeapConfig(budget=512, sinks=4, recent=16, slack=32, policy="h2o")       # never evicts here
TIGHT = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy="h2o")        # evicts every 16 tokens
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_layer_heap_truncates_only_back_to_its_latest_repack():
    heap = LayerHeap(TIGHT, n_kv_heads=2, budget=TIGHT.budget)
    heap.append(40)
    assert heap.repacked_at == 0
    heap.truncate(30)
    assert (heap.resident, heap.seen) == (30, 30)
    heap.append(38)   # fills the capacity (68): the next step repacks
    heap.apply(heap.plan(_random_view(heap)))
    assert heap.repacked_at == 68 and heap.resident == TIGHT.sinks + TIGHT.budget
    heap.append(10)
    with pytest.raises(ValueError):
        heap.truncate(60)   # before the repack: those slots were repacked
    heap.truncate(70)
    assert heap.seen == 70 and heap.resident == TIGHT.sinks + TIGHT.budget + 2
    state = heap.state()
    restored = LayerHeap(TIGHT, n_kv_heads=2, budget=TIGHT.budget)
    restored.load_state(state)
    assert restored.repacked_at == 68
    state["counters"] = state["counters"][:4]   # a file written before rollback existed
    restored.load_state(state)
    assert restored.repacked_at == restored.seen


def _random_view(heap):
    from localheap.heap import SlotView

    rng = np.random.default_rng(0)
    return SlotView(positions=heap.view_positions(), attention=rng.random((heap.n_kv_heads, heap.resident)))


def _backends(model_dirs):
    out = []
    try:
        import torch  # noqa: F401

        from localheap.backends.torch import TorchBackend
        out.append(TorchBackend.load(model_dirs("llama")))
    except ImportError:
        pass
    try:
        import mlx.core  # noqa: F401

        from localheap.backends.mlx import MLXBackend
        out.append(MLXBackend.load(model_dirs("llama")))
    except ImportError:
        pass
    return out


@pytest.fixture(scope="module")
def backends(model_dirs, torch_one_thread):
    found = _backends(model_dirs)
    if not found:
        pytest.skip("neither torch nor mlx is installed")
    return found


def _ids(backend, text):
    return backend.tokenizer.encode(text, add_special_tokens=False)


def _reply(backend, cache, new_tokens):
    gen = backend.generate(cache, new_tokens, GREEDY)
    out = [next(gen) for _ in range(GREEDY.max_tokens)]
    gen.close()
    return out


def test_rollback_then_other_continuation_equals_a_fresh_heap(backends):
    for backend in backends:
        prefix = _ids(backend, "the heap keeps sinks, heavy hitters and a recent window. " * 3)
        first, second = _ids(backend, " first branch of the talk"), _ids(backend, " a second, other branch")
        cache = backend.new_cache(WIDE)
        backend.prefill(cache, prefix + first)
        assert backend.rollback_floor(cache) == 0
        backend.truncate(cache, len(prefix))
        assert backend.tokens_in_cache(cache) == len(prefix)
        rolled = _reply(backend, cache, second)
        fresh = backend.new_cache(WIDE)
        backend.prefill(fresh, prefix)
        assert rolled == _reply(backend, fresh, second), backend.name


def test_rollback_is_refused_before_the_latest_eviction(backends):
    for backend in backends:
        tokens = _ids(backend, "one two three four five six seven eight nine ten " * 12)
        cache = backend.new_cache(TIGHT)
        for i in range(0, len(tokens), TIGHT.slack):
            backend.prefill(cache, tokens[i:i + TIGHT.slack])
        floor = backend.rollback_floor(cache)
        assert 0 < floor <= len(tokens) and backend.stats(cache).evicted > 0
        with pytest.raises((ValueError, AssertionError)):
            backend.truncate(cache, floor - 1)
        backend.truncate(cache, floor)
        assert backend.tokens_in_cache(cache) == floor


def test_a_recall_merge_or_release_moves_the_floor():
    cfg = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy="h2o", recall=True, recall_budget=16,
                     page_size=8)
    heap = LayerHeap(cfg, n_kv_heads=2, budget=cfg.budget)
    heap.append(60)
    plan = heap.plan(_random_view(heap))
    gone = np.stack([np.setdiff1d(np.arange(60), heap.positions[h, :60][plan.keep_indices[h]])[:8] for h in range(2)])
    heap.apply(plan)
    heap.append(4)
    assert heap.repacked_at == 60
    heap.merge(gone)   # evicted tokens recalled among the resident ones: the slots move
    assert heap.repacked_at == heap.seen == 64
    with pytest.raises(ValueError):
        heap.truncate(62)
    heap.append(3)
    heap.apply(heap.release_plan(), evicting=False)
    assert heap.repacked_at == 67 and heap.evictions == 1
