"""Torch heap invariants: re-rotation, positions, bounded memory, policies under eviction, persistence."""

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from heap_checks import assert_stream_invariants

from localheap.backends.torch import HeapLayer, TorchBackend
from localheap.backends.torch.generate import generate_steps, generate_tokens, prefill
from localheap.backends.torch.rope import TABLE_LIMIT, RopeSpec
from localheap.generation import SamplingParams
from localheap.heap import POLICIES, HeapConfig, HeapConfigError, LayerHeap, SlotView

ROPES = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "beta_fast": 32, "beta_slow": 1},
}


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def load_fp32(path, **kwargs):
    """float32 on the default device (CUDA when present): the tolerances below are fp32's."""
    return TorchBackend.load(path, dtype=torch.float32, **kwargs)


@pytest.fixture(scope="module")
def llama(model_dirs):
    return load_fp32(model_dirs("llama"))


def long_prompt(tokenizer, n):
    text = " ".join(f"fact {i}: the code word for room {i} is blue{i}." for i in range(n // 4))
    return tokenizer.encode(text)[:n]


@pytest.mark.parametrize("base,D", [(10000.0, 32), (500000.0, 64), (1e6, 128)])
def test_the_table_rotation_is_the_rotation_bit_for_bit(base, D):
    """shift_back (cached cos/sin of whole shifts: eviction's re-rotation and the page-out's
    un-rotation of slot-rotated keys) gives rotate's bits for every shift it is asked for."""
    rope = RopeSpec(1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    n = 8192
    x = torch.randn(2, n, D, generator=torch.Generator().manual_seed(3))
    shifts = torch.stack([torch.arange(n), torch.randperm(n, generator=torch.Generator().manual_seed(4))])
    assert torch.equal(rope.shift_back(x, shifts, n), rope.rotate(x, -shifts))
    # rotate_ahead (a recall's merge: whole deltas >= 0) from the same table, also in float16
    assert torch.equal(rope.rotate_ahead(x, shifts.numpy()), rope.rotate(x, shifts.numpy()))
    assert torch.equal(rope.rotate_ahead(x.half(), shifts), rope.rotate(x.half(), shifts))
    # past the table's limit, or a negative delta: rotate itself
    far = shifts + TABLE_LIMIT
    assert torch.equal(rope.rotate_ahead(x, far), rope.rotate(x, far))
    assert torch.equal(rope.rotate_ahead(x, shifts - 5), rope.rotate(x, shifts - 5))


@pytest.mark.parametrize("rope_name", list(ROPES))
def test_compact_repack_equals_fresh_rotation(model_dirs, rope_name):
    """After repacks, every cached key equals its raw key rotated at its new slot by the model's own RoPE."""
    kwargs = {"rope_scaling": ROPES[rope_name]} if ROPES[rope_name] else {}
    model = load_fp32(model_dirs("llama", **kwargs)).model
    rotary = model.model.rotary_emb
    D, H, T = model.config.head_dim, 2, 200
    cfg = HeapConfig(budget=40, sinks=4, recent=8, slack=16, policy="random", positions="compact")
    layer = HeapLayer(LayerHeap(cfg, H, cfg.budget), D, torch.float32, torch.device("cpu"),
                      RopeSpec.from_model(model, "full_attention", D))
    gen = torch.Generator().manual_seed(1)
    raw, values = torch.randn(1, H, T, D, generator=gen), torch.randn(1, H, T, D, generator=gen)

    def rotate_at(x, positions):   # x: [1, H, n, D] rotated at positions [n], as the model does it
        cos, sin = rotary(x, torch.as_tensor(positions)[None])
        return apply_rotary_pos_emb(x, x, cos, sin)[1]

    done = 0
    while done < T:
        n = min(16, T - done)
        if layer.heap.needs_repack(n):
            layer.repack(layer.heap.plan(SlotView(positions=layer.heap.view_positions())))
        off = layer.heap.rope_offset()
        layer.update(rotate_at(raw[:, :, done:done + n], list(range(off, off + n))), values[:, :, done:done + n])
        done += n
    assert layer.heap.evictions > 3
    positions = layer.heap.view_positions()
    for h in range(H):
        for slot, p in enumerate(positions[h]):
            fresh = rotate_at(raw[:, h:h + 1, p:p + 1], [slot])[0, 0, 0]
            torch.testing.assert_close(layer.keys[0, h, slot], fresh, atol=1e-4, rtol=1e-4)
            assert torch.equal(layer.values[0, h, slot], values[0, h, p])


@pytest.mark.parametrize("positions", ["compact", "absolute"])
@pytest.mark.parametrize("policy", POLICIES)
def test_policies_stay_bounded_and_keep_sinks(llama, policy, positions):
    cfg = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy=policy, positions=positions,
                     h2o_normalize=(policy == "h2o"))
    cache = llama.new_cache(cfg)
    out = list(llama.generate(cache, long_prompt(llama.tokenizer, 400), SamplingParams(max_tokens=40)))
    assert len(out) == 40 and all(0 <= t < llama.model.config.vocab_size for t in out)
    assert llama.tokens_in_cache(cache) == 400 + 39
    assert_stream_invariants(cache.heap_layers, cfg, min_evictions=10)


@pytest.mark.parametrize("family,profile", [("llama", "pyramid"), ("gemma3_text", "uniform")])
def test_compact_equals_absolute_when_the_shift_is_uniform(model_dirs, family, profile):
    """Without sinks, streaming keeps a contiguous window: compact positions are the absolute ones
    minus a constant, and RoPE attention only sees differences. Logits must then agree, which
    checks re-rotation, per-layer offsets (pyramid) and gemma3's sliding layers kept at absolute positions."""
    backend = load_fp32(model_dirs(family))
    prompt = np.random.default_rng(0).integers(10, 1000, 300).tolist()
    logits, shifted = {}, []
    for positions in ("compact", "absolute"):
        cfg = HeapConfig(budget=48, sinks=0, recent=8, slack=16, policy="streaming", positions=positions,
                         profile=profile)
        cache = backend.new_cache(cfg)
        steps = []
        for _, lg in generate_steps(backend.model, cache, prompt, SamplingParams(max_tokens=60)):
            steps.append(lg)
            shifted.append(any(layer.rope_delta for layer in cache.layers))
        logits[positions] = torch.stack(steps)
        assert cache.stats().evictions > 10
    assert any(shifted), "some layer must run off the model-wide positions"
    assert logits["compact"].std() > 0.1
    torch.testing.assert_close(logits["compact"], logits["absolute"], atol=1e-4, rtol=1e-4)


def test_h2o_side_pass_sums_to_observed_queries(llama):
    cfg = HeapConfig(budget=64, sinks=4, recent=8, slack=32, policy="h2o")
    cache = llama.new_cache(cfg)
    prefill(llama.model, cache, long_prompt(llama.tokenizer, 96))
    layer = cache.heap_layers[0]
    scores = layer.scores[:, : layer.heap.resident]
    assert scores.shape == (layer.heap.n_kv_heads, 96) and (scores >= 0).all()
    G = llama.model.config.num_attention_heads // llama.model.config.num_key_value_heads
    observed = 3 * min(cfg.obs_window, 32)   # 3 chunks of 32, each scoring its last queries
    torch.testing.assert_close(scores.sum(dim=1), torch.full((layer.heap.n_kv_heads,), observed * G * 1.0,
                                                             device=scores.device),
                               rtol=1e-4, atol=1e-3)
    assert (scores[:, 90:] > 0).all() and scores[:, :4].mean() > 0   # every observed slot got mass


def test_kv_memory_does_not_grow(llama):
    cfg = HeapConfig(budget=64, sinks=4, recent=8, slack=32, policy="h2o")   # h2o: a score buffer too
    cache = llama.new_cache(cfg)
    tokens = long_prompt(llama.tokenizer, 3000)
    prefill(llama.model, cache, tokens[:500])
    buffers = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.scores.data_ptr()) for layer in cache.heap_layers]
    nbytes = cache.nbytes
    prefill(llama.model, cache, tokens[500:])
    assert cache.tokens_seen == 3000
    assert cache.nbytes == nbytes == llama.heap_bytes(cfg), "buffers are allocated once"
    assert buffers == [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.scores.data_ptr())
                       for layer in cache.heap_layers], "written in place, never reallocated"
    assert cache.stats().resident <= cfg.layer_capacity(cfg.budget)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for allocator figures")
