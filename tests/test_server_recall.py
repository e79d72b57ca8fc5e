"""The recall tier through the real server (torch and MLX backends): a document pages out, a
question recalls, /metrics and /v1/heap/events say so, and a spilled session keeps its pages."""

from __future__ import annotations

import json

import httpx
import pytest

from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.testing import ServerThread

HEAP = HeapConfig(budget=96, slack=32, recent=16, policy="snapkv", recall=True, recall_budget=32, page_size=8)
DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(60))


@pytest.fixture(scope="module", params=["torch", "mlx"])
def http(request, model_dirs, tmp_path_factory):
    if request.param == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
        from localheap.backends.mlx import MLXBackend as Backend
    else:
        pytest.importorskip("torch")
        request.getfixturevalue("torch_one_thread")
        from localheap.backends.torch import TorchBackend as Backend
    backend = Backend.load(model_dirs("llama"), model_name="tiny")
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path_factory.mktemp("spill"),
                              heap_events_interval=0.05)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def metrics(http) -> dict:
    text = http.get("/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def test_document_pages_out_and_the_question_recalls(http):
    sid = http.post("/v1/sessions").json()["id"]
    done = http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC, "stream": False}).json()
    assert done["tokens_added"] > 500
    chat = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": "tiny", "messages": [{"role": "user", "content": "What does the heap keep?"}],
        "max_tokens": 4, "temperature": 0}).json()
    heap = chat["localheap"]["heap"]
    assert heap["recalled"] == HEAP.recall_budget
    pages = heap["pages"]
    assert pages["recalls"] == 1 and pages["last_recall"]["tokens"] == HEAP.recall_budget
    m = metrics(http)
    assert m["localheap_pages_stored"] > 0 and m["localheap_recalls_total"] == 1
    assert m["localheap_recalled_tokens_total"] == HEAP.recall_budget
    assert m["localheap_heap_tokens_recalled"] == HEAP.recall_budget and m["localheap_pages_dropped_total"] == 0
    with http.stream("GET", "/v1/heap/events", params={"interval": 0.1}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                snap = json.loads(line[5:])
                break
    mine = next(s for s in snap["sessions"] if s["id"] == sid)
    assert mine["heap"]["pages"]["pages"] > 0
    assert all("recalled" in layer for layer in mine["heap"]["layers"])

    before = http.get(f"/v1/sessions/{sid}").json()["heap"]["pages"]["pages"]
    assert http.post(f"/v1/sessions/{sid}/spill").json()["state"] == "spilled"
    again = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": "tiny", "messages": [{"role": "user", "content": "And the sinks?"}],
        "max_tokens": 4, "temperature": 0}).json()
    pages = again["localheap"]["heap"]["pages"]
    assert pages["recalls"] == 2 and pages["pages"] >= before   # the pages came back with the session


class QuietSensors:
    """The process and the system far from any limit: only the plan decides."""

    def memory(self):
        from localheap.governor import MemoryReading
        return MemoryReading(rss=0, allocator_active=0, allocator_cache=0, available=1 << 40, swap_used=0)

    def thermal(self):
        return "nominal"


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_growing_recall_session_spills_idle_ones_and_stops_at_its_cap(kind, model_dirs, tmp_path, request):
    """The plan holds 3 heaps with 64 tokens of pages each; a token of pages past that costs 10 B.
    A document's pages grow its session until it needs the whole budget: the idle sessions are
    spilled as it grows, and its pages stop at what the budget holds with it alone (the lowest-value
    ones dropped, counted). A later chat elsewhere spills it in turn."""
    from localheap.governor import Governor, MemoryPlan

    if kind == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
        from localheap.backends.mlx import MLXBackend as Backend
    else:
        pytest.importorskip("torch")
        request.getfixturevalue("torch_one_thread")
        from localheap.backends.torch import TorchBackend as Backend
    backend = Backend.load(model_dirs("llama"), model_name="tiny")
    plan = MemoryPlan(budget=3000, weights=0, heap=1000, overhead=0, recall_base_tokens=64, recall_token_bytes=10)
    assert plan.max_resident == 3 and plan.recall_max_tokens == 264
    governor = Governor(plan, QuietSensors())
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=False,
                              max_prompt_tokens=100_000)
    with ServerThread(create_app(backend, settings, governor=governor)) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        def ask(sid, text):
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
                "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["localheap"]["heap"]

        idle = [http.post("/v1/sessions").json()["id"] for _ in range(2)]
        for sid in idle:
            ask(sid, "Hello there.")
        doc = http.post("/v1/sessions").json()["id"]
        done = http.post(f"/v1/sessions/{doc}/documents", json={"text": DOC, "stream": False}).json()
        pages = done["session"]["heap"]["pages"]
        assert pages["tokens_limit"] == 264 and 200 < pages["tokens_on_disk"] <= 264
        assert pages["pages_dropped"] > 0
        assert [http.get(f"/v1/sessions/{sid}").json()["state"] for sid in idle] == ["spilled", "spilled"]
        assert ask(doc, "What does the heap keep?")["recalled"] == HEAP.recall_budget
        ask(idle[0], "Hello again.")             # needs a heap: the grown session is the one to go
        assert http.get(f"/v1/sessions/{doc}").json()["state"] == "spilled"
        assert http.get(f"/v1/sessions/{idle[0]}").json()["state"] == "resident"
