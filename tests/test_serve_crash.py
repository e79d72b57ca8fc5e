"""`localheap serve` in a subprocess (tiny random torch model, loopback): kill -9 in the middle
of a load loses at most the turns in flight, and a restart continues every session with the
same next tokens; SIGTERM with a request that would never end exits within the grace period
and saves the session it cancelled."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_process import free_port, wait_until_healthy

pytest.importorskip("torch")

MODEL = "random:llama:tiny"
HEAP = ["--budget", "64", "--recent", "16", "--slack", "32", "--policy", "h2o"]
GRACE_S = 2.0
START_TIMEOUT_S = 240   # importing torch on a loaded 2-core machine takes a while


class Server:
    def __init__(self, sessions_dir):
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "localheap.cli", "serve", "--model", MODEL, "--backend", "torch",
               "--port", self.url.rsplit(":", 1)[1], "--sessions-dir", str(sessions_dir), "--log-level", "warning",
               "--max-tokens-limit", "1000000", "--shutdown-grace", str(GRACE_S), *HEAP]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_until_healthy(self.proc, self.url, START_TIMEOUT_S)

    def new_session(self) -> str:
        return httpx.post(self.url + "/v1/sessions").json()["id"]

    def chat(self, sid: str, content: str, max_tokens: int = 8) -> str:
        r = httpx.post(self.url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=120,
                       json={"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                             "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def sessions(self) -> dict:
        return {s["id"]: s["tokens"] for s in httpx.get(self.url + "/v1/sessions").json()["data"]}

    def stream_forever(self, sid: str) -> httpx.Response:
        """A streamed reply that runs until the server goes away (its first chunk read)."""
        client = httpx.Client(timeout=120)
        r = client.send(client.build_request(
            "POST", self.url + "/v1/chat/completions", headers={"X-Session-Id": sid},
            json={"model": MODEL, "max_tokens": 1000000, "temperature": 0, "stream": True,
                  "messages": [{"role": "user", "content": "Never stop."}]}), stream=True)
        lines = r.iter_lines()
        assert any(line.startswith("data:") for line in lines)
        r._keep = (client, lines)   # referenced: a collected iterator would close the stream
        return r

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def test_kill_9_mid_load_then_restart_then_sigterm(tmp_path):
    srv = Server(tmp_path)
    try:
        twin, twin2, busy = (srv.new_session() for _ in range(3))
        for sid in (twin, twin2, busy):
            srv.chat(sid, "The heap keeps sinks and heavy hitters. What does it keep?")
        expected = srv.chat(twin2, "And what does it drop?")   # twin gets the same question after the crash
        assert expected
        saved = srv.sessions()
        loads = [srv.stream_forever(busy)]                      # a turn in flight on a saved session
        loads.append(srv.stream_forever(srv.new_session()))     # and on a new one
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    finally:
        srv.kill()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]

    srv = Server(tmp_path)
    try:
        back = srv.sessions()
        assert {sid: back.get(sid) for sid in saved} == saved, "every finished turn survived, nothing more"
        assert srv.chat(twin, "And what does it drop?") == expected
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], leftovers

        # SIGTERM while a request that would never end runs: exit within the grace period
        before = srv.sessions()[twin2]
        endless = threading.Thread(target=lambda: _ignore(srv.chat, twin2, "Never stop.", 1000000), daemon=True)
        endless.start()
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/health").json()["in_flight"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert httpx.get(srv.url + "/health").json()["in_flight"] == 1
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(GRACE_S + 20)
        took = time.monotonic() - t0
    finally:
        srv.kill()
    assert took < GRACE_S + 8, took
    assert code == 0, srv.proc.stdout.read()
    index = json.loads((tmp_path / "index.json").read_text())
    tokens = {e["id"]: e["tokens"] for e in index["sessions"]}
    assert tokens[twin2] > before, "the cancelled turn was saved at shutdown"


def _ignore(fn, *args):
    try:
        fn(*args)
    except (AssertionError, httpx.HTTPError):
        pass   # the server went away under it, as intended


def test_kill_9_mid_background_response_goes_on_from_what_reached_the_disk(tmp_path):
    """kill -9 while a background response runs: at the restart it goes on from what of it reached
    the disk. Its events kept include all a reader saw (as they were sent, numbered as then), and its
    reply runs on from their last token: its output (cancelled once run 2 has sent a few events)
    begins with their text and goes on."""
    srv = Server(tmp_path)
    try:
        r = httpx.post(srv.url + "/v1/responses", timeout=60,
                       json={"model": MODEL, "input": "Never stop.", "background": True,
                             "max_output_tokens": 100000, "temperature": 0})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        seen = _events(srv.url, rid, lambda got: len(got) == 40)
        srv.proc.send_signal(signal.SIGKILL)   # (at once: what a reader saw was written before it was sent)
        srv.proc.wait(30)
    finally:
        srv.kill()
    assert (tmp_path / "background" / f"{rid}.jsonl").exists()

    srv = Server(tmp_path)
    try:
        events = _events(srv.url, rid, lambda got: sum(e["sequence_number"] >= 10 ** 9 for e in got) == 5)
        r = httpx.post(f"{srv.url}/v1/responses/{rid}/cancel", timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        body = httpx.get(f"{srv.url}/v1/responses/{rid}").json()
    finally:
        srv.kill()
    kept = [e for e in events if e["sequence_number"] < 10 ** 9]
    assert len(kept) >= len(seen) and kept[:len(seen)] == seen
    assert [e["sequence_number"] for e in kept] == list(range(len(kept)))
    before = "".join(e["delta"] for e in kept if e["type"] == "response.output_text.delta")
    text = body["output"][0]["content"][0]["text"]
    assert before and text.startswith(before) and len(text) > len(before)
    assert body["usage"] is None or body["usage"]["output_tokens"] > len(kept) - 4
    assert not (tmp_path / "background" / f"{rid}.jsonl").exists()


def _events(url: str, rid: str, enough) -> list[dict]:
    """A background response's events (GET ?stream=true) until enough(the events so far)."""
    out = []
    with httpx.stream("GET", f"{url}/v1/responses/{rid}", params={"stream": "true"}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
                if enough(out):
                    break
    return out
