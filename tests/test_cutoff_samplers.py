"""typical_p, top_n_sigma and XTC (SamplingParams; llama-server's options, Ollama's typical_p):
what each keeps, on both backends, against its stock or written definition (transformers'
TypicalLogitsWarper, mlx-lm's apply_xtc, llama.cpp's top-n-sigma), seeded draws only ever from
what it keeps, and the server routes taking the options (a samplers list leaving them out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from localheap.backends.torch.generate import Sampler, top_n_sigma, xtc
from localheap.generation import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _rows(n=12, vocab=40, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, vocab)) * rng.uniform(0.5, 3.0, (n, 1))).astype(np.float32)
    x[::3, 5] = -np.inf   # some ids already cut
    return x


def _kept(scores) -> set:
    return set(np.nonzero(np.isfinite(np.asarray(scores).reshape(-1)))[0].tolist())


def _sigma_reference(row: np.ndarray, n: float) -> set:
    finite = row[np.isfinite(row)]
    floor = finite.max() - n * finite.std()
    return {i for i, v in enumerate(row) if np.isfinite(v) and v >= floor}


def _mlx():
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
    from localheap.backends.mlx import generate

    return mx, generate


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
def test_top_n_sigma_keeps_what_llama_cpp_keeps(n):
    for row in _rows():
        want = _sigma_reference(row, n)
        assert _kept(top_n_sigma(torch.from_numpy(row)[None], n)) == want
        assert 1 <= len(want) < np.isfinite(row).sum()
    try:
        mx, generate = _mlx()
    except pytest.skip.Exception:
        return
    for row in _rows():
        lp = mx.array(row[None]) - mx.logsumexp(mx.array(row[None]), keepdims=True)   # on logprobs alike
        assert _kept(np.array(generate.top_n_sigma(lp, n))) == _sigma_reference(row, n)


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9])
def test_typical_on_mlx_keeps_what_transformers_keeps(mass):
    mx, generate = _mlx()
    warp = TypicalLogitsWarper(mass)
    for row in _rows(seed=1):
        want = _kept(warp(None, torch.from_numpy(row)[None]).numpy())
        lp = mx.array(row[None]) - mx.logsumexp(mx.array(row[None]), keepdims=True)
        assert _kept(np.array(generate.typical(lp, mass))) == want
        assert 1 <= len(want) < np.isfinite(row).sum()


def test_xtc_on_torch_cuts_what_mlx_lms_cuts():
    rows = _rows(seed=2) * 2.0   # peaked: several ids pass the threshold in most rows
    cut_rows = 0
    for row in rows:
        t = torch.from_numpy(row)[None]
        kept = _kept(xtc(t, 1.0, 0.05).numpy())
        probs = torch.softmax(t, -1)[0].numpy()
        passing = [i for i, p in enumerate(probs) if p > 0.05]
        least = min(passing, key=lambda i: probs[i]) if passing else None
        assert kept == (_kept(row) - set(passing)) | ({least} if passing else set())
        assert _kept(xtc(t, 0.0, 0.05).numpy()) == _kept(row)   # never drawn: nothing cut
        cut_rows += len(passing) > 1
        try:
            mx, _ = _mlx()
        except pytest.skip.Exception:
            continue
        from mlx_lm.sample_utils import apply_xtc

        assert _kept(np.array(apply_xtc(mx.array(row[None]), 1.0, 0.05, []))) == kept
    assert cut_rows > 3


CASES = [{"typical_p": 0.4}, {"top_n_sigma": 1.0}, {"xtc_probability": 1.0, "xtc_threshold": 0.05}]


def _allowed(row: np.ndarray, case: dict) -> set:
    t = torch.from_numpy(row)[None]
    if "typical_p" in case:
        return _kept(TypicalLogitsWarper(case["typical_p"])(None, t).numpy())
    if "top_n_sigma" in case:
        return _sigma_reference(row, case["top_n_sigma"])
    return _kept(xtc(t, 1.0, case["xtc_threshold"]).numpy())


@pytest.mark.parametrize("case", CASES)
def test_seeded_draws_come_only_from_what_is_kept_on_both_backends(case):
    row = _rows(seed=3)[1] * 1.5
    allowed = _allowed(row, case)
    assert 1 < len(allowed) < np.isfinite(row).sum()
    params = SamplingParams(temperature=1.0, seed=4, **case)
    sampler = Sampler(params, torch.device("cpu"))
    drawn = {int(sampler.sample(torch.from_numpy(row))) for _ in range(300)}
    assert drawn <= allowed and len(drawn) > 1
    try:
        mx, generate = _mlx()
    except pytest.skip.Exception:
        return
    mx.random.seed(4)
    sample = generate.Sampler(params)
    x = mx.array(row[None])
    drawn = {int(sample(x, x - mx.logsumexp(x, keepdims=True)).item()) for _ in range(300)}
    assert drawn <= allowed and len(drawn) > 1


def test_the_params_check_the_options():
    for bad in ({"typical_p": 0.0}, {"typical_p": 1.5}, {"top_n_sigma": -1.0}, {"xtc_probability": 2.0},
                {"xtc_threshold": 0.7}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def _dyn_reference(row: np.ndarray, temperature: float, spread: float, exponent: float) -> float:
    finite = row[np.isfinite(row)].astype(np.float64)
    p = np.exp(finite - finite.max())
    p /= p.sum()
    entropy = -(p * np.log(p)).sum()
    lo, hi = max(0.0, temperature - spread), temperature + spread
    return lo + (hi - lo) * (entropy / np.log(len(finite))) ** exponent


@pytest.mark.parametrize("temperature,spread,exponent", [(0.8, 0.5, 1.0), (1.0, 1.0, 2.0), (0.3, 0.5, 0.5)])
def test_the_dynamic_temperature_is_llama_cpps(temperature, spread, exponent):
    from localheap.backends.torch.generate import dynamic_temperature

    rows = _rows(seed=6)
    for row in rows:
        want = _dyn_reference(row, temperature, spread, exponent)
        got = float(dynamic_temperature(torch.from_numpy(row)[None], temperature, spread, exponent))
        assert got == pytest.approx(want, rel=1e-4)
    peaked, flat = rows[0] * 6.0, rows[0] * 0.05
    assert float(dynamic_temperature(torch.from_numpy(peaked)[None], 1.0, 0.5, 1.0)) < \
        float(dynamic_temperature(torch.from_numpy(flat)[None], 1.0, 0.5, 1.0))   # low entropy: cooler
    try:
        mx, generate = _mlx()
    except pytest.skip.Exception:
        return
    for row in rows:
        lp = mx.array(row[None]) - mx.logsumexp(mx.array(row[None]), keepdims=True)
        got = generate.dynamic_temperature(lp, temperature, spread, exponent).item()
        assert got == pytest.approx(_dyn_reference(row, temperature, spread, exponent), rel=1e-4)


def test_dynatemp_comes_after_the_cut_offs_and_draws_only_what_they_keep():
    """With top-k 3 the entropy is the three ids' (llama.cpp's order: temperature last), and every
    draw is one of them, on both backends."""
    row = _rows(seed=7)[2]
    top3 = set(np.argsort(-row)[:3].tolist())
    params = SamplingParams(temperature=1.0, top_k=3, dynatemp_range=0.8, seed=5)
    assert params.dynamic_temperature and not SamplingParams(dynatemp_range=0.8).dynamic_temperature
    sampler = Sampler(params, torch.device("cpu"))
    kept = sampler.warpers[0](None, torch.from_numpy(row)[None])
    assert _kept(kept.numpy()) == top3
    assert {int(sampler.sample(torch.from_numpy(row))) for _ in range(100)} <= top3
    scaled = sampler.warpers[-1](None, kept)
    t = _dyn_reference(np.where(np.isfinite(kept.numpy()[0]), row, -np.inf), 1.0, 0.8, 1.0)
    i = next(iter(top3))
    assert float(scaled[0, i]) == pytest.approx(row[i] / t, rel=1e-4)
    try:
        mx, generate = _mlx()
    except pytest.skip.Exception:
        return
    mx.random.seed(5)
    sample, x = generate.Sampler(params), mx.array(row[None])
    assert {int(sample(x, x - mx.logsumexp(x, keepdims=True)).item()) for _ in range(100)} <= top3
