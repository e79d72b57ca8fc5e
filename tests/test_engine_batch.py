"""The batched engine on the demo model: runs decode together in one forward per step, with the
same tokens as the round-robin engine; cancelling, spilling and failing one run leaves the others'
tokens as they would be alone; a batch smaller than the decoding runs serves them all in turn."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from engine_checks import (CFG, TEXTS, StepLog, alone_texts, chat_beside_document, check_cancel_mid_batch, check_document_rides,
                           check_recall_probes_the_question, check_sliding_sessions_batch, check_turn_recalls_beside_the_batch,
                           drain, engine, ids, replies, requests_for, submit, text, timed_submit, until_deltas)

from localheap.backends.torch import TorchBackend
from localheap.engine import Delta, Engine, Finished, Progress, Started
from localheap.models import demo_model_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def demo():
    return TorchBackend.load(demo_model_dir(), dtype=torch.float32)


@pytest.fixture(scope="module")
def REQUESTS(demo):
    return requests_for(demo)


def needs_lane(backend):
    """The prefill lane is the torch CPU default (engine/lane.py); on CUDA chunks ride in the step."""
    if not getattr(backend, "concurrent_prefill", False):
        pytest.skip(f"the prefill lane runs on the CPU only (this backend is on {backend.device})")


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


def test_sessions_run_ahead_when_alone_with_their_tokens_alone(demo, REQUESTS, monkeypatch):
    """The batch's ahead mode (on CUDA by default, forced here): a session stepping alone has its
    next step queued before its token is read; every session's text is its text alone, and a
    session's next turn (after a stop token, fed ahead) continues from what its cache holds."""
    want = alone_texts(demo, REQUESTS)
    monkeypatch.setattr(demo, "batch_ahead", True)
    log = StepLog(demo, monkeypatch)
    eng = engine(demo)
    try:
        got = replies(eng, REQUESTS)
        first = drain(submit(eng, REQUESTS[1][0], max_tokens=30)[1])
        sid = first[-1].session_id
        stop_id = [i for e in first if isinstance(e, Delta) for i in e.ids][10]
        stopped = drain(submit(eng, [5, 6, 7], session_id=sid, max_tokens=30, stop_token_ids=[stop_id])[1])
        again = drain(submit(eng, [8, 9], session_id=sid, max_tokens=10)[1])
    finally:
        eng.stop()
    assert [t for t, _ in got] == want
    assert sum(q > 0 for q in log.ahead) > 20, "sessions decoded ahead"
    assert text(stopped)[1] == "stop" and text(again)[1] == "length"
    # the stop token was fed ahead and the session's history holds it: the next turn reads only its own
    assert again[-1].prompt_read == 2 and again[-1].usage.cached_tokens == again[-1].usage.prompt_tokens - 2


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_sessions_with_sliding_layers_decode_in_the_batch_with_their_tokens_alone(model_dirs, monkeypatch, family):
    """gemma3 (sdpa) and gpt-oss (eager attention with its sinks): sliding-window sessions in the batch."""
    backend = TorchBackend.load(model_dirs(family), dtype=torch.float32)
    check_sliding_sessions_batch(backend, monkeypatch, lane=False)   # the lane off: chunks ride in the step


def test_cancel_mid_batch_leaves_the_others_untouched(demo, REQUESTS):
    check_cancel_mid_batch(demo, REQUESTS)


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
    check_document_rides(demo, REQUESTS, monkeypatch, lane=False)   # the lane off: chunks ride in the step


