"""Mirostat 1 and 2 (SamplingParams.mirostatted; Ollama's and llama.cpp's options): what each keeps
for a given mu against llama.cpp's rules written out in numpy, mu moved by each draw's surprise,
the controller holding a long run's surprise near tau on both backends, and the routes taking it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from localheap.backends.torch.generate import Mirostat, Sampler
from localheap.generation import MIROSTAT_M, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _row(vocab=400, seed=0) -> np.ndarray:
    """A Zipf-like row (as language models give): log p ~ -1.1 log(rank), shuffled, with noise."""
    rng = np.random.default_rng(seed)
    x = -1.1 * np.log(np.arange(1, vocab + 1)) + rng.normal(0, 0.05, vocab)
    return rng.permutation(x).astype(np.float32)


def _reference_keep(row: np.ndarray, version: int, mu: float) -> set:
    logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
    if version == 2:
        keep = -logp / math.log(2) <= mu
    else:
        top = np.sort(logp)[::-1][:MIROSTAT_M].astype(np.float64)
        i = np.arange(len(top) - 1)
        t, b = np.log((i + 2) / (i + 1)), top[:-1] - top[1:]
        s_hat = (t * b).sum() / (t * t).sum()
        eps = s_hat - 1
        k = max(1, int((eps * 2 ** mu / (1 - len(row) ** (-eps))) ** (1 / s_hat)))
        keep = np.zeros(len(row), bool)
        keep[np.argsort(-logp)[:k]] = True
    keep[np.argmax(logp)] = True
    return set(np.nonzero(keep)[0].tolist())


def _mlx():
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
    from localheap.backends.mlx import generate

    return mx, generate


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("mu", [2.0, 5.0, 9.0])
def test_what_it_keeps_for_a_mu_is_llama_cpps(version, mu):
    params = SamplingParams(temperature=1.0, mirostat=version)
    row = _row(seed=version)
    want = _reference_keep(row, version, mu)
    assert 1 <= len(want) < len(row)
    m = Mirostat(params, torch.device("cpu"))
    m.mu = torch.tensor(mu)
    got = set(np.nonzero(m.keep(torch.from_numpy(row)[None])[0].numpy())[0].tolist())
    assert got == want
    try:
        mx, generate = _mlx()
    except pytest.skip.Exception:
        return
    mm = generate.Mirostat(params)
    mm.mu = mx.array(mu)
    assert set(np.nonzero(np.array(mm.keep(mx.array(row[None])))[0])[0].tolist()) == want


def test_mu_moves_by_each_draws_surprise():
    row = _row(seed=3)
    params = SamplingParams(temperature=0.8, mirostat=2, mirostat_tau=4.0, mirostat_eta=0.2, seed=1)
    sampler = Sampler(params, torch.device("cpu"))
    mu, scaled = 8.0, row / 0.8
    for _ in range(30):
        keep = _reference_keep(scaled, 2, mu)
        token = int(sampler.sample(torch.from_numpy(row)))
        assert token in keep
        kept = np.array(sorted(keep))
        logp = scaled[kept] - np.log(np.exp(scaled[kept] - scaled[kept].max()).sum()) - scaled[kept].max()
        mu -= 0.2 * (-logp[list(kept).index(token)] / math.log(2) - 4.0)
        assert float(sampler.mirostat.mu) == pytest.approx(mu, abs=1e-4)


@pytest.mark.parametrize("version", [1, 2])
def test_a_lower_tau_draws_less_surprising_tokens_on_both_backends(version):
    """The controller's effect: the mean surprise of the drawn tokens (under the row's own
    distribution) is lower at tau 3 than at tau 5, both under the row's entropy (plain sampling),
    and mu stays bounded, on torch and on MLX."""
    row = _row(seed=5)
    logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
    entropy = float(-(np.exp(logp) * logp).sum() / math.log(2))

    def run(make, tau) -> float:
        draw, mu = make(SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=tau, seed=2))
        bits = [-logp[draw()] / math.log(2) for _ in range(1200)]
        assert 0.0 < mu() < 4 * tau
        return float(np.mean(bits[200:]))

    def torch_make(params):
        sampler = Sampler(params, torch.device("cpu"))
        return (lambda: int(sampler.sample(torch.from_numpy(row)))), (lambda: float(sampler.mirostat.mu))

    makers = [torch_make]
    try:
        mx, generate = _mlx()

        def mlx_make(params):
            mx.random.seed(2)
            sample, x = generate.Sampler(params), mx.array(row[None])
            return (lambda: int(sample(x, x - mx.logsumexp(x, keepdims=True)).item())), \
                (lambda: float(sample.mirostat.mu.item()))
        makers.append(mlx_make)
    except pytest.skip.Exception:
        pass
    for make in makers:
        low, high = run(make, 3.0), run(make, 5.0)
        assert low < high - 0.5 and high < entropy - 0.3, (make.__name__, low, high, entropy)


def test_the_params_check_the_options_and_greedy_stays_greedy():
    for bad in ({"mirostat": 3}, {"mirostat_tau": 0.0}, {"mirostat_eta": 1.5}):
        with pytest.raises(ValueError, match="mirostat"):
            SamplingParams(**bad)
    assert not SamplingParams(mirostat=2).mirostatted   # temperature 0: greedy, as llama.cpp's
    row = _row(seed=6)
    sampler = Sampler(SamplingParams(mirostat=2), torch.device("cpu"))
    assert int(sampler.sample(torch.from_numpy(row))) == int(np.argmax(row))