def test_cuda_allocated_bytes_constant(model_dirs):
    backend = load_fp32(model_dirs("llama"), device="cuda")
    cfg = HeapConfig(budget=64, sinks=4, recent=8, slack=32)
    cache = backend.new_cache(cfg)
    tokens = long_prompt(backend.tokenizer, 3000)
    prefill(backend.model, cache, tokens[:500])
    torch.cuda.synchronize()
    before = backend.memory()["active"]
    prefill(backend.model, cache, tokens[500:])
    torch.cuda.synchronize()
    # 2,500 more tokens through a full heap: nothing grows (an H200 run ended 8 KiB below, a
    # temporary of the first chunks freed); one KV row kept per token would add megabytes
    assert backend.memory()["active"] <= before


@pytest.mark.parametrize("family,policy", [("llama", "h2o"), ("llama", "snapkv"), ("llama", "geometry"),
                                           ("gemma3_text", "h2o")])
def test_save_and_load_is_bit_identical(model_dirs, tmp_path, family, policy):
    backend = load_fp32(model_dirs(family))
    cfg = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy=policy, h2o_normalize=True)
    cache = backend.new_cache(cfg)
    prompt = long_prompt(backend.tokenizer, 300)
    backend.prefill(cache, prompt[:-1])
    backend.save_cache(cache, tmp_path / "s.safetensors")
    restored = backend.load_cache(cfg, tmp_path / "s.safetensors")
    for a, b in zip(cache.layers, restored.layers):
        assert type(a) is type(b)
        n = a.heap.resident if isinstance(a, HeapLayer) else a.keys.shape[2]
        assert torch.equal(a.keys[:, :, :n], b.keys[:, :, :n]) and torch.equal(a.values[:, :, :n], b.values[:, :, :n])
        if isinstance(a, HeapLayer):
            assert (a.heap.view_positions() == b.heap.view_positions()).all()
            assert (a.heap.seen, a.heap.evicted, a.heap.evictions) == (b.heap.seen, b.heap.evicted, b.heap.evictions)
            for name in ("scores", "window", "counts"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None and y is None) or torch.equal(x[:, :n], y[:, :n]), name
            assert (a.qsum is None and b.qsum is None) or torch.equal(a.qsum, b.qsum)
        else:
            assert a.cumulative_length == b.cumulative_length
    params = SamplingParams(max_tokens=60)
    assert list(generate_tokens(backend.model, restored, prompt[-1:], params)) == \
        list(generate_tokens(backend.model, cache, prompt[-1:], params))