class LaneLog:
    """Wraps backend.prefill and step_rows: the thread each chunk was read on, and whether a
    decode step ran while the lane held a chunk."""

    def __init__(self, backend, monkeypatch):
        self.threads: list[str] = []
        self.eng = None
        self.steps_beside = 0
        prefill, step_rows = backend.prefill, backend.step_rows

        self.cores: list[tuple[str, bool, int]] = []   # (thread, lane busy, intra-op threads)

        def spy_prefill(cache, tokens, *a, **k):
            self.threads.append(threading.current_thread().name)
            self.cores.append((self.threads[-1], True, torch.get_num_threads()))
            return prefill(cache, tokens, *a, **k)

        def spy_step(rows, chunks=()):
            busy = self.eng is not None and self.eng.lane.busy
            self.steps_beside += bool(busy and rows)
            self.cores.append(("engine", busy, torch.get_num_threads()))
            return step_rows(rows, chunks)

        monkeypatch.setattr(backend, "prefill", spy_prefill)
        monkeypatch.setattr(backend, "step_rows", spy_step)


def test_a_document_read_on_the_prefill_lane_beside_the_decoding_chat(demo, REQUESTS, monkeypatch):
    """With the lane (the torch CPU default) a document's chunks are read on a second thread while
    the chat decodes; the chat's tokens and the document's heap are exactly theirs alone."""
    needs_lane(demo)
    log = LaneLog(demo, monkeypatch)
    eng = log.eng = engine(demo)
    doc = ids(600, 12)
    try:
        doc_evs, chat_evs = chat_beside_document(eng, REQUESTS[2][0], doc)
        got = eng.store.get(doc_evs[-1].session_id).cache
    finally:
        eng.stop()
    assert doc_evs[-1].finish_reason == "fed" and doc_evs[-1].usage.prompt_tokens == 600
    assert sum(t.startswith("localheap-prefill") for t in log.threads) >= 5, log.threads
    assert log.steps_beside > 0, "the chat decoded while a chunk was read"
    assert text(chat_evs) == alone_texts(demo, [REQUESTS[2]])[0]
    want = demo.new_cache(CFG)
    demo.prefill(want, doc)
    for a, b in zip(want.heap_layers, got.heap_layers):
        n = a.heap.resident
        assert n == b.heap.resident and np.array_equal(a.heap.view_positions(), b.heap.view_positions())
        assert torch.equal(a.keys[0, :, :n], b.keys[0, :, :n]) and torch.equal(a.values[0, :, :n], b.values[0, :, :n])


def test_turns_that_start_together_read_their_prompts_in_one_pass(demo, REQUESTS, monkeypatch):
    """Four chats arriving together on the lane engine (the torch CPU default): the three prompts
    shorter than a mixed chunk are read in one forward before any decodes (none waits for the
    lane, which reads one chunk at a time); the longer one goes to the lane once the others
    decode, until what is left of it rides too; each reply is its reply alone."""
    needs_lane(demo)
    calls, threads = [], []
    step_rows, prefill = demo.step_rows, demo.prefill

    def spy_step(rows, chunks=()):
        calls.append((len(rows), len(chunks)))
        return step_rows(rows, chunks)

    def spy_prefill(cache, tokens, *a, **k):
        threads.append((threading.current_thread().name, len(tokens)))
        return prefill(cache, tokens, *a, **k)

    monkeypatch.setattr(demo, "step_rows", spy_step)
    monkeypatch.setattr(demo, "prefill", spy_prefill)
    lengths = [len(toks) - 1 for toks, _ in REQUESTS]   # each prompt's last token starts its decode
    assert sorted(n > 64 for n in lengths) == [False, False, False, True], lengths
    eng = engine(demo)
    try:
        hold = eng.call(lambda: time.sleep(0.5))   # the four land in the inbox together
        jobs = [submit(eng, toks, **p) for toks, p in REQUESTS]
        hold.result(30)
        got = [text(drain(q)) for _, q in jobs]
    finally:
        eng.stop()
    assert calls[0] == (0, 3), calls[:3]
    assert [t for t, _ in threads] and all(t.startswith("localheap-prefill") for t, _ in threads), threads
    # the lane reads the long prompt while more than a mixed chunk of it is left; the rest rides
    assert [n for _, n in threads] == [max(lengths) - 64], threads
    assert got == alone_texts(demo, REQUESTS)


