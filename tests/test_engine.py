"""Engine: round-robin fairness, cancellation, session bookkeeping, overload; fake backend."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import pytest

from localheap.backends.base import ModelShapes
from localheap.engine import (
    AdmitAll,
    Delta,
    Engine,
    Failed,
    Feed,
    Finished,
    Generate,
    OverBudget,
    Overloaded,
    Progress,
    Started,
    wait_idle,
)
from localheap.engine.detok import TextStream
from localheap.generation import SamplingParams
from localheap.governor import Admission
from localheap.heap import HeapConfig, HeapStats
from localheap.sessions import Prompt, SessionStore

EOS = 0


class CharTokenizer:
    """One token per character (ids are code points); id 0 is EOS."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeCache:
    def __init__(self, cfg):
        self.cfg, self.tokens = cfg, []


class FakeBackend:
    """Feeds tokens into a list; generation replays `reply` and, like the real backends, is
    pipelined: a yielded token is fed before the next one is sampled, the last one is not."""
    name, model_name, weights_bytes = "fake", "fake-model", 0
    eos_token_ids = {EOS}

    def __init__(self, reply="abcdefghijklmnopqrstuvwxyz" * 40, step_s=0.0):
        self.tokenizer = CharTokenizer()
        self.reply, self.step_s = reply, step_s
        self.log: list[tuple[str, int, int]] = []   # (kind, cache id, tokens)
        self.fail_on_prefill = False

    def new_cache(self, cfg):
        return FakeCache(cfg)

    def prefill(self, cache, tokens, progress=None, cancelled=None):
        if self.fail_on_prefill:
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        cache.tokens.extend(tokens)
        self.log.append(("prefill", id(cache), len(tokens)))

    def generate(self, cache, new_tokens, params, progress=None, cancelled=None):
        cache.tokens.extend(new_tokens)
        for i in range(params.max_tokens):
            time.sleep(self.step_s)
            y = ord(self.reply[i % len(self.reply)])
            self.log.append(("decode", id(cache), 1))
            if i + 1 < params.max_tokens:
                cache.tokens.append(y)
            yield y

    def tokens_in_cache(self, cache):
        return len(cache.tokens)

    def stats(self, cache):
        n = len(cache.tokens)
        cap = cache.cfg.sinks + cache.cfg.budget + cache.cfg.slack
        return HeapStats(tokens_seen=n, resident=min(n, cap), evicted=max(0, n - cap), capacity=cap,
                         kv_bytes=1000, evictions=0)

    def heap_bytes(self, cfg):
        return 1000

    def kv_bytes_per_token(self):
        return 4

    def model_shapes(self):
        return ModelShapes(layers=1, hidden=8, intermediate=16, q_heads=1, kv_heads=1, head_dim=2, vocab=256,
                           dtype_bytes=4)

    def save_cache(self, cache, path: Path, snapshot=False):
        Path(path).write_text(json.dumps(cache.tokens))

    def load_cache(self, cfg, path: Path, pages_dir=None):
        cache = FakeCache(cfg)
        cache.tokens = json.loads(Path(path).read_text())
        return cache


CFG = HeapConfig(budget=64, slack=8, recent=8, sinks=4)


def make_engine(backend=None, **kw):
    backend = backend or FakeBackend()
    store = SessionStore(backend, CFG)
    return Engine(backend, store, **kw).start(), backend


def prompt(text):
    ids = [ord(c) for c in text]
    return Prompt(ids, text, ids)


def run(engine, request_cls, text, session_id=None, **params):
    events = queue.Queue()
    if request_cls is Generate:
        req = Generate(prompt(text), SamplingParams(**{"max_tokens": 5, **params}), events.put, session_id)
    else:
        req = Feed(prompt(text), events.put, session_id)
    return engine.submit(req), events


def drain(events, timeout=5.0):
    out = []
    while True:
        e = events.get(timeout=timeout)
        out.append(e)
        if isinstance(e, (Finished, Failed)):
            return out


def text_of(evs):
    return "".join(e.text for e in evs if isinstance(e, Delta))


def test_generate_reports_usage_and_session():
    eng, _ = make_engine()
    try:
        job, q = run(eng, Generate, "hello", max_tokens=5)
        evs = drain(q)
        assert isinstance(evs[0], Started) and evs[0].cached_tokens == 0
        done = evs[-1]
        assert text_of(evs) == "abcde" and done.finish_reason == "length"
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 5)
        # pipelined: the last token was never fed
        assert eng.store.get(done.session_id).fed.tolist() == [ord(c) for c in "helloabcd"]
    finally:
        eng.stop()


def test_prefix_reuse_and_explicit_session():
    eng, _ = make_engine()
    try:
        first = drain(run(eng, Generate, "hello", max_tokens=5)[1])[-1]
        second = drain(run(eng, Generate, "helloabcd and more", max_tokens=3)[1])
        assert second[0].session_id == first.session_id and second[0].cached_tokens == 9
        # explicit id: new text is appended (continuation) when the prompt does not extend it, after the
        # last token of the reply max_tokens cut (sampled, sent, never read)
        third = drain(run(eng, Generate, "XY", session_id=first.session_id, max_tokens=2)[1])
        assert third[0].cached_tokens == 20 and third[-1].usage.prompt_tokens == 20 + 1 + 2
        # an unrelated prompt gets a new session
        other = drain(run(eng, Generate, "zzz", max_tokens=2)[1])
        assert other[0].session_id != first.session_id
    finally:
        eng.stop()


