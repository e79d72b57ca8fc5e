"""With a budget at least as large as the context, the heap gives exactly mlx-lm's tokens."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from localheap.backends.mlx import make_heap_cache
from localheap.backends.mlx.loading import load   # mlx_lm.load, plus gpt-oss as transformers saves it
from localheap.backends.mlx.generate import generate_steps, generate_tokens
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma", "gemma3_text", "gpt_oss", "phi3", "glm4",
            "glm4_moe"]
SLACK = 64


def stock_steps(model, prompt, n):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0),
                          prefill_step_size=SLACK, prompt_cache=make_prompt_cache(model))
    return [(int(t), np.array(lp)) for t, lp in steps]


def heap_steps(model, cache, prompt, n):
    return [(t, np.array(lp)) for t, lp in generate_steps(model, cache, prompt, SamplingParams(max_tokens=n))]


def assert_same_steps(got, expected):
    """Same tokens and bit-identical logprobs at every step (strong even if tokens repeat)."""
    assert [t for t, _ in got] == [t for t, _ in expected]
    for i, ((_, a), (_, b)) in enumerate(zip(got, expected)):
        assert np.array_equal(a, b), f"logprobs differ at step {i}: max {np.abs(a - b).max()}"
    assert np.ptp(expected[0][1]) > 0.1, "flat logits would make this test weak"


def prompt_ids(tokenizer, n_tokens=300):
    text = " ".join(f"the heap keeps token {i} while the window moves" for i in range(200))
    ids = tokenizer.encode(text)
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


@pytest.mark.parametrize("positions", ["compact", "absolute"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_stock(model_dirs, family, positions):
    model, tokenizer = load(str(model_dirs(family)))
    prompt = prompt_ids(tokenizer)
    expected = stock_steps(model, prompt, 256)
    cache = make_heap_cache(model, HeapConfig(budget=1024, slack=SLACK, recent=64, positions=positions))
    assert_same_steps(heap_steps(model, cache, prompt, 256), expected)
    assert cache.stats().evicted == 0


# Phi-4-mini's rope scaling on the tiny phi3 (6 frequency pairs: 3/4 of a 16-dim head)
LONGROPE = {"rope_type": "longrope", "type": "longrope", "original_max_position_embeddings": 256,
            "short_factor": [1.0] * 6, "long_factor": [1.0 + i / 3 for i in range(6)]}


@pytest.mark.parametrize("rope", ["llama3", "traditional", "longrope"])
def test_greedy_matches_stock_rope_variants(model_dirs, rope):
    kwargs = {"llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
              "traditional": {"rope_traditional": True}, "longrope": {"rope_scaling": LONGROPE}}[rope]
    model, tokenizer = load(str(model_dirs("phi3" if rope == "longrope" else "llama", **kwargs)))
    prompt = prompt_ids(tokenizer)
    expected = stock_steps(model, prompt, 256)
    cache = make_heap_cache(model, HeapConfig(budget=1024, slack=SLACK, recent=64))
    assert_same_steps(heap_steps(model, cache, prompt, 256), expected)


def test_sampling_is_seeded(model_dirs):
    model, tokenizer = load(str(model_dirs("llama")))
    prompt = prompt_ids(tokenizer, 50)
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, top_k=50, seed=7)

    def run(p):
        cache = make_heap_cache(model, HeapConfig(budget=256, slack=SLACK, recent=32))
        return list(generate_tokens(model, cache, prompt, p))

    a, b = run(params), run(params)
    assert a == b
    assert run(SamplingParams(max_tokens=40, temperature=1.0, seed=8)) != a
