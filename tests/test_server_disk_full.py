"""A full or read-only sessions disk through the real server (torch, recall on), on a small
tmpfs and a read-only bind mount of it (skipped where this process cannot mount), and with a
fake writer that refuses every write (runs everywhere): every reply
whose turn is not on disk says so (`saved: false`, X-Localheap-Saved), `/health` is degraded,
the session stays and answers, checkpoints answer 507, and once the disk takes writes again the
session is saved without a new turn and /health is ok. A reply that says `saved: true` is on disk."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import httpx
import pytest

from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.testing import ServerThread

pytest.importorskip("torch")

HEAP = HeapConfig(budget=96, slack=32, recent=16, policy="snapkv", recall=True, recall_budget=32, page_size=8)
DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(30))
RETRY_S = 0.3


@pytest.fixture(scope="module")
def backend(model_dirs, torch_one_thread):
    from localheap.backends.torch import TorchBackend

    return TorchBackend.load(model_dirs("llama"), model_name="tiny")


def _mount(*args) -> None:
    try:
        subprocess.run(["mount", *map(str, args)], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount here ({e})")


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 4 MiB tmpfs as the sessions directory; the engine retries unsaved turns every RETRY_S."""
    import localheap.engine.engine as engine

    monkeypatch.setattr(engine, "RETRY_SAVE_S", RETRY_S)
    root = tmp_path / "sessions"
    root.mkdir()
    _mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", root)
    yield root
    subprocess.run(["umount", "-l", str(root)], capture_output=True)


def fill(root) -> object:
    """Write a ballast file until the disk is full; returns its path. Unbuffered, in ever smaller
    pieces: a buffered file kept the piece the disk refused and raised ENOSPC again at close,
    depending on how many bytes the disk had left (the float16 page-state files moved that)."""
    path = root / "ballast"
    with open(path, "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return path


@contextlib.contextmanager
def read_only(root):
    """`root` as a read-only bind mount of itself (files the server has open stay writable)."""
    _mount("--bind", root, root)
    try:
        _mount("-o", "remount,bind,ro", root)
        yield
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def chat(http, sid, text, **kw):
    return http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, **kw})


def stream_chat(http, sid, text) -> dict:
    """The final chunk's localheap extension (the stream sends no X-Localheap-Saved header)."""
    with http.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": sid}, json={
            "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200 and "x-localheap-saved" not in r.headers
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1, chunks
    return final[0]["localheap"]


def document_filling(http, sid, root) -> dict:
    """Stream a document; the disk fills once its first progress event arrives. The done event."""
    with http.stream("POST", f"/v1/sessions/{sid}/documents", json={"text": DOC}) as r:
        assert r.status_code == 200
        kind, done = None, None
        for line in r.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and kind == "progress" and not (root / "ballast").exists():
                fill(root)
            elif line.startswith("data:") and kind == "done":
                done = json.loads(line[5:])
    assert done is not None
    return done


def on_disk(root, sid) -> int:
    """Tokens the index commits for the session (0: not in it)."""
    index = json.loads((root / "index.json").read_text())
    return next((e["tokens"] for e in index["sessions"] if e["id"] == sid), 0)


def tokens(http, sid) -> int:
    return http.get(f"/v1/sessions/{sid}").json()["tokens"]


def unsaved(http) -> list[str]:
    health = http.get("/health").json()
    return [d for d in health.get("degraded", []) if "not saved" in d]


def metric(http, name: str) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, name
    return float(lines[0].split()[1])


def wait_saved(http, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while unsaved(http) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not unsaved(http), http.get("/health").json()


def test_full_disk_mid_reply_and_mid_document(backend, small_disk):
    root = small_disk
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=root, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["id"]
        r = chat(http, sid, DOC + " What does the heap keep?")
        assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "true" and r.json()["localheap"]["saved"]
        assert on_disk(root, sid) == tokens(http, sid)   # said saved: it is

        ballast = fill(root)
        r = chat(http, sid, DOC + " Again?")
        assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "false", r.text
        ext = r.json()["localheap"]
        assert ext["saved"] is False and "No space" in ext["save_error"], ext
        assert ext["heap"]["pages"]["pages_failed"] > 0   # its page-out failed too: the next questions still answer
        health = http.get("/health").json()
        assert health["status"] == "degraded" and sid in unsaved(http)[0], health
        held = tokens(http, sid)
        assert metric(http, "localheap_sessions_unsaved") == 1 and metric(http, "localheap_session_saves_failed_total") >= 1
        assert held > on_disk(root, sid)                # resident, ahead of its copy on disk
        assert sid in [s["id"] for s in http.get("/v1/sessions").json()["data"]]

        ext = stream_chat(http, sid, "And then?")       # it answers on (no 500, not deleted)
        assert ext["saved"] is False and ext["save_error"]
        r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "And Anthropic?"}]},
                      headers={"X-Session-Id": sid})
        assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "false", r.text
        assert r.json()["localheap"]["saved"] is False
        with http.stream("POST", "/v1/messages", headers={"X-Session-Id": sid}, json={
                "model": "tiny", "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": "And streamed?"}]}) as r:
            deltas = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and '"message_delta"' in line]
        assert len(deltas) == 1 and deltas[0]["localheap"]["saved"] is False, deltas
        r = http.post(f"/v1/sessions/{sid}/checkpoint")
        assert r.status_code == 507 and r.json()["error"]["code"] == "sessions_dir_unwritable", r.text
        listed = [x["id"] for x in http.get("/v1/sessions").json()["data"]]
        r = http.post("/v1/sessions")   # a session the index cannot hold is not made (nor announced)
        assert r.status_code == 507 and [x["id"] for x in http.get("/v1/sessions").json()["data"]] == listed, r.text
        # a failed write leaves no partial file (the page store's own are heap/pages.py's to clean)
        assert not [p for p in root.rglob("*.tmp*") if ".pages" not in str(p)]

        ballast.unlink()                                # space is back: saved without a new turn
        wait_saved(http)
        assert on_disk(root, sid) == tokens(http, sid) and metric(http, "localheap_sessions_unsaved") == 0
        r = chat(http, sid, "Saved now?")
        assert r.headers["X-Localheap-Saved"] == "true" and on_disk(root, sid) == tokens(http, sid)

        other = http.post("/v1/sessions").json()["id"]   # the disk fills while a document is read
        done = document_filling(http, other, root)
        assert done["finish_reason"] == "fed" and done["saved"] is False and "No space" in done["save_error"], done
        assert done["tokens_added"] == done["tokens_total"] > 0
        assert http.post(f"/v1/sessions/{other}/documents",
                         json={"text": "A note.", "stream": False}).headers["X-Localheap-Saved"] == "false"
        (root / "ballast").unlink()
        wait_saved(http)
        assert on_disk(root, other) == tokens(http, other) and http.get("/health").json()["status"] in ("ok", "degraded")