def test_stop_sequence_and_eos():
    eng, backend = make_engine()
    try:
        evs = drain(run(eng, Generate, "hi", max_tokens=20, stop=["def"])[1])
        assert text_of(evs) == "abc" and evs[-1].finish_reason == "stop"
        backend.reply = "xy\x00zz"
        evs = drain(run(eng, Generate, "other", max_tokens=20)[1])
        assert text_of(evs) == "xy" and evs[-1].finish_reason == "stop" and evs[-1].usage.completion_tokens == 3
    finally:
        eng.stop()


def test_round_robin_between_decode_and_prefill():
    """A long document feed and a chat interleave step by step: chunk, token, chunk, token."""
    eng, backend = make_engine(FakeBackend(step_s=0.002))
    try:
        doc_job, doc_q = run(eng, Feed, "d" * (CFG.slack * 20))
        chat_job, chat_q = run(eng, Generate, "chat", max_tokens=10)
        drain(chat_q), drain(doc_q)
        kinds = [k for k, _, _ in backend.log]
        first_decode = kinds.index("decode")
        window = kinds[first_decode:first_decode + 16]
        # after the chat starts, the document never runs two chunks in a row while the chat decodes
        assert all(not (a == b == "prefill") for a, b in zip(window, window[1:])), window
        assert kinds.count("prefill") > 10   # the document was still prefilling meanwhile
        assert kinds[-1] == "prefill"        # and finished after the chat
    finally:
        eng.stop()


def test_cancel_stops_generation_and_keeps_session_consistent():
    eng, backend = make_engine(FakeBackend(step_s=0.002))
    try:
        job, q = run(eng, Generate, "hello", max_tokens=10_000)
        while not isinstance(q.get(timeout=5), Delta):
            pass
        job.cancel()
        done = drain(q)[-1]
        assert done.finish_reason == "cancelled" and done.usage.completion_tokens < 1000
        s = eng.store.get(done.session_id)
        assert not s.busy and len(s.fed) == backend.tokens_in_cache(s.cache)
        assert eng.counters.cancelled == 1 and wait_idle(eng)
    finally:
        eng.stop()


def test_overloaded_and_waiting_for_busy_session():
    eng, _ = make_engine(FakeBackend(step_s=0.002), max_active=1, max_queued=1)
    try:
        a, qa = run(eng, Generate, "first", max_tokens=200)
        sid = qa.get(timeout=5).session_id
        b, qb = run(eng, Generate, "second", session_id=sid, max_tokens=2)   # waits for the session
        with pytest.raises(Overloaded):
            run(eng, Generate, "third")
        assert drain(qa)[-1].finish_reason == "length"
        evs = drain(qb)
        assert evs[0].session_id == sid and evs[-1].finish_reason == "length"
    finally:
        eng.stop()


def test_governor_refusal_and_backend_failure():
    class Refuse(AdmitAll):
        def admit(self, resident, idle_lru):
            return Admission("reject", reason="over budget", retry_after_s=3)

    eng, _ = make_engine(governor=Refuse(), admission_timeout=0.2)   # queued for RAM, then refused
    try:
        evs = drain(run(eng, Generate, "x")[1])
        assert isinstance(evs[-1], Failed) and isinstance(evs[-1].error, OverBudget)
        assert len(eng.store) == 0 and eng.counters.rejected == 1 and eng.counters.failed == 0
    finally:
        eng.stop()
    eng, backend = make_engine()
    try:
        backend.fail_on_prefill = True
        evs = drain(run(eng, Feed, "some document")[1])
        assert isinstance(evs[-1], Failed) and len(eng.store) == 0   # an untrustworthy session is dropped
        backend.fail_on_prefill = False
        assert isinstance(drain(run(eng, Generate, "still alive")[1])[-1], Finished)
    finally:
        eng.stop()


def test_feed_progress_and_delete_while_running():
    eng, _ = make_engine(FakeBackend(step_s=0.002))
    try:
        evs = drain(run(eng, Feed, "d" * (CFG.slack * 3 + 1))[1])
        progress = [e for e in evs if isinstance(e, Progress)]
        assert [p.done for p in progress] == [8, 16, 24, 25] and evs[-1].finish_reason == "fed"
        job, q = run(eng, Generate, "long", max_tokens=10_000)
        sid = q.get(timeout=5).session_id
        eng.call(lambda: eng.delete_session(sid)).result(timeout=5)
        assert drain(q)[-1].finish_reason == "cancelled" and sid not in eng.store
    finally:
        eng.stop()


def test_text_stream_holds_incomplete_utf8_and_stops():
    tok = {1: b"\xe2", 2: b"\x82", 3: b"\xac", 4: b"ab", 5: b"c"}

    def decode(ids):
        return b"".join(tok[i] for i in ids).decode("utf-8", errors="replace")

    ts = TextStream(decode, ["bc"])
    assert ts.add(1) == ("", False) and ts.add(2) == ("", False)
    assert ts.add(3) == ("\u20ac", False)
    assert ts.add(4) == ("a", False)          # "b" held: it may start "bc"
    assert ts.add(5) == ("", True)
    ts = TextStream(decode, [])
    ts.add(4), ts.add(1)
    assert ts.flush() == ("\ufffd", False)


def test_engine_thread_is_the_only_one_touching_the_backend():
    backend = FakeBackend()
    threads = set()
    original = backend.prefill

    def spy(*a, **k):
        threads.add(threading.current_thread().name)
        return original(*a, **k)

    backend.prefill = spy
    eng, _ = make_engine(backend)
    try:
        drain(run(eng, Feed, "x" * 30)[1])
        assert threads == {"localheap-engine"}
    finally:
        eng.stop()
