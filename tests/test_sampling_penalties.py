"""OpenAI's presence and frequency penalties and min-p (generation.SamplingParams): the samplers of
both backends against the definition (logit[id] -= presence * (count > 0) + frequency * count, the
reply's own tokens counted, before temperature and the cut-offs), the batched engine giving a
penalized session the tokens it gets alone, and the server taking the fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_checks import check_params_ride_the_batch
from localheap.backends.torch import TorchBackend
from localheap.backends.torch.batch import sample_rows
from localheap.backends.torch.generate import Sampler
from localheap.generation import SamplingParams
from localheap.models import demo_model_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PENALTIES = [(2.0, 0.0), (0.0, 0.7), (0.5, 0.3), (-1.0, 0.0), (0.0, -0.4)]


def _logits(steps: int = 40, vocab: int = 30, seed: int = 0) -> np.ndarray:
    """Logits where a few ids lead by less than the penalties take off, so that penalties decide."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, vocab)).astype(np.float32)
    x[:, :3] += np.array([3.0, 2.5, 2.2], np.float32)
    return x


def _reference_greedy(logits: np.ndarray, presence: float, frequency: float) -> list[int]:
    counts, out = np.zeros(logits.shape[1], np.float32), []
    for row in logits:
        t = int(np.argmax(row - (presence * (counts > 0) + frequency * counts)))
        counts[t] += 1
        out.append(t)
    return out


@pytest.mark.parametrize("presence,frequency", PENALTIES)
def test_torch_sampler_applies_the_penalties_as_defined(presence, frequency):
    logits = _logits()
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    sampler = Sampler(params, torch.device("cpu"))
    got = [int(sampler.sample(torch.from_numpy(row))) for row in logits]
    want = _reference_greedy(logits, presence, frequency)
    assert got == want
    assert got != _reference_greedy(logits, 0.0, 0.0), "the penalties decide some steps of this case"
    # sampled: the penalties come off before temperature and top-p (the same draws as by hand)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, presence_penalty=presence, frequency_penalty=frequency)
    sampler, by_hand = Sampler(params, torch.device("cpu")), Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=3),
                                                                      torch.device("cpu"))
    counts = torch.zeros(logits.shape[1])
    for row in torch.from_numpy(logits):
        t = int(sampler.sample(row))
        assert t == int(by_hand.sample(row - (presence * (counts > 0) + frequency * counts)))
        counts[t] += 1


def test_without_penalties_the_sampler_is_the_plain_one():
    sampler = Sampler(SamplingParams(), torch.device("cpu"))
    assert not sampler.penalized
    for row in torch.from_numpy(_logits(5)):
        sampler.sample(row)
    assert sampler.counts is None


def test_a_penalized_greedy_row_is_sampled_on_its_own_in_a_batch():
    logits = torch.from_numpy(_logits(20))
    rows = [Sampler(SamplingParams(), torch.device("cpu")),
            Sampler(SamplingParams(presence_penalty=2.0), torch.device("cpu")),
            Sampler(SamplingParams(frequency_penalty=0.7), torch.device("cpu"))]
    got = [[int(t) for t in sample_rows(rows, torch.stack([row] * 3))] for row in logits]
    assert [g[0] for g in got] == _reference_greedy(logits.numpy(), 0.0, 0.0)
    assert [g[1] for g in got] == _reference_greedy(logits.numpy(), 2.0, 0.0)
    assert [g[2] for g in got] == _reference_greedy(logits.numpy(), 0.0, 0.7)


def test_min_p_drops_the_unlikely_ids():
    row = torch.tensor([4.0, 3.9, 0.0, -1.0])   # p(id 2) / p(id 0) = e^-4: under min_p 0.05
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.05, seed=0), torch.device("cpu"))
    assert {int(sampler.sample(row)) for _ in range(200)} == {0, 1}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)


@pytest.mark.parametrize("presence,frequency", PENALTIES[:3])
def test_mlx_sampler_applies_the_penalties_as_defined(presence, frequency):
    mx = pytest.importorskip("mlx.core")
    from localheap.backends.mlx.generate import Sampler

    logits = _logits()
    sample = Sampler(SamplingParams(presence_penalty=presence, frequency_penalty=frequency))
    got = []
    for row in logits:
        x = mx.array(row[None])
        got.append(int(sample(x, x - mx.logsumexp(x, keepdims=True)).item()))
    assert got == _reference_greedy(logits, presence, frequency)


@pytest.fixture(scope="module")
def demo():
    return TorchBackend.load(demo_model_dir(), dtype=torch.float32)


def test_the_batch_gives_a_penalized_session_its_tokens_alone(demo):
    check_params_ride_the_batch(demo, {"presence_penalty": 1.5, "frequency_penalty": 0.5})


def test_the_server_takes_the_penalties_and_min_p(model_dirs):
    """Through /v1/chat/completions: the fields are taken (they were refused before), and a strong
    presence penalty changes a greedy reply."""
    pytest.importorskip("fastapi")
    from localheap.models import load_backend
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    with ServerThread(create_app(load_backend(str(demo_model_dir()), "torch"), ServerSettings(web_dir=None))) as srv:
        import httpx

        def ask(**kw):
            body = {"model": srv.services.model_id, "messages": [{"role": "user", "content": "The pass key"}],
                    "max_tokens": 24, "temperature": 0, **kw}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        plain = ask()
        assert ask(presence_penalty=2.0, frequency_penalty=1.0) != plain
        assert ask(min_p=0.0) == plain   # off: the plain reply
        assert ask(min_p=0.2, temperature=1.0, seed=1)


def test_mlx_sampled_draws_are_mlx_lms_sampler_on_the_processed_logits():
    """logit_bias and the penalties change the logits before their logsumexp, where mlx-lm's
    generate_step applies its processors: seeded, the draws are mlx-lm's own sampler's given the
    log-softmax of the processed logits."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.sample_utils import make_sampler

    from localheap.backends.mlx.generate import Sampler

    logits = _logits(60)
    bias, presence = {1: 2.0, 2: -1.0}, 0.5
    ours = Sampler(SamplingParams(temperature=1.0, top_p=0.6, logit_bias=bias, presence_penalty=presence))
    stock = make_sampler(temp=1.0, top_p=0.6)
    vector = np.zeros(logits.shape[1], np.float32)
    vector[list(bias)] = list(bias.values())

    def draws(by_hand: bool) -> list[int]:
        mx.random.seed(5)
        counts, out = np.zeros(logits.shape[1], np.float32), []
        for row in logits:
            x = mx.array(row[None])
            if by_hand:
                scores = mx.array((row + vector - presence * (counts > 0))[None])
                t = int(stock(scores - mx.logsumexp(scores, keepdims=True)).item())
            else:
                t = int(ours(x, x - mx.logsumexp(x, keepdims=True)).item())
            counts[t] += 1
            out.append(t)
        return out

    got = draws(False)
    assert got == draws(True) and len(set(got)) > 2