def test_a_document_cancelled_or_deleted_while_the_lane_reads_it(demo, REQUESTS):
    """A cancel lands between chunks: the session keeps whole chunks, its history matching its
    cache; deleting a session whose chunk is in flight waits for the chunk, then forgets it."""
    eng = engine(demo)
    try:
        chat_job, chat_q = submit(eng, REQUESTS[2][0], max_tokens=10**6)
        seen = until_deltas(chat_q, 1)
        doc_job, doc_q = submit(eng, ids(3000, 13), feed=True)
        evs = []
        while sum(isinstance(e, Progress) for e in evs) < 3:
            evs.append(doc_q.get(timeout=60))
        doc_job.cancel()
        evs = drain(doc_q, out=evs)
        assert evs[-1].finish_reason == "cancelled", evs[-1]
        eng.call(lambda: None).result(60)   # a command: the lane has given back any chunk
        s = eng.store.get(evs[-1].session_id)
        read = len(s.fed)
        assert 0 < read < 3000 and read % CFG.chunk == 0 and demo.tokens_in_cache(s.cache) == read
        assert evs[-1].prompt_read == read, "the cancelled reply says what the session kept"
        other_job, other_q = submit(eng, ids(3000, 14), feed=True)
        first = []
        while not any(isinstance(e, Progress) for e in first):
            first.append(other_q.get(timeout=60))
        sid = next(e.session_id for e in first if isinstance(e, Started))
        eng.call(lambda: eng.delete_session(sid)).result(60)
        assert drain(other_q, out=first)[-1].finish_reason == "cancelled"
        assert sid not in eng.store
        chat_job.cancel()
        assert text(drain(chat_q, out=seen))[1] == "cancelled"
    finally:
        eng.stop()


def test_the_lane_and_the_engine_thread_split_the_cores(demo, REQUESTS, monkeypatch):
    """With 4 intra-op threads: 2 on the lane and 2 on the engine thread while a chunk is in
    flight, 4 on the engine thread when the lane is idle."""
    needs_lane(demo)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        log = LaneLog(demo, monkeypatch)
        eng = log.eng = engine(demo)
        try:
            chat_beside_document(eng, REQUESTS[2][0], ids(400, 15), max_tokens=60)
        finally:
            eng.stop()
    finally:
        torch.set_num_threads(before)
    lane = {n for t, _, n in log.cores if t.startswith("localheap-prefill")}
    beside = {n for t, busy, n in log.cores if t == "engine" and busy}
    idle = {n for t, busy, n in log.cores if t == "engine" and not busy}
    assert lane == {2} and beside == {2} and idle == {4}, (lane, beside, idle)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_page_outs_between_steps_write_the_pages_of_the_writer_thread(demo, REQUESTS, policy):
    """With recall on, a session evicts while it decodes in the batch. Its page-outs run between the
    engine's steps (page_out "steps", the CPU default) or on its writer's thread ("thread"): the same
    tokens, and the same page files byte for byte (one session at a time: which rows share a step
    depends on timing, and a row's K/V bits with it, so concurrent runs need not match bytes; so does
    whether the slab kernel is built yet, so it is built first). In
    "steps" the parts ran on the engine thread, never in the step whose eviction event queued them
    (that step is the long one) unless the step before it had left its slice out too; in "thread"
    none was left to it."""
    from localheap.engine import engine as engine_module
    from localheap.heap.recall import PageWriter
    from localheap.sessions import SessionStore

    from localheap.backends.torch import slab_cpu

    # the CPU's default; on a GPU the writer's thread (the steps do not compute on the cores there)
    assert engine_module.page_out_mode(demo) == ("steps" if demo.device.type == "cpu" else "thread")
    slab_cpu.load(wait=True)   # steps before the kernel is built attend through torch: other bits
    cfg = CFG.with_(recall=True, recall_budget=16, page_size=4, policy=policy)
    runs = {}
    for mode in ("steps", "thread"):
        ran_on, steps, engines = [], {"queued": set(), "ran": set()}, []
        real, real_submit = PageWriter.run_parts, PageWriter.submit_parts

        def spy(self, until=float("inf"), real=real, ran_on=ran_on, steps=steps, engines=engines):
            before = len(self._parts)
            real(self, until)
            if before > len(self._parts):
                ran_on.append((threading.current_thread().name, before - len(self._parts), until))
                if until != float("inf"):
                    steps["ran"].add(engines[0]._steps)

        def spy_submit(self, parts, real=real_submit, steps=steps, engines=engines):
            steps["queued"].add(engines[0]._steps)
            real(self, parts)

        PageWriter.run_parts, PageWriter.submit_parts = spy, spy_submit
        try:
            eng = Engine(demo, SessionStore(demo, cfg), page_out=mode)
            engines.append(eng)
            eng.start()
            try:
                got = [replies(eng, [(toks, {**p, "max_tokens": 100})])[0] for toks, p in REQUESTS]
                texts = [t for t, _ in got]
                files = {}
                for i, (_, end) in enumerate(got):
                    cache = eng.store.get(end.session_id).cache
                    cache.writer.drain()
                    files[i] = [p.read_bytes() for p in sorted(cache.pages.root.glob("layer*.pages"))]
                    assert cache.pages.written > 0, "the session paged out while it decoded"
            finally:
                eng.stop()
        finally:
            PageWriter.run_parts, PageWriter.submit_parts = real, real_submit
        runs[mode] = texts, files, ran_on
        if mode == "steps":
            assert steps["queued"] and steps["ran"], steps
            # a step that queued parts runs none, unless the step before it left its slice out too
            assert all(s - 1 in steps["queued"] and s - 1 not in steps["ran"]
                       for s in steps["queued"] & steps["ran"]), steps
    assert runs["steps"][:2] == runs["thread"][:2]
    between = [r for r in runs["steps"][2] if r[2] != float("inf")]
    assert between and all(name == "localheap-engine" for name, _, _ in between)
    assert not [r for r in runs["thread"][2] if r[2] != float("inf")], "no parts left to the engine in thread mode"


