"""The batched engine on the demo model: runs decode together in one forward per step, with the
same tokens as the round-robin engine; cancelling, spilling and failing one run leaves the others'
tokens as they would be alone; a batch smaller than the decoding runs serves them all in turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_checks import StepLog, alone_texts, drain, engine, ids, replies, requests_for, submit, text, until_deltas

from localheap.backends.torch import TorchBackend
from localheap.engine import Finished, Progress, Started, wait_idle
from localheap.models import demo_model_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def demo():
    return TorchBackend.load(demo_model_dir(), dtype=torch.float32)


@pytest.fixture(scope="module")
def REQUESTS(demo):
    return requests_for(demo)


def test_batched_engine_gives_each_session_its_tokens_alone(demo, REQUESTS, monkeypatch):
    want = alone_texts(demo, REQUESTS)
    log = StepLog(demo, monkeypatch)
    for batched in (True, False):
        eng = engine(demo, batched=batched)
        try:
            got = replies(eng, REQUESTS)
        finally:
            eng.stop()
        assert [t for t, _ in got] == want
    assert max(len(rows) for rows, _ in log.steps) == len(REQUESTS), "all four decoded in one forward"


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


def test_a_session_spilled_while_others_decode(demo, REQUESTS, tmp_path):
    eng = engine(demo, tmp_path)
    try:
        first = ids(30, 9)
        idle = drain(submit(eng, first, max_tokens=8)[1])
        sid = idle[-1].session_id
        requests = [REQUESTS[0], REQUESTS[2]]
        jobs = [submit(eng, toks, **p) for toks, p in requests]
        seen = until_deltas(jobs[0][1], 2)
        eng.call(lambda: eng.store.spill(sid)).result(timeout=30)   # between two batched steps
        assert eng.store.get(sid).cache is None
        outs = [drain(q, out=seen if i == 0 else None) for i, (_, q) in enumerate(jobs)]
        # the spilled session continues from disk as if it had stayed
        again = drain(submit(eng, [3, 4, 5], session_id=sid, max_tokens=10)[1])
    finally:
        eng.stop()
    assert [text(o) for o in outs] == alone_texts(demo, requests)
    ref = engine(demo)
    try:
        drain(submit(ref, first, max_tokens=8)[1])
        sid_ref = ref.store.sessions()[0].id
        want = drain(submit(ref, [3, 4, 5], session_id=sid_ref, max_tokens=10)[1])
    finally:
        ref.stop()
    assert text(again) == text(want)


def test_batch_smaller_than_the_decoding_runs_serves_them_in_turn(demo, REQUESTS, monkeypatch):
    """max_batch=2, four runs decoding, seats held for 3 steps: none waits more than 3 steps."""
    log = StepLog(demo, monkeypatch)
    eng = engine(demo, max_batch=2, batch_slice=3)
    try:
        got = replies(eng, REQUESTS)
    finally:
        eng.stop()
    assert [t for t, _ in got] == alone_texts(demo, REQUESTS)
    assert max(len(rows) for rows, _ in log.steps) == 2
    gaps = []
    for r in {r for rows, _ in log.steps for r in rows}:
        steps = [i for i, (rows, _) in enumerate(log.steps) if r in rows]
        gaps.append(max(np.diff(steps), default=1))
    assert max(gaps) <= 3 + 1 and max(gaps) > 1, gaps   # they did take turns, within the bound


def test_queued_requests_start_in_arrival_order(demo, REQUESTS):
    """Beyond max_active, requests wait in FIFO order and each starts when a run ends."""
    eng = engine(demo, max_active=2, max_batch=2)
    try:
        jobs = [submit(eng, toks, **p) for toks, p in REQUESTS]
        outs = [drain(q) for _, q in jobs]
    finally:
        eng.stop()
    assert all(isinstance(o[0], Started) for o in outs)
    assert all(isinstance(o[-1], Finished) for o in outs)


def test_a_document_read_rides_with_the_decoding_chat(demo, REQUESTS, monkeypatch):
    """A chat decodes while a document is fed: chunks ride in the decode steps, the chat's tokens
    interleave with the document's progress, and both end as they would alone."""
    log = StepLog(demo, monkeypatch)
    eng = engine(demo, mixed_chunk=16)
    doc = ids(600, 12)
    try:
        chat_job, chat_q = submit(eng, REQUESTS[2][0], max_tokens=40)
        seen = until_deltas(chat_q, 1)
        doc_job, doc_q = submit(eng, doc, feed=True)
        doc_evs, chat_evs = drain(doc_q), drain(chat_q, out=seen)
    finally:
        eng.stop()
    assert doc_evs[-1].finish_reason == "fed" and doc_evs[-1].usage.prompt_tokens == 600
    assert any(rode for _, rode in log.steps), "document chunks rode in decode steps"
    assert sum(isinstance(e, Progress) for e in doc_evs) > 5
    assert text(chat_evs) == alone_texts(demo, [REQUESTS[2]])[0]
