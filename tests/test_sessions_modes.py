"""Everything the server writes under the sessions directory is 0700 (directories) / 0600 (files)
whatever the umask: heaps, tokens, the index, page stores, checkpoints (heap, tokens, pages), a
fork's copies, a spill, files moved aside. The real server (torch, recall on) in this process."""

from __future__ import annotations

import os
import stat

import httpx
import pytest

from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.testing import ServerThread

pytest.importorskip("torch")

HEAP = HeapConfig(budget=96, slack=32, recent=16, policy="snapkv", recall=True, recall_budget=32, page_size=8)
DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(30))


def private_modes(root) -> list[str]:
    """Everything under `root` that is not 0700 (directories) or 0600 (files)."""
    bad = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
            if stat.S_IMODE(st.st_mode) != want:
                bad.append(f"{os.path.relpath(path, root)} {stat.S_IMODE(st.st_mode):o}")
    return bad


@pytest.fixture(scope="module")
def backend(model_dirs, torch_one_thread):
    from localheap.backends.torch import TorchBackend

    return TorchBackend.load(model_dirs("llama"), model_name="tiny")


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_every_file_and_directory_is_private(backend, tmp_path, umask):
    root = tmp_path / "a" / "sessions"   # its parents are the server's to make too
    old = os.umask(umask)
    try:
        settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=root, persist_sessions=True)
        with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
            sid = http.post("/v1/sessions").json()["id"]
            r = http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC, "stream": False})   # + checkpoint
            assert r.status_code == 200, r.text
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": DOC + " What?"}]})
            assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "true"
            assert http.post(f"/v1/sessions/{sid}/checkpoint").status_code == 201
            fork = http.post(f"/v1/sessions/{sid}/fork")
            assert fork.status_code == 201, fork.text
            assert http.post(f"/v1/sessions/{sid}/spill").status_code == 200
            store = srv.services.store
            (root / "stray").write_bytes(b"x")
            store.dir.move_aside([root / "stray"], "a test's stray file")
        kinds = {p.suffix or p.name for p in root.rglob("*")}
        assert {".safetensors", ".tokens", ".json", ".pages"} <= kinds, kinds
        assert (root / "checkpoints" / sid).is_dir() and (root / "aside").is_dir()
        assert any(p.name.endswith(".pages") for p in (root / "checkpoints" / sid).iterdir())
        assert not private_modes(root), private_modes(root)
        assert oct(os.stat(tmp_path / "a").st_mode & 0o777) == oct(0o700)
    finally:
        os.umask(old)
