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


def start(sessions_dir, umask: int) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "localheap.cli", "serve", "--model", MODEL, "--backend", "torch",
           "--port", url.rsplit(":", 1)[1], "--sessions-dir", str(sessions_dir), "--log-level", "warning",
           "--max-tokens-limit", "1000000", "--max-prompt-tokens", "200000", "--shutdown-grace", str(GRACE_S),
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
        assert r.status_code == 200 and r.headers["X-Localheap-Saved"] == "true"
        assert httpx.post(url + f"/v1/sessions/{chat_sid}/checkpoint", timeout=60).status_code == 201

        reply = Stream(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1000000, "stream": True,
                       "messages": [{"role": "user", "content": "Never stop."}]}, {"X-Session-Id": chat_sid})
        doc = Stream(url, f"/v1/sessions/{doc_sid}/documents", {"text": DOC}, {})
        view = HeapView(url)
        reply.start()
        doc.start()
        view.start()
        deadline = time.monotonic() + 120
        while (len(reply.events) < 3 or not any(k == "progress" and d["done"] for k, d in doc.events)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reply.events) >= 3 and doc.events and view.events, (reply.events[:3], doc.events[:3])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(GRACE_S + 30)
        exited = time.monotonic() - t0
        reply.join(10)
        doc.join(10)
        view.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    out = proc.stdout.read()
    assert code == 0, out
    assert exited < GRACE_S + 15, exited
    index = {e["id"]: e["tokens"] for e in json.loads((root / "index.json").read_text())["sessions"]}
    for stream, sid in ((reply, chat_sid), (doc, doc_sid)):
        final = stream.last()
        assert final is not None and stream.error is None, (stream.events[-3:], stream.error, out[-2000:])
        took = stream.final_at - t0
        assert GRACE_S - 1.0 <= took <= GRACE_S + 6, took   # ran on through the grace period, then ended
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
