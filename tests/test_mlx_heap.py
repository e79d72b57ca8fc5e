"""MLX heap invariants: re-rotation, bounded memory, policies under eviction, persistence."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.rope_utils import initialize_rope

from heap_checks import assert_stream_invariants

from localheap.backends.mlx import HeapKVCache, make_heap_cache
from localheap.backends.mlx.generate import generate_tokens, prefill
from localheap.backends.mlx.persist import load_heap, save_heap
from localheap.backends.mlx.rope import RopeSpec
from localheap.generation import SamplingParams
from localheap.heap import POLICIES, HeapConfig, LayerHeap, SlotView

ROPES = {
    "default": dict(traditional=False, scaling_config=None),
    "traditional": dict(traditional=True, scaling_config=None),
    "llama3": dict(traditional=False, scaling_config={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "yarn": dict(traditional=False, scaling_config={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}),
    # part of each head rotated, the rest passed through: phi3 (3/4, split halves), glm4 (1/2, interleaved)
    "partial": dict(traditional=False, scaling_config=None, dims=24),
    "partial-traditional": dict(traditional=True, scaling_config=None, dims=16),
    # Phi-4-mini's: longrope (mlx-lm's SuScaledRoPE, its long factors at every length, and an input
    # scale applied once when a key is first rotated) on 3/4 of each head
    "longrope-partial": dict(traditional=False, dims=24, scaling_config={
        "rope_type": "longrope", "original_max_position_embeddings": 64,
        "short_factor": [1.0 + i / 12 for i in range(12)], "long_factor": [1.0 + i / 4 for i in range(12)]}),
}


@pytest.mark.parametrize("rope_name", list(ROPES))
def test_compact_repack_equals_fresh_rotation(rope_name):
    """After repacks, every cached key equals its raw key rotated at its new slot."""
    D, H, T = 32, 2, 200
    spec = ROPES[rope_name]
    rope = initialize_rope(spec.get("dims", D), 10000.0, spec["traditional"], spec["scaling_config"], 4096)
    cfg = HeapConfig(budget=40, sinks=4, recent=8, slack=16, policy="random", positions="compact")
    cache = HeapKVCache(LayerHeap(cfg, H, cfg.budget), RopeSpec.from_module(rope))
    raw = mx.random.normal((1, H, T, D), key=mx.random.key(1))
    values = mx.random.normal((1, H, T, D), key=mx.random.key(2))

    def rotate_at(x, pos):   # the model's own rope module, one token at a time
        return rope(x, offset=pos)

    done = 0
    while done < T:
        n = min(16, T - done)
        if cache.heap.needs_repack(n):
            cache.repack(cache.heap.plan(SlotView(positions=cache.heap.view_positions())))
        off = cache.offset
        chunk = mx.concatenate([rotate_at(raw[:, :, done + i:done + i + 1], off + i) for i in range(n)], axis=2)
        cache.update_and_fetch(chunk, values[:, :, done:done + n])
        done += n
    assert cache.heap.evictions > 3
    positions = cache.heap.view_positions()
    keys = cache.keys[0, :, : cache.heap.resident]
    vals = cache.values[0, :, : cache.heap.resident]
    for h in range(H):
        for slot, p in enumerate(positions[h]):
            fresh = rotate_at(raw[:, h:h + 1, int(p):int(p) + 1], slot)[0, 0, 0]
            assert mx.allclose(keys[h, slot], fresh, atol=1e-4, rtol=1e-4).item(), (h, slot, p)
            assert mx.array_equal(vals[h, slot], values[0, h, int(p)]).item()


@pytest.fixture(scope="module")
def llama(model_dirs):
    return load(str(model_dirs("llama")))


def long_prompt(tokenizer, n):
    text = " ".join(f"fact {i}: the code word for room {i} is blue{i}." for i in range(n // 4))
    return tokenizer.encode(text)[:n]


@pytest.mark.parametrize("positions", ["compact", "absolute"])
@pytest.mark.parametrize("policy", POLICIES)
def test_policies_stay_bounded_and_keep_sinks(llama, policy, positions):
    model, tokenizer = llama
    cfg = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy=policy, positions=positions,
                     h2o_normalize=(policy == "h2o"))
    cache = make_heap_cache(model, cfg)
    prompt = long_prompt(tokenizer, 400)
    out = list(generate_tokens(model, cache, prompt, SamplingParams(max_tokens=40)))
    assert len(out) == 40 and all(0 <= t < model.args.vocab_size for t in out)
    stats = cache.stats()
    assert stats.tokens_seen == 400 + 39
    assert_stream_invariants(cache.heap_layers, cfg, min_evictions=10)


def test_h2o_keeps_what_attention_favours(llama):
    """The side pass must rank heavily attended slots above ignored ones."""
    model, tokenizer = llama
    cfg = HeapConfig(budget=64, sinks=4, recent=8, slack=32, policy="h2o")
    cache = make_heap_cache(model, cfg)
    prefill(model, cache, long_prompt(tokenizer, 96), chunk=32)
    c = cache.heap_layers[0]
    scores = np.array(c.scores[:, : c.heap.resident])
    assert scores.shape == (c.heap.n_kv_heads, c.heap.resident)
    assert np.all(scores >= 0) and scores.sum() > 0
    # mass sums to queries x group heads observed (each softmax row sums to 1)
    G = model.args.num_attention_heads // model.args.num_key_value_heads
    observed = 3 * min(cfg.obs_window, 32)   # 3 chunks of 32, each scoring its last queries
    assert np.allclose(scores.sum(axis=1), observed * G, rtol=1e-3)


def test_kv_memory_does_not_grow(llama):
    model, tokenizer = llama
    cfg = HeapConfig(budget=64, sinks=4, recent=8, slack=32)
    cache = make_heap_cache(model, cfg)
    tokens = long_prompt(tokenizer, 3000)
    prefill(model, cache, tokens[:500], chunk=32)
    mx.clear_cache()
    nbytes, active = cache.nbytes, mx.get_active_memory()
    prefill(model, cache, tokens[500:], chunk=32)
    mx.clear_cache()
    assert cache.tokens_seen == 3000
    assert cache.nbytes == nbytes, "buffers are allocated once"
    assert mx.get_active_memory() <= active + 64 * 1024, "no growth beyond noise"
    assert cache.stats().resident <= cfg.layer_capacity(cfg.budget)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "geometry"])
def test_save_and_load_is_bit_identical(llama, tmp_path, policy):
    model, tokenizer = llama
    cfg = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy=policy, h2o_normalize=True)
    cache = make_heap_cache(model, cfg)
    prompt = long_prompt(tokenizer, 300)
    prefill(model, cache, prompt[:-1], chunk=16)
    save_heap(cache, tmp_path / "s.safetensors")
    restored = load_heap(model, tmp_path / "s.safetensors")
    for a, b in zip(cache.heap_layers, restored.heap_layers):
        assert (a.heap.view_positions() == b.heap.view_positions()).all()
        assert (a.heap.seen, a.heap.evicted) == (b.heap.seen, b.heap.evicted)
        n = a.heap.resident
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
    params = SamplingParams(max_tokens=60)
    assert list(generate_tokens(model, restored, prompt[-1:], params)) == \
        list(generate_tokens(model, cache, prompt[-1:], params))


def test_gemma3_sliding_layers_keep_their_own_cache(model_dirs):
    model, tokenizer = load(str(model_dirs("gemma3_text")))
    cache = make_heap_cache(model, HeapConfig(budget=48, sinks=4, recent=8, slack=16))
    assert 0 < len(cache.heap_layers) < len(cache)
    out = list(generate_tokens(model, cache, long_prompt(tokenizer, 200), SamplingParams(max_tokens=10)))
    assert len(out) == 10 and cache.stats().evicted > 0


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_a_sliding_window_model_saves_and_loads_bit_identical(model_dirs, tmp_path, family):
    """A sliding layer keeps mlx-lm's RotatingKVCache, whose offset, keep, max size and index are
    in its `state` as numbers in mlx-lm 0.32 (no meta_state): saving one failed, so no session of
    gemma3 or gpt-oss was ever saved, checkpointed, forked or spilled on MLX."""
    from mlx_lm.models.cache import RotatingKVCache

    from localheap.backends.mlx.loading import load as load_model   # (gpt-oss's experts: the server's loader)

    model, tokenizer = load_model(str(model_dirs(family)))
    cache = make_heap_cache(model, HeapConfig(budget=48, sinks=4, recent=8, slack=16))
    prompt = long_prompt(tokenizer, 200)
    prefill(model, cache, prompt[:-1], chunk=16)
    save_heap(cache, tmp_path / "s.safetensors")
    restored = load_heap(model, tmp_path / "s.safetensors")
    sliding = [(a, b) for a, b in zip(cache, restored) if isinstance(a, RotatingKVCache)]
    assert sliding and cache.stats().evicted > 0
    for a, b in sliding:
        assert isinstance(b, RotatingKVCache) and (a.offset, a.keep, a.max_size, a._idx) == (b.offset, b.keep,
                                                                                              b.max_size, b._idx)
        assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
    params = SamplingParams(max_tokens=20)
    assert list(generate_tokens(model, restored, prompt[-1:], params)) == \
        list(generate_tokens(model, cache, prompt[-1:], params))