def test_gemma3_sliding_layers_keep_transformers_cache(model_dirs):
    backend = load_fp32(model_dirs("gemma3_text"))
    cache = backend.new_cache(HeapConfig(budget=48, sinks=4, recent=8, slack=16))
    assert 0 < len(cache.heap_layers) < len(cache.layers)
    sliding = [layer for layer in cache.layers if not isinstance(layer, HeapLayer)]
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in sliding)
    out = list(backend.generate(cache, long_prompt(backend.tokenizer, 200), SamplingParams(max_tokens=10)))
    assert len(out) == 10 and cache.stats().evicted > 0
    assert all(layer.keys.shape[2] < layer.sliding_window for layer in sliding)


def test_chunks_larger_than_the_slack_are_refused(llama):
    cache = llama.new_cache(HeapConfig(budget=64, sinks=4, recent=8, slack=16))
    with pytest.raises(HeapConfigError):
        cache.make_room(17)


def test_fused_decode_matches_stock_path_closely(model_dirs):
    """The opt-in fused decode (kernel output instead of stock sdpa) agrees to float rounding."""
    prompt = np.random.default_rng(0).integers(10, 1000, 200).tolist()
    runs = {}
    for fused in (False, True):
        backend = load_fp32(model_dirs("qwen2"), fused_decode=fused)
        cache = backend.new_cache(HeapConfig(budget=64, sinks=4, recent=8, slack=32))
        steps = list(generate_steps(backend.model, cache, prompt, SamplingParams(max_tokens=60)))
        runs[fused] = ([t for t, _ in steps], torch.stack([lg for _, lg in steps]), cache)
    assert runs[True][0] == runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=1e-4, rtol=1e-4)
    a, b = runs[False][2].heap_layers[0], runs[True][2].heap_layers[0]
    assert (a.heap.view_positions() == b.heap.view_positions()).all()
    torch.testing.assert_close(a.scores, b.scores, atol=1e-4, rtol=1e-4)


def test_backend_figures(llama):
    cfg = llama.model.config
    dtype_bytes = next(llama.model.parameters()).element_size()
    assert llama.kv_bytes_per_token() == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    assert llama.weights_bytes == sum(p.nbytes for p in llama.model.parameters())
    assert llama.tokenizer.eos_token_id in llama.eos_token_ids
    mem = llama.memory()   # CUDA: allocator figures; CPU: the process's RSS
    assert mem["active"] >= llama.weights_bytes and mem["peak"] >= mem["active"] * 0.5
    stats = llama.stats(llama.new_cache(HeapConfig(budget=64, sinks=4, recent=8, slack=16)))
    assert stats.tokens_seen == 0 and stats.capacity == 4 + 64 + 16
