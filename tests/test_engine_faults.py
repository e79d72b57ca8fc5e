"""The engine under faults (fake backend): a failed spill, a failing backend, bad token ids,
a lost saved session, a bug in the loop. One request fails; sessions and the engine stay."""

from __future__ import annotations

import errno
import queue
import shutil
import time

import pytest
from test_engine import CFG, FakeBackend, drain, run, text_of

from localheap.engine import Engine, EngineFailed, Failed, Finished, Generate, InvalidTokens, Started
from localheap.generation import SamplingParams
from localheap.sessions import Prompt, RollbackRefused, SessionStore, SpillFailed


def engine_on(tmp_path, backend=None, durable=False, **store_kw):
    backend = backend or FakeBackend()
    backend.vocab_size = 0x3000   # the char tokenizer's ids stay below
    store = SessionStore(backend, CFG, tmp_path / "sessions", durable=durable, **store_kw)
    return Engine(backend, store).start(), backend


def finished(events):
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def break_dir(root):
    shutil.rmtree(root)
    root.write_text("a file where the sessions directory was")


def test_failed_spill_fails_only_the_request_that_needed_room(tmp_path):
    """Two concurrent sessions, one resident slot, the directory gone: the engine lives on."""
    eng, _ = engine_on(tmp_path, FakeBackend(step_s=0.002), max_resident=1)
    try:
        a = finished(drain(run(eng, Generate, "first session", max_tokens=3)[1])).session_id
        break_dir(tmp_path / "sessions")
        evs = drain(run(eng, Generate, "second session", max_tokens=3)[1])   # needs a's slot
        assert isinstance(evs[-1], Failed) and isinstance(evs[-1].error, SpillFailed)
        assert str(tmp_path / "sessions") in str(evs[-1].error)
        assert eng.store.get(a).state == "resident"
        # a long run on a keeps a busy; b gets a heap beside it; b's end tries to spill b: logged
        long_job, long_q = run(eng, Generate, "more", session_id=a, max_tokens=200)
        b = drain(run(eng, Generate, "third session", max_tokens=3)[1])
        assert isinstance(b[-1], Finished)
        assert finished(drain(long_q)).usage.completion_tokens == 200
        assert eng.healthy and eng.store.get(a).state == "resident"
        # (the first reply's third token, max_tokens cut, sampled and never read: read before "more")
        assert len(eng.store.get(a).fed) == len("first session") + 3 + len("more") + 199
    finally:
        eng.stop()


def test_injected_writer_that_raises(tmp_path):
    backend = FakeBackend()
    eng, _ = engine_on(tmp_path, backend, max_resident=1)
    try:
        a = finished(drain(run(eng, Generate, "alpha", max_tokens=3)[1])).session_id

        def full(cache, path, snapshot=False):
            raise OSError(errno.ENOSPC, "No space left on device")

        backend.save_cache = full
        evs = drain(run(eng, Generate, "beta", max_tokens=3)[1])
        assert "No space left on device" in str(evs[-1].error)
        assert not any(p.name.startswith(".") for p in (tmp_path / "sessions").iterdir()), "no temp file left"
        assert text_of(drain(run(eng, Generate, "alphaab and on", max_tokens=2)[1])) == "ab"   # a continues
    finally:
        eng.stop()


def test_bad_token_ids_leave_the_named_session_alone(tmp_path):
    eng, backend = engine_on(tmp_path)
    try:
        sid = finished(drain(run(eng, Generate, "keep me", max_tokens=3)[1])).session_id
        before = eng.store.get(sid).fed.tolist()
        for bad in ([5, 0x3000], [-1]):
            events = queue.Queue()
            eng.submit(Generate(Prompt(bad, None, bad), SamplingParams(max_tokens=2), events.put, sid))
            assert isinstance(drain(events)[-1].error, InvalidTokens)
        s = eng.store.get(sid)
        assert s.fed.tolist() == before and backend.tokens_in_cache(s.cache) == len(before)
    finally:
        eng.stop()