@pytest.mark.parametrize("fail", [False, True], ids=["saved", "refused"])
def test_a_finished_turn_is_saved_off_the_engine_thread_while_the_others_decode(demo, tmp_path, monkeypatch, fail):
    """A durable store: a finished turn's heap file is written on the saver thread (slowed here to
    0.4 s, a big heap on a slow disk) while the other session keeps decoding; its reply ends only
    once the turn is committed (or says why not: a write the disk refused), and a checkpoint asked
    for meanwhile waits for the save. The other session's tokens are its tokens alone. The saver computes
    on one thread (a second OpenMP team beside the engine's halved its decode speed here)."""
    from localheap.sessions import SessionStore

    store = SessionStore(demo, CFG, tmp_path / "sessions", durable=True)
    real, spans, entered = store.write_heap, [], [threading.Event(), threading.Event()]

    def slow(s):
        entered[len(spans)].set()
        began = time.monotonic()
        time.sleep(0.4)
        try:
            if fail:
                raise OSError(28, "No space left on device")
            return real(s)
        finally:
            spans.append((threading.current_thread().name, began, time.monotonic(), torch.get_num_threads()))

    monkeypatch.setattr(store, "write_heap", slow)
    eng = Engine(demo, store).start()
    try:
        long_tokens = demo.tokenizer.encode(TEXTS[2], add_special_tokens=False)   # 400 tokens greedy, no stop
        _, short, short_done = timed_submit(eng, ids(30, 4), max_tokens=3)
        _, long, long_done = timed_submit(eng, long_tokens, max_tokens=400)
        assert short_done.wait(60) and entered[1].wait(120)   # the long one's turn is being saved
        sid, long_sid = short[0][1].session_id, long[0][1].session_id
        # a checkpoint waits for the save in flight (the session is busy until then)
        assert eng.call(lambda: eng.checkpoint_session(long_sid)).result(timeout=30).n > 0
        assert long_done.is_set()
    finally:
        eng.stop()
    name, began, ended, threads = spans[0]
    assert name.startswith("localheap-saver") and threads == 1   # no second OpenMP team beside the engine's
    during = [t for t, ev in long if isinstance(ev, Delta) and began < t < ended]
    assert len(during) >= 10, f"{len(during)} tokens of the other session while the turn was saved"
    t_end, end = short[-1]
    assert isinstance(end, Finished) and t_end >= ended
    if fail:
        assert end.saved is False and "No space left" in end.save_error
        assert sid in eng.unsaved and not store.get(sid).saved
    else:
        assert end.saved is True and store.get(sid).saved and store.get(sid).spill_path.exists()
    got = "".join(ev.text for _, ev in long if isinstance(ev, Delta))
    assert got == alone_texts(demo, [(long_tokens, {"max_tokens": 400})])[0][0]


