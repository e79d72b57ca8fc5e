"""What the batched-engine tests of both backends share: an engine over a store, requests
submitted with their event queues, replies read back as text, and a spy on step_rows."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np

from localheap.engine import Delta, Engine, Failed, Feed, Finished, Generate, Progress, Started, wait_idle
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig
from localheap.sessions import Prompt, SessionStore

CFG = HeapConfig(budget=48, sinks=4, recent=8, slack=16, prefill_chunk=32)


class StepLog:
    """Wraps step_rows: which sessions' rows each batched step advanced, whether a chunk rode, and
    how many rows had their next step queued ahead after it."""

    def __init__(self, backend, monkeypatch):
        self.steps: list[tuple[list[int], bool]] = []
        self.ahead: list[int] = []
        real = backend.step_rows

        def spy(rows, chunks=()):
            self.steps.append(([id(r.cache) for r in rows], bool(chunks)))
            errors = real(rows, chunks)
            self.ahead.append(sum(getattr(r, "ahead", None) is not None for r in rows))
            return errors

        monkeypatch.setattr(backend, "step_rows", spy)


def engine(backend, tmp_path=None, **kw):
    store = SessionStore(backend, CFG, spill_dir=tmp_path)
    return Engine(backend, store, **kw).start()


def ids(n, seed):
    return np.random.default_rng(seed).integers(10, 1000, n).tolist()


def submit(eng, tokens, session_id=None, feed=False, starts=None, **params):
    """(job, its event queue); `starts` (a list) gets the request when it starts, in engine order."""
    events = queue.Queue()

    def emit(ev):
        if starts is not None and isinstance(ev, Started):
            starts.append(req)
        events.put(ev)

    prompt = Prompt(tokens)
    if feed:
        req = Feed(prompt, emit, session_id)
    else:
        req = Generate(prompt, SamplingParams(**{"max_tokens": 20, **params}), emit, session_id)
    return eng.submit(req), events


def until_deltas(events, n: int, timeout=60.0) -> list:
    """Events up to the n-th Delta (hand them to drain after)."""
    out = []
    while sum(isinstance(e, Delta) for e in out) < n:
        out.append(events.get(timeout=timeout))
        assert not isinstance(out[-1], (Finished, Failed)), out[-1]
    return out


def drain(events, timeout=60.0, out=None):
    out = [] if out is None else out
    while True:
        ev = events.get(timeout=timeout)
        out.append(ev)
        if isinstance(ev, (Finished, Failed)):
            return out


def text(evs):
    """The reply's text, how it ended and its token count."""
    end = evs[-1]
    assert isinstance(end, Finished), end
    return "".join(e.text for e in evs if isinstance(e, Delta)), end.finish_reason, end.usage.completion_tokens


def replies(eng, requests):
    """Submit all, then drain all: (text, finish event) per request."""
    queues = [submit(eng, toks, **params)[1] for toks, params in requests]
    outs = [drain(q) for q in queues]
    return [(text(evs), evs[-1]) for evs in outs]


TEXTS = ("The pass key of honey is 44444. The pass key of river is",
         "Remember this. " * 12 + "The pass key of stone is 12345. The pass key of moon is",
         "The pass key of cloud is 777. The pass key of lamp is 31. The pass key of",
         "The pass key")


def requests_for(backend) -> list:
    """The four chat requests (token ids, params) with different lengths and max_tokens."""
    encode = lambda t: backend.tokenizer.encode(t, add_special_tokens=False)   # noqa: E731
    return [(encode(t), {"max_tokens": m}) for t, m in zip(TEXTS, (30, 18, 40, 25))]


def alone_texts(demo, requests):
    eng = engine(demo, batched=False, max_active=1)
    try:
        return [text for text, _ in (replies(eng, [r])[0] for r in requests)]
    finally:
        eng.stop()


def batched_texts(demo, requests):
    """The requests' replies, run together in one batched engine."""
    eng = engine(demo, batched=True)
    try:
        return [t for t, _ in replies(eng, requests)]
    finally:
        eng.stop()


def check_params_ride_the_batch(demo, extra: dict) -> None:
    """Four chats in one batch, two of them with `extra` sampling params (greedy): each reply is the
    one it gets alone, and the changed replies are not the plain ones (the params reach the step)."""
    plain = requests_for(demo)
    reqs = [(toks, {**params, **(extra if i % 2 else {})}) for i, (toks, params) in enumerate(plain)]
    want = alone_texts(demo, reqs)
    assert batched_texts(demo, reqs) == want
    unchanged = alone_texts(demo, [plain[1], plain[3]])
    assert all(a != b for a, b in zip([want[1], want[3]], unchanged)), (want, unchanged)


