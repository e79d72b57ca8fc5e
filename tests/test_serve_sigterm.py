"""`localheap serve` in a subprocess (tiny random torch model, recall on, umask 0): SIGTERM while
a reply streams and a document is read. Both streams run on through the grace period, then end
with their final event saying what was kept (interrupted, tokens read / generated, saved); the
web UI's heap-event stream ends at the signal; the process exits 0; the index holds what the final events say; and every file and directory the
server wrote is 0600 / 0700."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_process import wait_until_healthy
from test_serve_crash import HEAP, MODEL, START_TIMEOUT_S, free_port
from test_sessions_modes import private_modes

pytest.importorskip("torch")

GRACE_S = 3.0
DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(2000))
LONG_DOC = " ".join([DOC] * 8)   # ~740K tokens: about 40 s to read here, so no machine ends it within the grace


def start(sessions_dir, umask: int) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "localheap.cli", "serve", "--model", MODEL, "--backend", "torch",
           "--port", url.rsplit(":", 1)[1], "--sessions-dir", str(sessions_dir), "--log-level", "warning",
           "--max-tokens-limit", "1000000", "--max-prompt-tokens", "1000000", "--shutdown-grace", str(GRACE_S),
           "--recall", "on", "--page-size", "8", *HEAP]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.umask(umask))
    wait_until_healthy(proc, url, START_TIMEOUT_S)
    return proc, url


class Stream(threading.Thread):
    """Reads one SSE response to its end; records when its first event and its final one came."""

    def __init__(self, url: str, path: str, body: dict, headers: dict):
        super().__init__(daemon=True)
        self.args = (url + path, body, headers)
        self.events: list[tuple[str, dict]] = []
        self.first_at = self.final_at = None
        self.error = None

    def run(self) -> None:
        url, body, headers = self.args
        try:
            with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
                kind = "message"
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        kind = line.split(":", 1)[1].strip()
                    elif line.startswith("data:") and "[DONE]" not in line:
                        data = json.loads(line[5:])
                        self.events.append((kind, data))
                        self.first_at = self.first_at or time.monotonic()
                        if self.final(kind, data) is not None:
                            self.final_at = time.monotonic()
        except httpx.HTTPError as e:
            self.error = e

    @staticmethod
    def final(kind: str, data: dict):
        if kind == "done":
            return data
        choices = data.get("choices")
        if kind == "message" and choices and choices[0].get("finish_reason"):
            return data["localheap"]
        return None

    def last(self):
        finals = [f for k, d in self.events if (f := self.final(k, d)) is not None]
        return finals[-1] if finals else None


class HeapView(threading.Thread):
    """The web UI's heap-event stream: records when it ended."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.events, self.ended_at = url, 0, None

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url + "/v1/heap/events", timeout=120) as r:
                for line in r.iter_lines():
                    self.events += line.startswith("data:")
        except httpx.HTTPError:
            pass
        self.ended_at = time.monotonic()


