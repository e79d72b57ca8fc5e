"""The real server (uvicorn in a thread, tiny random MLX model) driven by the official
OpenAI SDK: chat and completions, streamed and not, stops, seeds, sessions, cancellation."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

pytest.importorskip("mlx.core")
openai = pytest.importorskip("openai")

from localheap.heap import HeapConfig  # noqa: E402
from localheap.server import ServerSettings, create_app  # noqa: E402
from localheap.server.testing import ServerThread  # noqa: E402

MODEL = "random:llama:tiny"
# h2o: with it this random model's greedy reply to "Never stop." runs the full 5000 tokens (~6 s),
# which the cancel tests need; under snapkv's evictions it ends (EOS) after 373 tokens, in < 0.5 s.
HEAP = HeapConfig(budget=64, slack=32, recent=16, policy="h2o")


def load_mlx_backend():
    """The tiny random model on MLX, built once per machine and cached on disk."""
    from localheap.models import load_backend

    return load_backend(MODEL, "mlx")


@pytest.fixture(scope="module")
def server():
    app = create_app(load_mlx_backend(), ServerSettings(heap=HEAP, web_dir=None))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, content, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def streamed_text(stream):
    parts, chunks = [], list(stream)
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            parts.append(c.choices[0].delta.content)
    return "".join(parts), chunks


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_non_streamed_chat(client):
    r = ask(client, "Tell me about lists.", max_tokens=16)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop") and r.object == "chat.completion"
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.localheap
    assert ext["session_id"].startswith("sess_") and ext["heap"]["capacity"] == 4 + 64 + 32
    assert ext["heap"]["tokens_seen"] <= r.usage.total_tokens


def test_streamed_chat_matches_non_streamed_and_reports_usage(client):
    full = ask(client, "What is a tuple?", max_tokens=30)
    text, chunks = streamed_text(ask(client, "What is a tuple?", max_tokens=30, stream=True,
                                     stream_options={"include_usage": True}))
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert "heap" in finish[0].localheap
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_sequences(client):
    text = ask(client, "Explain dictionaries.", max_tokens=40).choices[0].message.content
    assert len(text) > 12, text
    stop = text[8:11]
    cut = text.find(stop)
    r = ask(client, "Explain dictionaries.", max_tokens=40, stop=stop)
    assert r.choices[0].message.content == text[:cut] and r.choices[0].finish_reason == "stop"
    streamed, _ = streamed_text(ask(client, "Explain dictionaries.", max_tokens=40, stop=["\x00never", stop],
                                    stream=True))
    assert streamed == text[:cut]


def test_same_seed_same_text(client):
    runs = [ask(client, "Write a poem.", temperature=0.9, seed=s, max_tokens=20).choices[0].message.content
            for s in (123, 123, 7)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_two_sessions_at_once(client):
    prompts = ["First conversation about loops.", "Second conversation about classes."]
    solo = {p: ask(client, p, max_tokens=60).choices[0].message.content for p in prompts}
    results, spans = {}, {}

    def chat(p):
        t0 = time.monotonic()
        text, chunks = streamed_text(ask(client, p, max_tokens=60, stream=True))
        results[p] = (text, chunks[0].localheap["session_id"])
        spans[p] = (t0, time.monotonic())

    threads = [threading.Thread(target=chat, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {p: results[p][0] for p in prompts} == solo   # greedy text unchanged by interleaving
    assert results[prompts[0]][1] != results[prompts[1]][1]
    (a0, a1), (b0, b1) = spans.values()
    assert a0 < b1 and b0 < a1   # the two streams overlapped in time


def test_second_turn_reuses_the_session(client):
    history = [{"role": "user", "content": "Hello there, how are you?"}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=20, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And what else?"}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=10, temperature=0)
    assert second.localheap["session_id"] == first.localheap["session_id"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens and cached < second.usage.prompt_tokens


def test_explicit_session_header(client, server):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Remember the word banana."}], max_tokens=8, temperature=0)
    sid = raw.headers["x-session-id"]
    first = raw.parse()
    assert first.localheap["session_id"] == sid
    tokens_before = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens"]
    # only the new message: it is appended to the session's history
    nxt = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Which word?"}],
                                         max_tokens=8, temperature=0, extra_headers={"X-Session-Id": sid})
    assert nxt.localheap["session_id"] == sid
    assert nxt.usage.prompt_tokens_details.cached_tokens == tokens_before


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.localheap["session_id"]
    parts = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == r.choices[0].text


def test_cancel_on_disconnect(client, server):
    svc = server.services
    cancelled = svc.engine.counters.cancelled
    stream = ask(client, "Go on forever.", max_tokens=5000, stream=True)
    sid = None
    for i, chunk in enumerate(stream):
        sid = sid or chunk.localheap["session_id"]
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while svc.store.info(sid)["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    # stopped well before 5000 tokens (with room for the disconnect's noticing on a far faster machine)
    assert not info["busy"] and info["tokens"] < 2500
    assert svc.engine.counters.cancelled == cancelled + 1
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens"] == info["tokens"]


def test_non_streamed_request_is_cancelled_when_the_client_leaves(server):
    svc = server.services
    cancelled = svc.engine.counters.cancelled
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Never stop."}], "max_tokens": 5000,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while svc.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.engine.in_flight == 0 and svc.engine.counters.cancelled == cancelled + 1


def test_a_named_session_whose_reply_ended_alone_holds_one_end_of_turn(client, server, force):
    """MLX: a reply decoding alone runs a step ahead, so its ending EOS was read before the run saw it
    end; the next turn, sent alone on the session, does not write that end of turn again (the session
    held `reply<|end|><|end|><|user|>`): it holds what the whole history renders, as beside another row."""
    from localheap.server.prompts import chat_prompt
    from localheap.server.schemas import ChatMessage

    svc = server.services
    sid = httpx.post(server.url + "/v1/sessions", json={}, timeout=60).json()["id"]
    force("First reply.")
    ask(client, "one", extra_headers={"X-Session-Id": sid})
    force("Second.")
    ask(client, "two", extra_headers={"X-Session-Id": sid})
    whole = list(chat_prompt(svc.tokenizer, [ChatMessage(role="user", content="one"),
                                             ChatMessage(role="assistant", content="First reply."),
                                             ChatMessage(role="user", content="two")]).tokens)
    fed = list(svc.store.get(sid).fed)
    assert fed[:len(whole)] == whole, svc.tokenizer.decode(fed)