def test_a_failing_backend_rolls_the_session_back_to_its_saved_turn(tmp_path):
    eng, backend = engine_on(tmp_path, durable=True)
    try:
        sid = finished(drain(run(eng, Generate, "turn one", max_tokens=3)[1])).session_id
        saved = eng.store.get(sid).fed.tolist()
        backend.fail_on_prefill = True
        assert isinstance(drain(run(eng, Generate, "turn two", session_id=sid)[1])[-1], Failed)
        s = eng.store.get(sid)
        assert s.state == "spilled" and s.fed.tolist() == saved   # kept, minus the turn in flight
        backend.fail_on_prefill = False
        evs = drain(run(eng, Generate, "turn two", session_id=sid, max_tokens=2)[1])
        assert evs[0].cached_tokens == len(saved) and isinstance(evs[-1], Finished)
    finally:
        eng.stop()


def test_an_unreadable_heap_is_rebuilt_from_the_tokens(tmp_path):
    """The tokens are the truth: a session whose heap file is garbage is read through a new heap
    again (not lost: its tokens are intact), named or matched by its history."""
    eng, _ = engine_on(tmp_path, durable=True)
    try:
        a = finished(drain(run(eng, Generate, "lost history", max_tokens=3)[1])).session_id
        b = finished(drain(run(eng, Generate, "named and lost", max_tokens=3)[1])).session_id
        held = {}
        for sid in (a, b):
            eng.call(lambda sid=sid: eng.store.spill(sid)).result(5)
            heap = eng.store.get(sid).spill_path
            heap.write_text("garbage")
            held[sid] = len(eng.store.get(sid).fed)
        evs = drain(run(eng, Generate, "named", session_id=b)[1])
        assert isinstance(evs[-1], Finished) and evs[0].cached_tokens == held[b] and eng.store.rebuilt == 1
        evs = drain(run(eng, Generate, "lost historyab, continued", max_tokens=2)[1])   # matched a
        done = finished(evs)
        assert done.session_id == a and evs[0].cached_tokens > 0 and eng.store.rebuilt == 2
        assert (tmp_path / "sessions" / "aside").is_dir()   # the garbage, for a post-mortem
    finally:
        eng.stop()


def test_a_bug_in_the_loop_fails_everything_and_reports(tmp_path):
    eng, _ = engine_on(tmp_path)
    fatal = []
    eng.on_fatal = fatal.append
    job, q = run(eng, Generate, "running", max_tokens=100_000)
    q.get(timeout=5)

    def bug():
        raise RuntimeError("a bug")

    eng._admit = bug
    waiting, wq = run(eng, Generate, "waiting")
    assert isinstance(drain(wq)[-1].error, EngineFailed)
    assert isinstance(drain(q)[-1].error, EngineFailed)
    deadline = time.monotonic() + 5
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fatal and str(fatal[0]) == "a bug" and not eng.healthy
    with pytest.raises(EngineFailed):
        run(eng, Generate, "after")
    with pytest.raises(EngineFailed):
        eng.call(lambda: 1).result(timeout=1)
    assert eng.in_flight == 0
    assert not eng.stop(timeout=1)


@pytest.mark.parametrize("stuck_in", ["save", "restore"])
def test_abandon_fails_a_request_whose_inline_save_or_restore_is_stuck(tmp_path, stuck_in):
    """A save run inline at a turn's end (--distributed saves there), or the restore of a spilled
    session as its request is placed, stuck in the backend: that request was out of the lists
    `abandon` fails (out of the active runs, not yet saved; out of the queue, not yet running), so
    it was never answered. It now fails with the error, as the others do."""
    import threading

    from localheap.engine import RankLost

    backend = FakeBackend()
    eng, _ = engine_on(tmp_path, backend, durable=True, max_resident=1)
    release, inside = threading.Event(), threading.Event()
    try:
        a = finished(drain(run(eng, Generate, "first session", max_tokens=3)[1])).session_id
        if stuck_in == "restore":
            finished(drain(run(eng, Generate, "second session", max_tokens=3)[1]))   # a is spilled for it
        name = "save_cache" if stuck_in == "save" else "load_cache"
        real = getattr(backend, name)

        def stuck(*args, **kwargs):
            inside.set()
            release.wait()
            return real(*args, **kwargs)

        setattr(backend, name, stuck)
        _, events = run(eng, Generate, "more", session_id=a, max_tokens=3)
        assert inside.wait(5)
        eng.abandon(RankLost("rank lost: the ranks did not answer"))
        last = drain(events, timeout=5)[-1]
        assert isinstance(last, Failed) and isinstance(last.error, RankLost), last
        assert eng.in_flight == 0
    finally:
        release.set()
        eng.stop(timeout=1)