def greedy_on_both_backends(params: SamplingParams, logits: np.ndarray) -> list[list[int]]:
    """The greedy ids each backend's sampler takes from these rows of logits, one list per backend
    (torch's, then MLX's where mlx is installed; MLX given no logprobs: its sampler makes them)."""
    import torch

    from localheap.backends.torch.generate import Sampler

    sampler = Sampler(params, torch.device("cpu"))
    out = [[int(sampler.sample(torch.from_numpy(row))) for row in logits]]
    try:
        import mlx.core as mx
    except ImportError:
        return out
    from localheap.backends.mlx.generate import Sampler as MLXSampler

    sample = MLXSampler(params)
    return out + [[int(sample(mx.array(row[None])).item()) for row in logits]]


def chat_beside_document(eng, chat_tokens, doc, max_tokens: int = 40) -> tuple[list, list]:
    """A chat decodes; after its first token a document is fed beside it. (document's events,
    chat's events), both to their end."""
    _, chat_q = submit(eng, chat_tokens, max_tokens=max_tokens)
    seen = until_deltas(chat_q, 1)
    _, doc_q = submit(eng, doc, feed=True)
    return drain(doc_q), drain(chat_q, out=seen)


def check_cancel_mid_batch(backend, requests) -> None:
    """Three runs decode in one batch; the middle one is cancelled mid-stream: the others' texts
    are theirs alone, and the cancelled session's history matches its cache."""
    requests = list(requests[:3])
    # the victim never ends before its cancel arrives, however fast the machine (its text is not compared)
    requests[1] = (requests[1][0], {**requests[1][1], "max_tokens": 10_000})
    want = alone_texts(backend, [requests[0], requests[2]])
    eng = engine(backend)
    try:
        jobs = [submit(eng, toks, **p) for toks, p in requests]
        seen = until_deltas(jobs[1][1], 5)   # the victim is mid-stream, in the batch with the others
        jobs[1][0].cancel()
        outs = [drain(q, out=seen if i == 1 else None) for i, (_, q) in enumerate(jobs)]
        assert text(outs[1])[1] == "cancelled"
        assert [text(outs[0]), text(outs[2])] == want
        assert wait_idle(eng)
        s = eng.store.get(outs[1][-1].session_id)
        assert not s.busy and len(s.fed) == backend.tokens_in_cache(s.cache)
    finally:
        eng.stop()


def check_document_rides(backend, requests, monkeypatch, **kw) -> None:
    """A chat decodes while a document is fed: chunks ride in the decode steps, the document
    reports its progress, and the chat's text is its text alone."""
    log = StepLog(backend, monkeypatch)
    eng = engine(backend, mixed_chunk=16, **kw)
    try:
        doc_evs, chat_evs = chat_beside_document(eng, requests[2][0], ids(600, 12))
    finally:
        eng.stop()
    assert doc_evs[-1].finish_reason == "fed" and doc_evs[-1].usage.prompt_tokens == 600
    assert any(rode for _, rode in log.steps), "document chunks rode in decode steps"
    assert sum(isinstance(e, Progress) for e in doc_evs) > 5
    assert text(chat_evs) == alone_texts(backend, [requests[2]])[0]


def check_recall_probes_the_question(backend, tmp_path) -> None:
    """With recall on, a turn after a document that paged out recalls what `generate` on the whole
    turn recalls (its probe is the turn's question, the last obs_window tokens, not only the
    prompt's last token): the same recalled positions in every layer, and the same reply, on the
    batched and the round-robin engine."""
    cfg = CFG.with_(recall=True, recall_budget=16, page_size=4)
    doc = ids(400, 11)
    turn = backend.tokenizer.encode(TEXTS[1], add_special_tokens=False)
    assert len(turn) > cfg.slack   # the question (the last min(obs_window, slack) tokens) is part of it

    def recalled(cache):
        return [layer.heap.positions[layer.heap.recalled].tolist() for layer in cache.heap_layers]

    ref = backend.new_cache(cfg, pages_dir=tmp_path / "ref")
    backend.prefill(ref, doc)
    want_tokens = []
    for token in backend.generate(ref, turn, SamplingParams(max_tokens=12)):
        if token in backend.eos_token_ids:   # the engine's reply ends there
            break
        want_tokens.append(token)
    want = recalled(ref)
    assert sum(map(len, want)) > 0, "the question recalled nothing: the check would say nothing"
    for batched in (True, False):
        store = SessionStore(backend, cfg, spill_dir=tmp_path / f"spill-{batched}")
        eng = Engine(backend, store, batched=batched).start()
        try:
            fed = drain(submit(eng, doc, feed=True)[1])
            sid = fed[-1].session_id
            out = drain(submit(eng, turn, session_id=sid, max_tokens=12)[1])
            got = eng.call(lambda: recalled(store.get(sid).cache)).result(timeout=30)
        finally:
            eng.stop()
        assert text(out)[0] == backend.tokenizer.decode(want_tokens), batched
        assert got == want, batched


def timed_submit(eng, tokens, **params):
    """(job, events): every event with the monotonic time it was emitted."""
    events: list = []
    done = threading.Event()

    def emit(ev):
        events.append((time.monotonic(), ev))
        if isinstance(ev, (Finished, Failed)):
            done.set()

    job = eng.submit(Generate(Prompt(tokens), SamplingParams(**{"max_tokens": 20, **params}), emit))
    return job, events, done


