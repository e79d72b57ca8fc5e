"""The batched engine on MLX (the demo model): decoding runs advance together in one step with
the tokens each has alone, a cancelled run leaves the others untouched, and a document read rides
in the chat's decode steps. The engine itself is backend-neutral: test_engine_batch.py covers the
rest on torch (spills, fairness, admission order)."""

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
pytest.importorskip("mlx_lm")

from engine_checks import (StepLog, alone_texts, drain, engine, ids, replies, requests_for,  # noqa: E402
                           submit, text, until_deltas)

from localheap.backends.mlx import MLXBackend  # noqa: E402
from localheap.engine import Progress, wait_idle  # noqa: E402
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
    eng = engine(demo)
    try:
        assert eng.batched
        got = replies(eng, REQUESTS)
    finally:
        eng.stop()
    assert [t for t, _ in got] == want
    assert max(len(rows) for rows, _ in log.steps) == len(REQUESTS), "all four decoded in one step"


def test_cancel_mid_batch_leaves_the_others_untouched(demo, REQUESTS):
    requests = REQUESTS[:3]
    want = alone_texts(demo, requests)
    eng = engine(demo)
    try:
        jobs = [submit(eng, toks, **p) for toks, p in requests]
        seen = until_deltas(jobs[1][1], 5)   # the victim is mid-stream, in the batch with the others
        jobs[1][0].cancel()
        outs = [drain(q, out=seen if i == 1 else None) for i, (_, q) in enumerate(jobs)]
        assert text(outs[1])[1] == "cancelled"
        assert [text(outs[0]), text(outs[2])] == [want[0], want[2]]
        assert wait_idle(eng)
        s = eng.store.get(outs[1][-1].session_id)
        assert not s.busy and len(s.fed) == demo.tokens_in_cache(s.cache)
    finally:
        eng.stop()


def test_a_document_read_rides_with_the_decoding_chat(demo, REQUESTS, monkeypatch):
    log = StepLog(demo, monkeypatch)
    eng = engine(demo, mixed_chunk=16)
    doc = ids(600, 12)
    try:
        _, chat_q = submit(eng, REQUESTS[2][0], max_tokens=40)
        seen = until_deltas(chat_q, 1)
        _, doc_q = submit(eng, doc, feed=True)
        doc_evs, chat_evs = drain(doc_q), drain(chat_q, out=seen)
    finally:
        eng.stop()
    assert doc_evs[-1].finish_reason == "fed" and doc_evs[-1].usage.prompt_tokens == 600
    assert any(rode for _, rode in log.steps), "document chunks rode in decode steps"
    assert sum(isinstance(e, Progress) for e in doc_evs) > 5
    assert text(chat_evs) == alone_texts(demo, [REQUESTS[2]])[0]


def test_sessions_with_sliding_layers_decode_on_their_own_path(model_dirs, monkeypatch):
    """gemma3's sliding-window layers keep mlx-lm's own cache: such heaps are not batchable, and
    the batched engine serves them through the single-session generator, with their tokens alone."""
    gemma = MLXBackend.load(model_dirs("gemma3_text"))
    requests = [(ids(40, 1), {"max_tokens": 12}), (ids(25, 2), {"max_tokens": 9})]
    want = alone_texts(gemma, requests)
    log = StepLog(gemma, monkeypatch)
    eng = engine(gemma)
    try:
        got = replies(eng, requests)
    finally:
        eng.stop()
    assert [t for t, _ in got] == want
    assert not any(rows for rows, _ in log.steps), "no row of theirs went through step_rows"
