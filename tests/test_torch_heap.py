"""Torch heap invariants: re-rotation, positions, bounded memory, policies under eviction, persistence."""

import sys

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from heap_checks import assert_stream_invariants

from localheap.backends.torch import HeapLayer, TorchBackend
from localheap.backends.torch.generate import generate_steps, generate_tokens, prefill
from localheap.backends.torch.rope import TABLE_LIMIT, RopeSpec, UnsupportedRope
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


@pytest.mark.parametrize("base,D,R,interleaved", [(10000.0, 32, 32, False), (500000.0, 64, 64, False),
                                                   (1e6, 128, 128, False), (10000.0, 96, 72, False),
                                                   (10000.0, 128, 64, True)])
def test_the_table_rotation_is_the_rotation_bit_for_bit(base, D, R, interleaved):
    """shift_back (cached cos/sin of whole shifts: eviction's re-rotation and the page-out's
    un-rotation of slot-rotated keys) gives rotate's bits for every shift it is asked for: whole
    heads in split halves, phi3's 3/4 of a head, glm4's half of one in interleaved pairs."""
    rope = RopeSpec(1.0 / base ** (torch.arange(0, R, 2, dtype=torch.float32) / R), D, interleaved)
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
    # the dims past R pass through untouched; the rotated ones move
    moved = rope.rotate(x, shifts)
    assert torch.equal(moved[..., R:], x[..., R:]) and not torch.equal(moved[..., :R], x[..., :R])


def model_rotation(model):
    """x [1, H, n, D] rotated at positions [n] by the model's own rotary module and
    apply_rotary_pos_emb (its layout and partial rotary included)."""
    apply = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def rotate_at(x, positions):
        cos, sin = model.model.rotary_emb(x, torch.as_tensor(positions)[None])
        return apply(x, x, cos, sin)[1]

    return rotate_at


@pytest.mark.parametrize("family", ["phi3", "glm4", "glm4_moe"])
def test_the_rotary_layout_is_read_from_the_model(model_dirs, family):
    """phi3 rotates 3/4 of a head in split halves, glm4 half of one in interleaved pairs, glm4_moe
    half of one in split halves: the spec says so, and rotating by a delta is the model's own
    rotation by it."""
    model = load_fp32(model_dirs(family)).model
    D = model.config.head_dim
    rope = RopeSpec.from_model(model, "full_attention", D)
    assert (rope.rotary_dims, rope.interleaved, rope.standard) == \
        ({"phi3": 3 * D // 4, "glm4": D // 2, "glm4_moe": D // 2}[family], family == "glm4", False)
    x = torch.randn(1, 2, 5, D, generator=torch.Generator().manual_seed(0))
    rotate_at = model_rotation(model)
    torch.testing.assert_close(rope.rotate(x, torch.arange(7, 12)), rotate_at(x, list(range(7, 12))),
                               atol=1e-5, rtol=1e-5)


def test_a_rotation_that_changes_with_the_length_is_refused_before_any_request(model_dirs, capsys):
    """transformers' longrope (Phi-4-mini's) picks its factors by the length: no key can move, so a
    heap that would move one is refused by check_heap (serve runs it before taking requests) with
    the flags that work, and a heap that moves none runs."""
    from localheap.cli import main

    LONGROPE = {"rope_type": "longrope", "type": "longrope", "original_max_position_embeddings": 256,
                "short_factor": [1.0] * 6, "long_factor": [1.0 + i / 3 for i in range(6)]}
    path = model_dirs("phi3", rope_scaling=LONGROPE)
    backend = load_fp32(path)
    moving = (HeapConfig(budget=64, recent=8),
              HeapConfig(budget=64, recent=8, positions="absolute", recall=True, page_size=8, recall_budget=16),
              HeapConfig(budget=64, recent=8, positions="absolute", policy="geometry"))
    for cfg in moving:
        with pytest.raises(UnsupportedRope, match="--positions absolute --recall off"):
            backend.check_heap(cfg)
    cfg = HeapConfig(budget=64, slack=16, recent=8, positions="absolute")
    backend.check_heap(cfg)
    cache = backend.new_cache(cfg)
    assert len(list(backend.generate(cache, long_prompt(backend.tokenizer, 200), SamplingParams(max_tokens=4)))) == 4
    assert cache.stats().evicted > 0
    assert main(["serve", "--model", str(path), "--backend", "torch", "--no-persist", "--port", "1"]) == 2
    assert "longrope RoPE depends on the sequence length" in capsys.readouterr().err


def test_a_rotary_layout_it_cannot_tell_is_refused(model_dirs, monkeypatch):
    """A model whose apply_rotary_pos_emb matches neither layout is refused, not guessed."""
    model = load_fp32(model_dirs("llama")).model
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    monkeypatch.setattr(module, "apply_rotary_pos_emb", lambda q, k, cos, sin: (q.flip(-1), k.flip(-1)))
    with pytest.raises(UnsupportedRope, match="rotary layout"):
        RopeSpec.from_model(model, "full_attention", model.config.head_dim)


@pytest.mark.parametrize("family,rope_name", [("llama", r) for r in ROPES] + [("phi3", "default"), ("glm4", "default")])
def test_compact_repack_equals_fresh_rotation(model_dirs, family, rope_name):
    """After repacks, every cached key equals its raw key rotated at its new slot by the model's own RoPE."""
    kwargs = {"rope_scaling": ROPES[rope_name]} if ROPES[rope_name] else {}
    model = load_fp32(model_dirs(family, **kwargs)).model
    D, H, T = model.config.head_dim, 2, 200
    cfg = HeapConfig(budget=40, sinks=4, recent=8, slack=16, policy="random", positions="compact")
    layer = HeapLayer(LayerHeap(cfg, H, cfg.budget), D, torch.float32, torch.device("cpu"),
                      RopeSpec.from_model(model, "full_attention", D))
    gen = torch.Generator().manual_seed(1)
    raw, values = torch.randn(1, H, T, D, generator=gen), torch.randn(1, H, T, D, generator=gen)
    rotate_at = model_rotation(model)

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


@pytest.mark.parametrize("family,profile", [("llama", "pyramid"), ("gemma3_text", "uniform"), ("phi3", "pyramid"),
                                            ("glm4", "pyramid")])
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
