"""llama.cpp's adaptive-p (SamplingParams.adaptive): the distribution it draws from against its
definition written out in numpy (each id's probability p turned into the logit PEAK - SHARPNESS x
d^2 / (1 + d), d = |p - t| / WIDTH, t from the target and the EMA of the drawn ids' p), the EMA
moved by each draw, a long run's drawn probabilities steered to the target on both backends, and
the routes taking it where a samplers list names it (llama-server's rule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localheap.backends.torch.generate import AdaptiveP, Sampler
from localheap.generation import ADAPTIVE_PEAK, ADAPTIVE_SHARPNESS, ADAPTIVE_WIDTH, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _row(vocab=300, seed=0) -> np.ndarray:
    """A leader near p 0.5 and a long tail (the shape where the draws' p and the target differ)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1.0, vocab).astype(np.float32)
    x[7] = 7.0
    return x


def _reference(scores: np.ndarray, target: float, weighted: float, total: float) -> tuple[np.ndarray, np.ndarray]:
    finite = np.isfinite(scores)
    z = np.where(finite, scores, -np.inf).astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    t = min(max(2 * target - weighted / total, 0.0), 1.0)
    d = np.abs(p - t) / ADAPTIVE_WIDTH
    logits = np.where(finite, ADAPTIVE_PEAK - ADAPTIVE_SHARPNESS * d * d / (1 + d), -np.inf)
    q = np.exp(logits - logits[finite].max())
    return p, q / q.sum()


def _mlx():
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
    from localheap.backends.mlx import generate

    return mx, generate


@pytest.mark.parametrize("target,weighted", [(0.2, 2.0), (0.5, 9.0), (0.05, 0.1), (1.0, 3.0)])
def test_the_distribution_it_draws_from_is_llama_cpps(target, weighted):
    params = SamplingParams(temperature=1.0, adaptive_target=target, adaptive_decay=0.9)
    row = _row(seed=int(target * 100))
    row[:40] = -np.inf   # ids a cut-off dropped stay out
    total = 10.0
    _, want = _reference(row, target, weighted, total)
    a = AdaptiveP(params, torch.device("cpu"))
    a.weighted, a.total = torch.tensor(weighted), total
    got = a.distribution(torch.from_numpy(row)[None])[1][0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got[:40].sum() == 0
    try:
        mx, generate = _mlx()
    except pytest.skip.Exception:
        return
    m = generate.AdaptiveP(params)
    m.weighted, m.total = mx.array(weighted), total
    np.testing.assert_allclose(np.exp(np.array(m.distribution(mx.array(row[None]))[1][0])), want, atol=1e-6)


def test_the_ema_moves_by_each_draws_probability():
    row = _row(seed=3)
    params = SamplingParams(temperature=0.7, adaptive_target=0.25, adaptive_decay=0.8, seed=5)
    sampler = Sampler(params, torch.device("cpu"))
    assert sampler.adaptive is not None
    weighted, total = 0.25 / 0.2, 1 / 0.2
    for _ in range(20):
        p, q = _reference(row / 0.7, 0.25, weighted, total)
        token = int(sampler.sample(torch.from_numpy(row)))
        assert q[token] > 0
        weighted, total = p[token] + 0.8 * weighted, 1 + 0.8 * total
        assert float(sampler.adaptive.weighted) == pytest.approx(weighted, rel=1e-5)
        assert sampler.adaptive.total == pytest.approx(total)


# probabilities with ids on both sides of the targets below; top-k 8 leaves the first eight (adaptive-p
# reads the probabilities the cut-offs leave, as llama.cpp's chain hands them over)
KEPT = np.array([0.3, 0.18, 0.12, 0.08, 0.06, 0.05, 0.04, 0.03])
STEER_ROW = np.log(np.concatenate([KEPT, np.full(60, 0.14 / 60)])).astype(np.float32)


def _drawn_p(sample_fn, n: int = 400) -> float:
    """The mean probability (among the ids top-k leaves) of `n` drawn ids."""
    p = KEPT / KEPT.sum()
    return float(np.mean([p[sample_fn()] for _ in range(n)]))


@pytest.mark.parametrize("target", [0.05, 0.1])
def test_a_long_run_draws_ids_near_the_target_on_both_backends(target):
    """Plain draws' probabilities average 0.2; adaptive-p's average near the target."""
    plain = Sampler(SamplingParams(temperature=1.0, top_k=8, seed=2), torch.device("cpu"))
    steered = Sampler(SamplingParams(temperature=1.0, top_k=8, seed=2, adaptive_target=target), torch.device("cpu"))
    t = torch.from_numpy(STEER_ROW)
    far = _drawn_p(lambda: int(plain.sample(t)))
    near = _drawn_p(lambda: int(steered.sample(t)))
    assert abs(near - target) < 0.3 * abs(far - target), (near, far)
    try:
        mx, generate = _mlx()
    except pytest.skip.Exception:
        return
    mx.random.seed(2)
    sample = generate.Sampler(SamplingParams(temperature=1.0, top_k=8, adaptive_target=target))
    x = mx.array(STEER_ROW[None])
    near = _drawn_p(lambda: sample(x).item())
    assert abs(near - target) < 0.3 * abs(far - target), (near, far)


def test_when_it_is_on():
    assert SamplingParams(temperature=1.0, adaptive_target=0.0).adaptive
    assert not SamplingParams(temperature=1.0).adaptive                              # -1: off
    assert not SamplingParams(temperature=0.0, adaptive_target=0.3).adaptive         # greedy stays greedy
    assert not SamplingParams(temperature=1.0, adaptive_target=0.3, mirostat=2).adaptive   # Mirostat draws instead
    for bad in ({"adaptive_target": 1.5}, {"adaptive_decay": 1.0}, {"adaptive_decay": -0.1}):
        with pytest.raises(ValueError, match="adaptive"):
            SamplingParams(**bad)


def test_the_llamacpp_route_turns_it_on_only_where_a_samplers_list_names_it():
    from localheap.server.llamacpp import LlamaRequest

    def params(**kw):
        return LlamaRequest(prompt="x", **kw).params(16, None, [], None)

    on = params(adaptive_target=0.3, adaptive_decay=0.5, samplers=["top_k", "adaptive_p", "temperature"])
    assert on.adaptive and on.adaptive_target == 0.3 and on.adaptive_decay == 0.5
    assert not params(adaptive_target=0.3).adaptive                        # llama-server's default list lacks it
    assert not params(adaptive_target=-0.01, samplers=["adaptive_p"]).adaptive   # SillyTavern's default: off
    assert params(adaptive_target=0.3, samplers="kat").adaptive               # its letter