def test_abandon_fails_what_waits_on_a_stuck_backend_call(tmp_path):
    """A backend call that never returns (--distributed: a collective with a rank that is gone):
    `abandon` from another thread fails the running and the queued request with its error, refuses
    later ones with it, /health's engine is unhealthy, and stop() does not wait for the thread. What
    was saved stays saved: the stuck turn is never committed, even when the call comes back later."""
    import threading

    from localheap.engine import RankLost

    backend = FakeBackend()
    eng, _ = engine_on(tmp_path, backend, durable=True)
    release = threading.Event()
    try:
        sid = finished(drain(run(eng, Generate, "saved turn", max_tokens=3)[1])).session_id
        fed = list(eng.store.get(sid).fed)
        stuck_in = threading.Event()
        real_prefill = backend.prefill

        def stuck(cache, tokens, progress=None, cancelled=None):
            stuck_in.set()
            release.wait()
            raise RuntimeError("[ring] connection to a peer was lost")

        backend.prefill = stuck
        _, running = run(eng, Generate, "saved turn and more", session_id=sid, max_tokens=3)
        assert stuck_in.wait(5)
        _, queued = run(eng, Generate, "another", max_tokens=3)
        eng.abandon(RankLost("rank lost: rank 1 ended"))
        for events in (running, queued):
            last = drain(events)[-1]
            assert isinstance(last, Failed) and isinstance(last.error, RankLost), last
        with pytest.raises(RankLost, match="rank 1 ended"):
            run(eng, Generate, "later", max_tokens=3)
        assert eng.call(lambda: None).exception(1) is not None
        assert not eng.healthy and eng.in_flight == 0
        began = time.monotonic()
        assert eng.stop() is False and time.monotonic() - began < 1
        release.set()   # the call comes back after all: its job is over, its turn is not saved
        backend.prefill = real_prefill
        time.sleep(0.2)
        assert eng.in_flight == 0
        reopened = SessionStore(FakeBackend(), CFG, tmp_path / "sessions", durable=True)
        assert reopened.load_persisted("fake-model") == 1
        assert list(reopened.get(sid).fed) == fed
    finally:
        release.set()
        eng.stop()


class RefusingRollbacks(FakeBackend):
    """Every point rolls back, and every rollback is refused with the cache untouched (a rewind whose
    page store's disk refused to forget the reply's pages)."""

    def rollback_floor(self, cache):
        return 0

    def rollback_mark(self, cache):
        return None

    def truncate(self, cache, tokens):
        raise RollbackRefused("the page store did not forget the reply's pages: [Errno 28] No space left")


def test_a_refused_rollback_serves_the_prompt_in_a_new_session_and_keeps_the_old_one(tmp_path):
    eng, _ = engine_on(tmp_path, RefusingRollbacks())
    try:
        first = finished(drain(run(eng, Generate, "tell me about the tides", max_tokens=4)[1]))
        held = list(eng.store.get(first.session_id).fed)
        evs = drain(run(eng, Generate, "tell me about the moon", max_tokens=4)[1])   # would roll back to "tell me about the "
        assert isinstance(evs[0], Started) and evs[0].cached_tokens == 0 and evs[0].session_id != first.session_id
        assert finished(evs).usage.prompt_tokens == len("tell me about the moon")
        assert list(eng.store.get(first.session_id).fed) == held and eng.healthy
        assert (eng.store.rollbacks_refused, eng.store.rollbacks) == (1, 0)
    finally:
        eng.stop()
