"""LogprobRecorder.post (llama-server's post_sampling_probs) on both backends' samplers: each
entry is the distribution the token was drawn from (top-k's k ids at the temperature, Mirostat's
and adaptive-p's own, greedy's one id at probability 1), ids of probability 0 left out, and
recording it draws the same tokens as recording the model's own logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from localheap.backends.torch.generate import Sampler
from localheap.generation import LogprobRecorder, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _rows(n=12, vocab=50, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.0, (n, vocab)).astype(np.float32)


def _run(params_kw: dict, rows: np.ndarray, post: bool, backend: str):
    recorder = LogprobRecorder(8, post=post)
    params = SamplingParams(logprobs=recorder, **params_kw)
    if backend == "torch":
        sampler = Sampler(params, torch.device("cpu"))
        tokens = [int(sampler.sample(torch.from_numpy(r))) for r in rows]
    else:
        mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
        from localheap.backends.mlx.generate import Sampler as MLXSampler

        mx.random.seed(7)
        sample = MLXSampler(params)
        tokens = [int(sample(mx.array(r[None])).item()) for r in rows]
    return tokens, [recorder.get(i) for i in range(len(tokens))]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_top_k_at_a_temperature_is_the_softmax_of_the_k_scaled_logits(backend):
    rows = _rows()
    kw = {"temperature": 0.6, "top_k": 5, "seed": 3}
    tokens, entries = _run(kw, rows, True, backend)
    assert tokens == _run(kw, rows, False, backend)[0], "recording the chain's distribution draws the same tokens"
    for row, token, e in zip(rows, tokens, entries):
        top5 = np.argsort(-row)[:5]
        z = row[top5] / 0.6
        want = dict(zip(top5.tolist(), (z - z.max() - np.log(np.exp(z - z.max()).sum())).tolist()))
        assert e.token == token and {i for i, _ in e.top} == set(want)
        for i, lp in e.top:
            assert lp == pytest.approx(want[i], abs=1e-4)
        assert e.logprob == pytest.approx(want[token], abs=1e-4)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("kw", [{"temperature": 1.0, "mirostat": 2, "mirostat_tau": 2.0},
                                {"temperature": 1.0, "top_k": 10, "adaptive_target": 0.1},
                                {"temperature": 0.9, "min_p": 0.2, "top_p": 0.9}])
def test_each_draws_distribution_sums_to_one_and_holds_the_token(backend, kw):
    rows = _rows(seed=1)
    tokens, entries = _run({**kw, "seed": 4}, rows, True, backend)
    assert tokens == _run({**kw, "seed": 4}, rows, False, backend)[0]
    for token, e in zip(tokens, entries):
        ids = [i for i, _ in e.top]
        assert token in ids and all(lp > -math.inf for _, lp in e.top)
        if len(ids) < 8:   # (the whole distribution is listed)
            assert sum(math.exp(lp) for _, lp in e.top) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_greedy_is_the_one_id_at_probability_one(backend):
    rows = _rows(seed=2)
    tokens, entries = _run({"temperature": 0.0}, rows, True, backend)
    assert tokens == np.argmax(rows, axis=1).tolist()
    assert all(e.logprob == 0.0 and e.top == [(t, 0.0)] for t, e in zip(tokens, entries))
