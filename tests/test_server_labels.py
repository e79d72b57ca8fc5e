"""What the web UI needs from the server beyond OpenAI's routes: sessions know where they
came from (the web UI's conversations or API clients) and carry a title, kept across a
restart; POST /v1/tokenize counts with the model's tokenizer, bounded; the first heap event
carries the history a page that just loaded has not seen. Fake backend: no model needed."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from test_engine import CharTokenizer, FakeBackend

from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.schemas import TOKENIZE_MAX_CHARS
from localheap.sessions.session import HISTORY_POINTS, TITLE_CHARS, Session

LOCAL = "http://127.0.0.1:8000"   # the Host a browser on this machine sends (others are refused)
HEAP = HeapConfig(budget=64, sinks=4, recent=8, slack=32)
WEB = {"X-Localheap-Client": "web"}


class TemplateTokenizer(CharTokenizer):
    """One token a character, and a minimal chat template."""
    chat_template = "minimal"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def app_for(tmp_path, **kw):
    backend = FakeBackend()
    backend.tokenizer = TemplateTokenizer()
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, **kw)
    return create_app(backend, settings)


@pytest.fixture
def client(tmp_path):
    with TestClient(app_for(tmp_path), base_url=LOCAL) as c:
        yield c


def chat(client, text, session=None, **kw):
    headers = {"X-Session-Id": session} if session else {}
    r = client.post("/v1/chat/completions", headers=headers, json={
        "model": "fake-model", "messages": [{"role": "user", "content": text}], "max_tokens": 3, **kw})
    assert r.status_code == 200, r.text
    return r.headers["X-Session-Id"]


def test_web_sessions_and_api_sessions_are_told_apart_and_titled(client):
    web = client.post("/v1/sessions", headers=WEB).json()
    assert web["origin"] == "web" and web["title"] is None
    chat(client, "  What is   a heap?\n", session=web["id"])
    assert client.get(f"/v1/sessions/{web['id']}").json()["title"] == "What is a heap?"
    chat(client, "A second question", session=web["id"])   # the first message names it, once
    assert client.get(f"/v1/sessions/{web['id']}").json()["title"] == "What is a heap?"

    api = chat(client, "x" * 300, stream=True)   # an SDK call: no session id, no client header
    info = client.get(f"/v1/sessions/{api}").json()
    assert info["origin"] == "api" and info["title"] == "x" * (TITLE_CHARS - 1) + "\u2026"
    assert client.post("/v1/sessions").json()["origin"] == "api"
    listed = {s["id"]: s for s in client.get("/v1/sessions").json()["data"]}
    assert listed[web["id"]]["origin"] == "web" and listed[api]["origin"] == "api"


def test_titles_are_settable_and_documents_name_a_new_conversation(client):
    sid = client.post("/v1/sessions", headers=WEB, json={"title": "Reading list"}).json()["id"]
    assert client.get(f"/v1/sessions/{sid}").json()["title"] == "Reading list"
    r = client.patch(f"/v1/sessions/{sid}", json={"title": "  Renamed\tconversation "})
    assert r.status_code == 200 and r.json()["title"] == "Renamed conversation"
    assert client.patch(f"/v1/sessions/{sid}", json={"title": "t" * 201}).status_code == 400
    assert client.patch(f"/v1/sessions/{sid}", json={"colour": "red"}).status_code == 400
    assert client.patch("/v1/sessions/sess_nope", json={"title": "x"}).status_code == 404

    doc = client.post("/v1/sessions", headers=WEB).json()["id"]
    r = client.post(f"/v1/sessions/{doc}/documents", json={"text": "body " * 50, "name": "notes.txt", "stream": False})
    assert r.status_code == 200 and client.get(f"/v1/sessions/{doc}").json()["title"] == "notes.txt"
    pasted = client.post("/v1/sessions", headers=WEB).json()["id"]
    client.post(f"/v1/sessions/{pasted}/documents", json={"text": "\n\nFirst line\nsecond", "stream": False})
    assert client.get(f"/v1/sessions/{pasted}").json()["title"] == "First line"


def test_origin_and_title_survive_a_restart(tmp_path):
    with TestClient(app_for(tmp_path, persist_sessions=True), base_url=LOCAL) as c:
        sid = c.post("/v1/sessions", headers=WEB).json()["id"]
        chat(c, "Remember me", session=sid)
        api = chat(c, "From a script")
    with TestClient(app_for(tmp_path, persist_sessions=True), base_url=LOCAL) as c:
        info = c.get(f"/v1/sessions/{sid}").json()
        assert (info["origin"], info["title"]) == ("web", "Remember me")
        info = c.get(f"/v1/sessions/{api}").json()
        assert (info["origin"], info["title"]) == ("api", "From a script")


def test_tokenize_counts_with_the_models_tokenizer_and_is_bounded(client):
    r = client.post("/v1/tokenize", json={"text": "héllo, wörld"})
    assert r.status_code == 200 and r.json() == {"object": "tokenize", "model": "fake-model", "count": 12}
    assert client.post("/v1/tokenize", json={"text": ""}).json()["count"] == 0
    too_long = client.post("/v1/tokenize", json={"text": "a" * (TOKENIZE_MAX_CHARS + 1)})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "text"
    assert client.post("/v1/tokenize", json={"text": "a", "add_special_tokens": True}).status_code == 400


def first_heap_event(client) -> dict:
    with client.stream("GET", "/v1/heap/events") as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                return json.loads(line[5:])
    raise AssertionError("no heap event")


def test_the_first_heap_event_carries_sparklines_and_throughput(client):
    sid = chat(client, "hello there")
    svc = client.app.state.services
    svc.throughput.samples.append((1.0, 19.6, 850.0))   # what the sampler records while the engine works
    snap = first_heap_event(client)
    points = snap["history"]["sessions"][sid]
    assert points[-1] == [snap["sessions"][0]["heap"]["tokens_seen"], snap["sessions"][0]["heap"]["resident"]]
    assert all(a[0] <= b[0] for a, b in zip(points, points[1:]))   # tokens seen only grows
    assert snap["history"]["throughput"][-1] == [1.0, 19.6, 850.0]


def test_sparkline_history_stays_bounded_and_keeps_both_ends():
    from localheap.heap import HeapStats

    s = Session(id="sess_x", cfg=HEAP)
    for seen in range(1, 5 * HISTORY_POINTS):
        s.refresh(HeapStats(tokens_seen=seen, resident=min(seen, 100), evicted=max(0, seen - 100), capacity=100,
                            kv_bytes=1, evictions=0))
    assert len(s.history) <= HISTORY_POINTS
    assert s.history[0] == (1, 1) and s.history[-1] == (5 * HISTORY_POINTS - 1, 100)
    assert list(s.history) == sorted(s.history)


def test_a_streamed_reply_reports_its_decode_speed_timed_on_the_server(tmp_path):
    backend = FakeBackend(step_s=0.01)   # at most 100 tokens a second
    backend.tokenizer = TemplateTokenizer()
    app = create_app(backend, ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path))
    with TestClient(app, base_url=LOCAL) as client:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "go"}], "max_tokens": 11,
                "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    final = chunks[-1]
    speed = final["localheap"]["speed"]
    assert final["usage"]["completion_tokens"] == 11
    assert 10 * 0.01 <= speed["decode_seconds"] < 5
    assert 0 < speed["decode_tokens_per_s"] <= 100 * 1.05
    assert speed["decode_tokens_per_s"] == pytest.approx(10 / speed["decode_seconds"], rel=0.01)
