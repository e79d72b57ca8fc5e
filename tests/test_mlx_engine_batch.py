"""The batched engine on MLX (the demo model): decoding runs advance together in one step with
the tokens each has alone, a cancelled run leaves the others untouched, and a document read rides
in the chat's decode steps. The engine itself is backend-neutral: test_engine_batch.py covers the
rest on torch (spills, fairness, admission order)."""

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
pytest.importorskip("mlx_lm")

from engine_checks import (StepLog, alone_texts, batched_texts, drain, submit, text, check_cancel_mid_batch, check_document_rides, check_recall_probes_the_question,  # noqa: E402
                           check_sliding_sessions_batch, check_turn_recalls_beside_the_batch, engine,
                           replies, requests_for)

from localheap.backends.mlx import MLXBackend  # noqa: E402
from localheap.engine import Delta  # noqa: E402
from localheap.backends.mlx.slab import DecodeSlab  # noqa: E402
from localheap.models import demo_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def demo():
    path = demo_model_dir()
    if path is None:
        pytest.skip("no bundled demo model in this installation")
    return MLXBackend.load(path)


@pytest.fixture(scope="module")
def REQUESTS(demo):
    return requests_for(demo)


def test_the_engine_batches_mlx_sessions_with_their_tokens_alone(demo, REQUESTS, monkeypatch):
    want = alone_texts(demo, REQUESTS)
    log = StepLog(demo, monkeypatch)
    attended, attend = [], DecodeSlab.attend

    def spy(self, i, queries, *args, **kwargs):
        attended.append(queries.shape[0])
        return attend(self, i, queries, *args, **kwargs)

    monkeypatch.setattr(DecodeSlab, "attend", spy)
    eng = engine(demo)
    try:
        assert eng.batched
        got = replies(eng, REQUESTS)
    finally:
        eng.stop()
    assert [t for t, _ in got] == want
    assert max(len(rows) for rows, _ in log.steps) == len(REQUESTS), "all four decoded in one step"
    assert max(attended) == len(REQUESTS), "their heaps attended as one batch from a slab"
    assert not any(slab.members for slab in demo.slabs.values()), "every run's heap left the slab"


def test_cancel_mid_batch_leaves_the_others_untouched(demo, REQUESTS):
    check_cancel_mid_batch(demo, REQUESTS)


def test_a_document_read_rides_with_the_decoding_chat(demo, REQUESTS, monkeypatch):
    check_document_rides(demo, REQUESTS, monkeypatch)


def test_one_session_decodes_ahead_and_its_turns_read_as_round_robin(demo, monkeypatch):
    """A session decoding alone in the batch has its next step queued before its token is read
    (the round-robin generator's pipelining); a turn ended by a stop token leaves that token fed
    as round-robin does, so the session's next turn reuses and reads what it reads round-robin."""
    first = requests_for(demo)[1][0]

    def conversation(eng) -> list:
        evs = drain(submit(eng, first, max_tokens=40)[1])
        ids = [i for e in evs if isinstance(e, Delta) for i in e.ids]
        sid = evs[-1].session_id
        stop = drain(submit(eng, [5, 6, 7], session_id=sid, max_tokens=40, stop_token_ids=[ids[12]])[1])
        again = drain(submit(eng, [8, 9], session_id=sid, max_tokens=20)[1])
        return [(text(e), e[-1].usage, e[-1].prompt_read) for e in (evs, stop, again)] + [ids]

    rr = engine(demo, batched=False, max_active=1)
    try:
        want = conversation(rr)
    finally:
        rr.stop()
    log = StepLog(demo, monkeypatch)
    eng = engine(demo)
    try:
        assert eng.batched
        got = conversation(eng)
    finally:
        eng.stop()
    assert got == want
    assert want[1][0][1] == "stop" and want[1][0][2] < 40, "the second turn ended on its stop token"
    assert sum(log.ahead) >= len(log.ahead) - 4, "the session decoded ahead in the batch"


def test_sessions_with_sliding_layers_decode_in_the_batch_with_their_tokens_alone(model_dirs, monkeypatch):
    """gemma3's sliding-window layers keep mlx-lm's rotating cache: such sessions take the batch
    as lone parts (engine_checks.check_sliding_sessions_batch)."""
    check_sliding_sessions_batch(MLXBackend.load(model_dirs("gemma3_text")), monkeypatch)


def test_a_turn_after_a_paged_out_document_recalls_for_its_question(demo, tmp_path):
    check_recall_probes_the_question(demo, tmp_path)


def test_a_turn_recalls_while_the_other_sessions_decode(demo, tmp_path, monkeypatch):
    check_turn_recalls_beside_the_batch(demo, tmp_path, monkeypatch)


def test_seeded_rows_that_sample_at_random_draw_in_the_batch_what_they_draw_alone(demo, REQUESTS):
    """Four seeded chats at temperature 1 in one batch: each reply is the one it gets alone (so `n`'s
    choice i is the reply of seed + i). They shared mlx's global generator, so a row's draws
    depended on the rows beside it; each seeded draw now steps a generator of its own."""
    reqs = [(toks, {**params, "temperature": 1.0, "seed": 10 + i, **({"top_p": 0.9} if i % 2 else {})})
            for i, (toks, params) in enumerate(REQUESTS)]
    want = alone_texts(demo, reqs)
    assert batched_texts(demo, reqs) == want and len(set(want)) == 4


def test_xtc_mirostat_and_adaptive_p_rows_draw_in_the_batch_what_they_draw_alone(demo, REQUESTS):
    """The samplers that draw more than the token (XTC's coin) or draw it themselves (mirostat,
    adaptive-p) step the row's own generator too: four seeded rows, one plain and one of each,
    reply in one batch as alone. They drew from mlx's global generator, shared by the batch."""
    kinds = [{}, {"xtc_probability": 0.5, "xtc_threshold": 0.05}, {"mirostat": 2, "mirostat_tau": 4.0},
             {"adaptive_target": 0.3}]
    reqs = [(toks, {**params, "temperature": 1.0, "seed": 20 + i, **kinds[i]})
            for i, (toks, params) in enumerate(REQUESTS)]
    want = alone_texts(demo, reqs)
    assert batched_texts(demo, reqs) == want and len(set(want)) == 4


@pytest.mark.parametrize("kind", [{}, {"top_p": 0.9}, {"xtc_probability": 0.5, "xtc_threshold": 0.05},
                                  {"mirostat": 2, "mirostat_tau": 4.0}, {"mirostat": 1}, {"adaptive_target": 0.3},
                                  {"adaptive_target": 0.3, "xtc_probability": 0.5}])
def test_a_seeded_samplers_own_generator_draws_what_mlxs_seeded_global_one_draws(kind):
    """A seeded request's draws (its own key, split per draw) are the ones an unseeded sampler makes
    from mlx's global generator seeded with that seed: seeded replies are what they were alone
    before rows had generators of their own."""
    import mlx.core as mx
    import numpy as np

    from localheap.backends.mlx.generate import Sampler
    from localheap.generation import SamplingParams

    rng = np.random.default_rng(0)
    rows = [mx.array(rng.normal(size=(1, 300)).astype(np.float32) * 2) for _ in range(40)]

    def draws(seed):
        sample = Sampler(SamplingParams(temperature=1.0, seed=seed, **kind))
        return [sample(r, r - mx.logsumexp(r, axis=-1, keepdims=True)).item() for r in rows]

    mx.random.seed(11)
    own = draws(11)
    mx.random.seed(11)
    assert draws(None) == own and len(set(own)) > 20
    mx.random.seed(11)
    assert draws(12) != own
