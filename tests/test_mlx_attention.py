"""Both ways of scoring: attention probabilities reused (explicit == fused) and the side pass."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from localheap.backends.mlx import attention, make_heap_cache
from localheap.backends.mlx.generate import prefill
from localheap.heap import HeapConfig


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("hq,h,L,T,D", [(8, 2, 1, 1, 64), (8, 2, 1, 513, 64), (4, 4, 9, 40, 128),
                                        (8, 1, 33, 700, 16), (6, 3, 1, 99, 80)])
def test_explicit_attention_is_bit_identical_to_fused_here(dtype, hq, h, L, T, D):
    if not attention.explicit_matches_stock(dtype, str(mx.default_device())):
        pytest.skip("this device's fused attention differs from the explicit form: side pass is used")
    dt = getattr(mx, dtype)
    q = mx.random.normal((1, hq, L, D)).astype(dt)
    k = mx.random.normal((1, h, T, D)).astype(dt)
    v = mx.random.normal((1, h, T, D)).astype(dt)
    mask = "causal" if L > 1 else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
    got, probs = attention.explicit_attention(q, k, v, D ** -0.5, mask)
    assert mx.array_equal(want, got).item()
    assert probs.shape == (1, h, hq // h, L, T)
    assert np.allclose(np.array(probs.astype(mx.float32).sum(-1)), 1.0, atol=1e-2)


def test_cpu_backend_reuses_attention_probabilities():
    if mx.default_device() != mx.cpu:
        pytest.skip("statement about the CPU backend")
    assert attention.explicit_matches_stock("float32", str(mx.default_device()))


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_side_pass_scores_equal_reused_probabilities(model_dirs, monkeypatch, policy):
    model, tokenizer = load(str(model_dirs("llama")))
    tokens = tokenizer.encode(" ".join(f"word{i}" for i in range(400)))[:300]
    cfg = HeapConfig(budget=96, sinks=4, recent=16, slack=32, policy=policy, h2o_normalize=True)

    def run():
        cache = make_heap_cache(model, cfg)
        prefill(model, cache, tokens, chunk=32)
        for _ in range(5):   # a few decode-shaped steps too
            cache.make_room(1)
            model(mx.array([[7]]), cache=cache)
        arrays = [np.array(a) for a in cache.score_arrays()]
        return arrays, [c.heap.view_positions() for c in cache.heap_layers]

    fused, fused_pos = run()
    monkeypatch.setattr(attention, "explicit_matches_stock", lambda *a: False)
    side, side_pos = run()
    assert all((a == b).all() for a, b in zip(fused_pos, side_pos)), "same survivors"
    for a, b in zip(fused, side):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5)