def check_turn_recalls_beside_the_batch(demo, tmp_path, monkeypatch) -> None:
    """A session that paged a document out starts a turn while another session decodes: its
    recall's pick runs on the backend's picker thread, and the decoding session keeps getting
    tokens until the pick is done (with the pick inside the step it would get none: the test
    holds the pick until the chat has sent 5 more). The turn's reply is then generate's."""
    from localheap.backends import paging

    cfg = CFG.with_(recall=True, recall_budget=16, page_size=4)
    doc, turn = ids(400, 11), demo.tokenizer.encode(TEXTS[1], add_special_tokens=False)
    ref = demo.new_cache(cfg, pages_dir=tmp_path / "ref")
    demo.prefill(ref, doc)
    want = []
    for token in demo.generate(ref, turn, SamplingParams(max_tokens=12)):
        if token in demo.eos_token_ids:
            break
        want.append(token)
    held_at, go, real = [], threading.Event(), paging.recall_pick

    def held(cache, recalling):
        held_at.append(time.monotonic())
        assert go.wait(60), "the test never let the pick go"
        return real(cache, recalling)

    store = SessionStore(demo, cfg, spill_dir=tmp_path / "spill")
    eng = Engine(demo, store).start()
    try:
        sid = drain(submit(eng, doc, feed=True)[1])[-1].session_id
        chat_prompt = demo.tokenizer.encode("1, 2, 3, 4, 5, 6, 7,", add_special_tokens=False)   # no early end
        _, chat, chat_done = timed_submit(eng, chat_prompt, max_tokens=300)
        monkeypatch.setattr(paging, "recall_pick", held)
        _, asked = submit(eng, turn, session_id=sid, max_tokens=12)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                held_at and sum(isinstance(e, Delta) and t > held_at[0] for t, e in list(chat)) >= 5):
            time.sleep(0.01)
        during = sum(isinstance(e, Delta) and t > held_at[0] for t, e in list(chat)) if held_at else 0
        go.set()
        out = drain(asked)
        assert chat_done.wait(60)
    finally:
        go.set()
        eng.stop()
    assert len(held_at) == 1 and during >= 5, "the chat decoded while the pick was held"
    assert text(out)[0] == demo.tokenizer.decode(want)
    assert isinstance(chat[-1][1], Finished)


@contextlib.contextmanager
def decoding_rows(eng, backend, method: str):
    """While inside: each call of backend.<method> appends how many of the engine's runs held a
    decode row at that moment to the list this yields (was it read beside the batch?)."""
    rows: list[int] = []
    real = getattr(backend, method)

    def spy(*args):
        rows.append(sum(r.row is not None for r in eng._active))
        return real(*args)

    setattr(backend, method, spy)
    try:
        yield rows
    finally:
        delattr(backend, method)


def check_sliding_sessions_batch(backend, monkeypatch, **kw) -> None:
    """Sessions whose model keeps sliding-window layers (gemma3, gpt-oss) decode together in the
    batch, past their heap budget and their window, with the text each gets alone; a second turn
    of each (its first prompt and a new message, without the reply: the session found by its
    prefix rolls back to its mark, as where a template drops the reply's reasoning) too; a
    document's chunks ride beside a chat."""
    requests = [(ids(40, 1), {"max_tokens": 12}), (ids(25, 2), {"max_tokens": 9}), (ids(70, 3), {"max_tokens": 40})]
    follow = [(ids(20, 4 + i), {"max_tokens": 10}) for i in range(len(requests))]

    def two_turns(eng) -> list[str]:
        out = []
        for turn in (requests, [(r[0] + f[0], f[1]) for r, f in zip(requests, follow)]):
            queues = [submit(eng, toks, **params)[1] for toks, params in turn]
            evs = [drain(q) for q in queues]
            out += [(text(e)[0], e[0].cached_tokens) for e in evs]
        return out

    alone = engine(backend, batched=False, max_active=1)
    try:
        want = []
        for turn in (requests, [(r[0] + f[0], f[1]) for r, f in zip(requests, follow)]):
            for toks, params in turn:
                evs = drain(submit(alone, toks, **params)[1])
                want.append((text(evs)[0], evs[0].cached_tokens))
    finally:
        alone.stop()
    assert [c for _, c in want[len(requests):]] == [len(t) - 1 for t, _ in requests], "each second turn reused its session"
    log = StepLog(backend, monkeypatch)
    eng = engine(backend, **kw)
    try:
        assert eng.batched and backend.batchable(backend.new_cache(CFG))
        assert two_turns(eng) == want
    finally:
        eng.stop()
    assert max(len(rows) for rows, _ in log.steps) == len(requests), "the sessions decoded in one step"
    check_document_rides(backend, requests, monkeypatch, **kw)