def test_read_only_disk(backend, small_disk):
    root = small_disk
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=root, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["id"]
        assert chat(http, sid, DOC + " What does the heap keep?").headers["X-Localheap-Saved"] == "true"
        with read_only(root):
            r = chat(http, sid, "Read-only now?")
            assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "false", r.text
            assert "Read-only" in r.json()["localheap"]["save_error"]
            assert sid in unsaved(http)[0]
            r = http.post(f"/v1/sessions/{sid}/checkpoint")
            assert r.status_code == 507, r.text
            assert http.post("/v1/sessions").status_code == 507
            assert chat(http, sid, "Still here?").status_code == 200
            assert tokens(http, sid) > on_disk(root, sid)
        wait_saved(http)
        assert on_disk(root, sid) == tokens(http, sid)
        assert http.post(f"/v1/sessions/{sid}/checkpoint").status_code == 201


def test_a_refusing_disk_without_mounts(backend, tmp_path, monkeypatch):
    """The same promises where nothing can be mounted (not root, macOS): every write into the
    sessions directory refused with ENOSPC by a fake writer, then allowed again."""
    import errno

    import localheap.engine.engine as engine
    import localheap.sessions.checkpoints as checkpoints
    from localheap.heap.pages import PageStore
    from localheap.sessions.disk import SessionDir

    monkeypatch.setattr(engine, "RETRY_SAVE_S", RETRY_S)
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["id"]
        assert chat(http, sid, DOC + " What does the heap keep?").headers["X-Localheap-Saved"] == "true"

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            write_with = SessionDir.write_with
            m.setattr(SessionDir, "write_with", lambda self, path, write: write_with(self, path, full))
            m.setattr(PageStore, "_pwrite", full)
            m.setattr(checkpoints, "_write_tokens", full)
            r = chat(http, sid, DOC + " Again?")
            assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "false", r.text
            assert "No space" in r.json()["localheap"]["save_error"] and sid in unsaved(http)[0]
            assert chat(http, sid, "And then?").status_code == 200
            assert http.post(f"/v1/sessions/{sid}/checkpoint").status_code == 507
            assert http.post("/v1/sessions").status_code == 507
            assert tokens(http, sid) > on_disk(tmp_path, sid)
        wait_saved(http)
        assert on_disk(tmp_path, sid) == tokens(http, sid)


def test_a_server_starts_on_a_full_disk_reads_what_is_saved_and_saves_once_there_is_room(backend, small_disk):
    """A crash on a full disk left it full: the start's write check refused ("cannot save sessions
    to ...: No space left on device") and nothing was served. A full directory (not an unwritable
    one) now starts degraded, its sessions read back and answering, and the first save once there
    is room clears it."""
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=small_disk, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["id"]
        assert chat(http, sid, DOC + " What does the heap keep?").headers["X-Localheap-Saved"] == "true"
        saved = tokens(http, sid)
    ballast = fill(small_disk)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        health = http.get("/health").json()
        assert health["status"] == "degraded" and any("No space" in d for d in health["degraded"]), health
        assert all(d.count("cannot save sessions") == 1 for d in health["degraded"]), health   # (said twice)
        assert tokens(http, sid) == saved
        r = chat(http, sid, "And then?")
        assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "false", r.text
        ballast.unlink()
        wait_saved(http)
        assert http.get("/health").json()["status"] == "ok" and on_disk(small_disk, sid) == tokens(http, sid)
    with pytest.raises(Exception, match="Read-only|cannot save"):   # unwritable (not full) still refuses
        with read_only(small_disk):
            create_app(backend, settings)
