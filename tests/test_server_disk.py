"""The sessions directory through the real server (torch backend, recall on): ephemeral
requests ("store": false) leave nothing behind."""

from __future__ import annotations

import httpx
import pytest

from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.testing import ServerThread

pytest.importorskip("torch")

HEAP = HeapConfig(budget=96, slack=32, recent=16, policy="snapkv", recall=True, recall_budget=32, page_size=8)
DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(60))


def files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def chat(http, text, headers=None, **kw):
    return http.post("/v1/chat/completions", headers=headers or {}, json={
        "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, **kw})


@pytest.fixture(scope="module")
def backend(model_dirs, torch_one_thread):
    from localheap.backends.torch import TorchBackend

    return TorchBackend.load(model_dirs("llama"), model_name="tiny")


@pytest.mark.parametrize("stream", [False, True])
def test_store_false_leaves_nothing_on_disk(backend, tmp_path, stream):
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        kept = chat(http, DOC + " What does the heap keep?")
        assert kept.status_code == 200 and kept.json()["localheap"]["heap"]["pages"]["pages"] > 0
        before = files(tmp_path)
        assert any(f.startswith(kept.headers["X-Session-Id"]) for f in before)
        r = chat(http, DOC + " What does the heap keep? Say it again.", stream=stream, store=False)
        assert r.status_code == 200, r.text
        sid = r.headers["X-Session-Id"]
        assert sid != kept.headers["X-Session-Id"]   # never runs on (or rolls back) a kept session
        if not stream:
            assert r.json()["localheap"]["heap"]["pages"]["pages"] > 0   # it did page out while it ran
        after = files(tmp_path)
        assert not [f for f in after if sid in f], after
        assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == [kept.headers["X-Session-Id"]]
        assert sid not in (tmp_path / "index.json").read_text()
        again = chat(http, "Hi", headers={"X-Session-Id": kept.headers["X-Session-Id"]}, store=False)
        assert again.status_code == 400 and again.json()["error"]["param"] == "store"
        assert "not kept" in again.json()["error"]["message"]