def test_sigterm_mid_stream_ends_each_stream_with_what_was_kept(tmp_path):
    root = tmp_path / "sessions"
    proc, url = start(root, umask=0)
    try:
        chat_sid = httpx.post(url + "/v1/sessions").json()["id"]
        doc_sid = httpx.post(url + "/v1/sessions").json()["id"]
        r = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": chat_sid}, timeout=120, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": DOC[:3000]}]})
        # (seen once under CI load: a 200 without the header; the reply and the log say why next time)
        assert r.status_code == 200 and r.headers.get("X-Localheap-Saved") == "true", (r.headers, r.text, chat_sid)
        assert httpx.post(url + f"/v1/sessions/{chat_sid}/checkpoint", timeout=60).status_code == 201

        # greedy: this model's greedy reply never samples EOS (checked to 20,000 tokens); sampled, it may
        # end on its own inside the grace period, sooner the faster the chat decodes beside the document
        reply = Stream(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1000000, "stream": True,
                       "temperature": 0, "messages": [{"role": "user", "content": "Never stop."}]},
                       {"X-Session-Id": chat_sid})
        doc = Stream(url, f"/v1/sessions/{doc_sid}/documents", {"text": LONG_DOC}, {})
        view = HeapView(url)
        reply.start()
        view.start()
        deadline = time.monotonic() + 120
        while len(reply.events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        doc.start()   # after the reply decodes: the document then rides beside it, a chunk a step
        while not any(k == "progress" and d["done"] for k, d in doc.events) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reply.events) >= 3 and doc.events and view.events, (reply.events[:3], doc.events[:3])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(GRACE_S + 30)
        exited = time.monotonic() - t0
        reply.join(10)
        doc.join(10)
        view.join(10)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        print(proc.stdout.read()[-6000:])   # the server's log, shown with the failure
        raise
    out = proc.stdout.read()
    assert code == 0, out
    assert exited < GRACE_S + 15, exited
    index = {e["id"]: e["tokens"] for e in json.loads((root / "index.json").read_text())["sessions"]}
    for stream, sid in ((reply, chat_sid), (doc, doc_sid)):
        final = stream.last()
        assert final is not None and stream.error is None, (stream.events[-3:], stream.error, out[-2000:])
        took = stream.final_at - t0
        assert GRACE_S - 1.0 <= took <= GRACE_S + 6, (took, final)   # ran on through the grace period, then ended
        assert final["interrupted"] == "shutdown" and final["saved"] is True, final
        assert index[sid] == final["session"]["tokens"], (index, final)   # what it said was kept is on disk
    assert view.ended_at is not None and view.ended_at - t0 < 2.0, "the heap view ends at the signal"
    ext = reply.last()
    assert ext["kept"]["completion_tokens"] > 0 and ext["kept"]["session_tokens"] == ext["session"]["tokens"]
    done = doc.last()
    assert done["finish_reason"] == "cancelled" and 0 < done["tokens_added"] < done["tokens_total"], done
    assert done["kept"]["prompt_tokens_read"] == done["tokens_added"]
    assert list((root / "checkpoints" / chat_sid).iterdir()), "the checkpoint is on disk"
    assert any((root / f"{doc_sid}.pages").iterdir()), "the document paged out"
    assert not private_modes(root), private_modes(root)


@pytest.fixture(scope="module")
def backend(model_dirs, torch_one_thread):
    from localheap.backends.torch import TorchBackend

    return TorchBackend.load(model_dirs("llama"), model_name="tiny")


def test_interrupted_whole_responses_say_what_was_kept(backend, tmp_path):
    """What the runner does at the end of the grace period (engine.interrupt), in this process:
    a whole chat response and a whole document response end 200 with what was kept and saved."""
    from concurrent.futures import ThreadPoolExecutor

    from localheap.heap import HeapConfig
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    heap = HeapConfig(budget=64, slack=32, recent=16, policy="h2o")
    settings = ServerSettings(heap=heap, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              max_tokens_limit=1000000, max_prompt_tokens=200000)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http, \
            ThreadPoolExecutor(2) as pool:
        chat_sid, doc_sid = (http.post("/v1/sessions").json()["id"] for _ in range(2))
        reply = pool.submit(http.post, "/v1/chat/completions", headers={"X-Session-Id": chat_sid}, json={
            "model": "tiny", "max_tokens": 1000000, "temperature": 0, "messages": [{"role": "user", "content": "Never stop."}]})
        deadline = time.monotonic() + 120
        while not http.get(f"/v1/sessions/{chat_sid}").json()["tokens"]:   # decoding
            assert time.monotonic() < deadline and not reply.done()
            time.sleep(0.05)
        doc = pool.submit(http.post, f"/v1/sessions/{doc_sid}/documents", json={"text": DOC, "stream": False})
        while not http.get(f"/v1/sessions/{doc_sid}").json()["tokens"]:   # read beside it, a chunk a step
            assert time.monotonic() < deadline and not doc.done(), doc.result() if doc.done() else None
            time.sleep(0.05)
        srv.services.engine.interrupt("shutdown")
        r, d = reply.result(60), doc.result(60)
        late = http.post("/v1/sessions").status_code   # routes that need no engine job still answer
        refused = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "true", r.text
    ext = r.json()["localheap"]
    assert ext["interrupted"] == "shutdown" and ext["saved"] is True and ext["kept"]["completion_tokens"] > 0
    assert ext["kept"]["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    body = d.json()
    assert d.status_code == 200 and body["interrupted"] == "shutdown" and body["finish_reason"] == "cancelled", body
    assert 0 < body["tokens_added"] < body["tokens_total"] and body["saved"] is True
    index = {e["id"]: e["tokens"] for e in json.loads((tmp_path / "index.json").read_text())["sessions"]}
    assert index[doc_sid] == body["session"]["tokens"] and index[chat_sid] == ext["session"]["tokens"]
    assert late in (200, 201) and refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