def test_deleting_a_decoding_session_of_a_durable_store(demo, tmp_path):
    """DELETE while the session decodes: its run is cancelled, and the save that ending it starts
    (on the saver thread) is waited for before the session is removed: the delete succeeds and
    leaves none of its files."""
    from localheap.sessions import SessionStore

    store = SessionStore(demo, CFG, tmp_path / "sessions", durable=True)
    eng = Engine(demo, store).start()
    try:
        tokens = demo.tokenizer.encode(TEXTS[2], add_special_tokens=False)
        _, events, done = timed_submit(eng, tokens, max_tokens=400)
        deadline = time.monotonic() + 60
        while sum(isinstance(ev, Delta) for _, ev in events) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        sid = events[0][1].session_id
        eng.call(lambda: eng.delete_session(sid)).result(timeout=30)
        assert done.wait(30) and events[-1][1].finish_reason == "cancelled"
        assert sid not in store and not list((tmp_path / "sessions").glob(f"{sid}*"))
    finally:
        eng.stop()


def test_runs_ending_in_one_step_all_send_their_last_token_before_any_run_ends(demo, REQUESTS, monkeypatch):
    """A run's end (closing its row, settling its session, the reply's last event) costs a few ms;
    in a step where several runs finish, every run's last token goes out first, then they end
    (before, the k-th run's last token waited for the k-1 ends before it)."""
    from localheap.engine.runs import Run

    order, engines = [], []
    real_take, real_finish = Run.take, Engine._finish

    def take(self, token):
        real_take(self, token)
        if engines and engines[0]._steps >= 12 and self.finish_reason is None:   # all end in one step
            self._finish_text("length")
        order.append(("take", id(self), engines[0]._steps if engines else -1))

    def finish(self, run):
        order.append(("end", id(run), self._steps))
        real_finish(self, run)

    monkeypatch.setattr(Run, "take", take)
    monkeypatch.setattr(Engine, "_finish", finish)
    eng = engine(demo, batched=True)
    engines.append(eng)
    try:
        got = replies(eng, [(toks, {**p, "max_tokens": 60}) for toks, p in REQUESTS[:3]])
    finally:
        eng.stop()
    assert all(f.finish_reason == "length" for _, f in got)
    ends = {}
    for kind, _, step in order:
        if kind == "end":
            ends[step] = ends.get(step, 0) + 1
    step = max(ends, key=ends.get)
    assert ends[step] >= 2, "runs ended together in a batched step"
    in_step = [kind for kind, _, s in order if s == step]
    assert in_step == sorted(in_step, key=lambda k: k == "end"), in_step   # every take, then every end


def test_a_turn_after_a_paged_out_document_recalls_for_its_question(demo, tmp_path):
    check_recall_probes_the_question(demo, tmp_path)


def test_a_turn_recalls_while_the_other_sessions_decode(demo, tmp_path, monkeypatch):
    check_turn_recalls_beside_the_batch(demo, tmp_path, monkeypatch)
