"""Session routes on the real server: documents longer than the heap (SSE progress,
evictions, bounded residency), spill/restore, delete, heap events, metrics."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("mlx.core")
openai = pytest.importorskip("openai")

from test_server_openai import HEAP, MODEL, load_mlx_backend  # noqa: E402

from localheap.server import ServerSettings, create_app  # noqa: E402
from localheap.server.testing import ServerThread  # noqa: E402

DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(120))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path_factory.mktemp("spill"),
                              heap_events_interval=0.1)
    with ServerThread(create_app(load_mlx_backend(), settings)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse(response):
    """(event, data) pairs of a text/event-stream response."""
    event, data = "message", []
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield event, "\n".join(data)
            event, data = "message", []


def new_session(http) -> str:
    r = http.post("/v1/sessions")
    assert r.status_code == 201 and r.json()["state"] == "empty"
    return r.json()["id"]


def test_document_longer_than_the_heap_streams_through_it(http, server):
    sid = new_session(http)
    with http.stream("POST", f"/v1/sessions/{sid}/documents", json={"text": DOC}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse(r))
    progress = [json.loads(d) for e, d in events if e == "progress"]
    assert len(progress) >= 2 and progress[-1]["done"] == progress[-1]["total"] > 1000
    assert all(a["done"] < b["done"] for a, b in zip(progress, progress[1:]))
    kind, done = events[-1][0], json.loads(events[-1][1])
    assert kind == "done" and done["session_id"] == sid and done["tokens_added"] > 1000
    heap = done["session"]["heap"]
    capacity = HEAP.sinks + HEAP.budget + HEAP.slack
    assert heap["tokens_seen"] == done["tokens_added"] and heap["evicted"] > 1000 and heap["evictions"] > 10
    assert heap["resident"] <= capacity and all(layer["resident"] <= capacity for layer in heap["layers"])
    # a question about the document continues the session: the document is not fed again
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Summarize."}],
                                            max_tokens=12, temperature=0, extra_headers={"X-Session-Id": sid})
    assert answer.localheap["session_id"] == sid
    assert answer.usage.prompt_tokens_details.cached_tokens == done["tokens_added"]
    assert answer.localheap["heap"]["resident"] <= capacity


def test_document_without_streaming_and_raw(http):
    sid = new_session(http)
    r = http.post(f"/v1/sessions/{sid}/documents", json={"text": "A short note.", "stream": False, "raw": True})
    assert r.status_code == 200
    body = r.json()
    assert body["finish_reason"] == "fed" and body["session"]["tokens"] == body["tokens_added"] > 0
    again = http.post(f"/v1/sessions/{sid}/documents", json={"text": "More.", "stream": False, "raw": True}).json()
    assert again["session"]["tokens"] == body["tokens_added"] + again["tokens_added"]


def test_spill_restore_and_delete(http):
    sid = new_session(http)
    http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC[:2000], "stream": False})
    before = http.get(f"/v1/sessions/{sid}").json()
    spilled = http.post(f"/v1/sessions/{sid}/spill").json()
    assert spilled["state"] == "spilled" and spilled["heap"] == before["heap"]
    chat = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == before["tokens"]
    assert http.get(f"/v1/sessions/{sid}").json()["state"] == "resident"
    assert sid in [s["id"] for s in http.get("/v1/sessions").json()["data"]]
    assert http.delete(f"/v1/sessions/{sid}").json() == {"id": sid, "object": "session.deleted", "deleted": True}
    assert http.get(f"/v1/sessions/{sid}").status_code == 404
    assert http.delete(f"/v1/sessions/{sid}").status_code == 404


def test_heap_events_stream(http):
    new_session(http)
    with http.stream("GET", "/v1/heap/events", params={"interval": 0.1}) as r:
        events = []
        for event, data in sse(r):
            events.append((event, json.loads(data)))
            if len(events) == 2:
                break
    kind, snap = events[0]
    assert kind == "heap" and snap["thermal"] == "unknown" and snap["model"] == MODEL
    assert snap["memory"]["rss_bytes"] > 0 and "ram_budget_bytes" in snap["memory"]
    assert set(snap["throughput"]) == {"decode_tokens_per_s", "prefill_tokens_per_s"}
    layers = [s["heap"]["layers"] for s in snap["sessions"] if s["heap"]]
    assert layers and {"resident", "evicted", "sinks", "heavy_hitters", "recent"} <= set(layers[0][0])


def test_metrics(http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "count", "max_tokens": 3})
    text = http.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["localheap_requests_total"] >= 1 and values["localheap_completion_tokens_total"] >= 1
    assert values["localheap_process_rss_bytes"] > 0 and "# TYPE localheap_sessions gauge" in text
    assert 'localheap_sessions{state="resident"}' in values
    # llama-server's names, as its dashboards read them: the same counts, seconds of work behind them
    assert values["llamacpp:tokens_predicted_total"] == values["localheap_completion_tokens_total"]
    assert values["llamacpp:prompt_tokens_total"] == \
        values["localheap_prompt_tokens_total"] - values["localheap_cached_tokens_total"] >= 1
    assert values["llamacpp:tokens_predicted_seconds_total"] > 0 and values["llamacpp:n_decode_total"] >= 1
    assert values["llamacpp:predicted_tokens_seconds"] > 0 and values["llamacpp:prompt_tokens_seconds"] > 0
    assert values["llamacpp:requests_processing"] == values["localheap_requests_active"]
    assert "# TYPE llamacpp:requests_deferred gauge" in text
