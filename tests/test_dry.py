"""DRY (localheap.dry; llama.cpp's dry_* options): the window's penalties against a brute-force
n-gram search of the definition, both backends' samplers taking them off the logits in llama.cpp's
order, the batched engine giving a DRY session the tokens it gets alone, the breakers found in a
tokenizer's vocabulary, and /completion taking the options (and a samplers list leaving DRY out)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_checks import check_params_ride_the_batch, greedy_on_both_backends
from localheap.dry import MAX_MATCH, DryState, breaker_ids
from localheap.generation import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _brute(w: list[int], breakers: set, mult: float, base: float, allowed: int) -> dict[int, float]:
    """Every n-gram ending the window (n up to MAX_MATCH, no breaker in it) searched for earlier
    in the window; the token after each earlier copy (no breaker) gets the longest n it extends."""
    n, best = len(w), {}
    if n < 2 or w[-1] in breakers:
        return {}
    for length in range(1, min(MAX_MATCH, n - 1) + 1):
        suffix = w[n - length:]
        if any(t in breakers for t in suffix):
            break
        for end in range(length - 1, n - 1):
            if w[end - length + 1: end + 1] == suffix and w[end + 1] not in breakers:
                best[w[end + 1]] = max(best.get(w[end + 1], 0), length)
    return {t: mult * base ** (m - allowed) for t, m in best.items() if m >= allowed}


def _as_dict(state: DryState) -> dict[int, float]:
    ids, amounts = state.penalties()
    return dict(zip(ids.tolist(), amounts.tolist()))


@pytest.mark.parametrize("seed", range(6))
def test_the_penalties_are_the_definitions(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(3, 9))
    period = rng.integers(0, vocab, int(rng.integers(2, 7))).tolist()
    context = (period * 30)[: int(rng.integers(5, 120))]
    context = [t if rng.random() > 0.15 else int(rng.integers(0, vocab)) for t in context]   # broken repeats
    breakers = {int(rng.integers(0, vocab))} if seed % 2 else set()
    mult, base, allowed = 0.8, 1.75, int(rng.integers(1, 4))
    last_n = [-1, 16, 40][seed % 3]
    state = DryState(mult, base, allowed, last_n, sorted(breakers), context, reserve=2)   # grows as it goes
    seq = list(context)
    checked = 0
    for step in range(60):
        window = seq if last_n < 0 else seq[-last_n:]
        want = _brute(window, breakers, mult, base, allowed)
        got = _as_dict(state)
        assert got.keys() == want.keys(), (step, got, want)
        for t in want:
            assert got[t] == pytest.approx(want[t], rel=1e-5)
        checked += bool(want)
        t = int(rng.integers(0, vocab)) if rng.random() < 0.3 else (period[step % len(period)])
        state.push(t)
        seq.append(t)
    assert checked > 10, "the case penalized something"


def test_a_long_repeat_is_counted_to_max_match():
    state = DryState(1.0, 1.0, 1, -1, [], list(range(100)) * 2)   # base 1: the penalty does not grow
    ids, amounts = state.penalties()
    assert ids.tolist() == [0] and amounts.tolist() == [1.0]      # 0..99 repeated: 0 came after 99
    long = DryState(1.0, 1.5, 2, -1, [], [5, 6] * 200)
    ids, amounts = long.penalties()
    assert ids.tolist() == [5] and amounts[0] == pytest.approx(1.5 ** (MAX_MATCH - 2), rel=1e-5)


def _logits(steps=50, vocab=12, seed=2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, vocab)).astype(np.float32)
    x[:, :3] += np.array([2.0, 1.5, 1.2], np.float32)   # a few leaders: greedy would repeat them
    return x


def _reference(logits, context, mult, base, allowed, last_n, breakers, presence=0.0) -> list[int]:
    seq, out, counts = list(context), [], np.zeros(logits.shape[1], np.float32)
    for row in logits:
        row = row - presence * (counts > 0)
        for t, amount in _brute(seq if last_n < 0 else seq[-last_n:], breakers, mult, base, allowed).items():
            row[t] -= amount
        t = int(np.argmax(row))
        out.append(t)
        seq.append(t)
        counts[t] += 1
    return out


def _params(**kw) -> SamplingParams:
    context = kw.pop("context")
    return SamplingParams(**kw).with_context(context, [])


CASE = {"dry_multiplier": 0.9, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 24,
        "dry_breakers": [7], "presence_penalty": 0.3}


def test_torch_and_mlx_samplers_take_the_penalties_off_the_logits():
    logits, context = _logits(), [0, 1, 2, 0, 1]
    want = _reference(logits, context, 0.9, 1.75, 2, 24, {7}, presence=0.3)
    assert want != _reference(logits, context, 0.0, 1.75, 2, 24, {7}, presence=0.3), "DRY decides some steps"
    params = _params(**CASE, context=context)
    assert params.dry and not params.plain_greedy and params.context == context
    for got in greedy_on_both_backends(params, logits):
        assert got == want


def test_the_params_check_the_options():
    for bad in ({"dry_multiplier": -1.0}, {"dry_base": 0.5}, {"dry_allowed_length": 0}, {"dry_penalty_last_n": -2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=0).dry
    both = SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=8, repeat_penalty=1.1, repeat_last_n=3)
    ctx = both.with_context(list(range(20)), [20])
    assert ctx.context == list(range(13, 21)) and ctx.window(3) == [18, 19, 20]


def test_breakers_are_the_tokens_whose_text_holds_one(model_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs("llama"))
    ids = set(breaker_ids(tok, ["\n", ":"]))
    assert ids and all("\n" in tok.decode([i]) or ":" in tok.decode([i]) for i in ids)
    assert set(tok.encode("a:\nb", add_special_tokens=False)) & ids
    assert not ids & set(tok.encode("plain words", add_special_tokens=False))
    assert breaker_ids(tok, []) == []


@pytest.fixture(scope="module")
def demo(demo_either):
    return demo_either


def test_the_batch_gives_a_dry_session_its_tokens_alone(demo):
    check_params_ride_the_batch(demo, {"dry_multiplier": 2.0, "dry_allowed_length": 1, "dry_penalty_last_n": -1})
