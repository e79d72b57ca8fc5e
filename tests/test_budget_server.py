"""The RAM budget as a promise, against the real `localheap serve` in a subprocess:
RSS stays under the budget, idle sessions spill and come back with the same tokens,
503 when nothing can be spilled, and a restart restores the saved sessions."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from server_process import free_port, wait_until_healthy

from localheap.randmodel import random_model_dir

MODEL = "random:llama:tiny"
HEAP = ["--budget", "32768", "--recent", "64", "--slack", "256"]   # ~17 MiB per heap on the tiny model
DOC = " ".join(f"note {i}: the value of key{i} is {i * 7 % 101}." for i in range(120))


class Server:
    def __init__(self, budget: str, sessions_dir, extra=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "localheap.cli", "serve", "--model", MODEL, "--backend", "mlx",
               "--port", str(self.port), "--ram-budget", budget, "--sessions-dir", str(sessions_dir),
               "--log-level", "warning", *HEAP, *extra]
        # the model built here first: a server that builds it measures a runtime 50 MiB larger (on a
        # fresh machine, CI's: 2.6 heaps of 17 MiB in the budget test's tight budget then held 4)
        random_model_dir(MODEL.removeprefix("random:"))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.peak_rss = 0
        self._watch = True
        wait_until_healthy(self.proc, self.url, 180)
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def _sample_rss(self):
        p = psutil.Process(self.proc.pid)
        while self._watch and self.proc.poll() is None:
            try:
                self.peak_rss = max(self.peak_rss, p.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^localheap_(\w+) ([0-9.e+-]+)$", text, re.M)}

    def new_session(self, doc: str) -> str:
        sid = httpx.post(self.url + "/v1/sessions", timeout=60).json()["id"]
        r = httpx.post(f"{self.url}/v1/sessions/{sid}/documents", json={"text": doc, "stream": False}, timeout=120)
        assert r.status_code == 200, r.text
        return sid

    def ask(self, sid: str, question: str = "What is the value of key7?", max_tokens: int = 24):
        return httpx.post(self.url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=120,
                          json={"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                                "messages": [{"role": "user", "content": question}]})

    def sessions(self) -> dict:
        return {s["id"]: s for s in httpx.get(self.url + "/v1/sessions").json()["data"]}

    def stop(self):
        self._watch = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)   # graceful: sessions are saved
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """weights, runtime and heap bytes as a generously budgeted server measures them."""
    # 1500M: generous, yet under 2 GiB, so its request room is the same 128 MiB as the tight budget's
    srv = Server("1500M", tmp_path_factory.mktemp("probe"), extra=["--no-persist"])
    try:
        m = srv.metrics()
    finally:
        srv.stop()
    return int(m["weights_bytes"]), int(m["runtime_bytes"]), int(m["heap_bytes"])


def test_budget_spill_reject_and_restart(sizes, tmp_path):
    weights, runtime, heap = sizes
    budget = weights + runtime + int(2.6 * heap)
    srv = Server(str(budget), tmp_path, extra=["--admission-timeout", "1"])   # the refusal below comes after 1 s in the queue
    try:
        m = srv.metrics()
        fit = int(m["max_resident_heaps"])
        assert 1 <= fit <= 3, (fit, m["runtime_bytes"], runtime, heap)
        # more sessions than fit: twins a/a2 carry the same document
        a = srv.new_session(DOC)
        for i in range(fit + 1):
            srv.new_session(DOC.replace("value", f"weight{i}"))
        a2 = srv.new_session(DOC)
        states = {sid: s["state"] for sid, s in srv.sessions().items()}
        assert states[a] == "spilled", states
        assert sum(s == "resident" for s in states.values()) <= fit
        assert srv.metrics()["budget_spills_total"] >= 2

        # a spilled session comes back with the same next tokens as its never-spilled twin
        twin = srv.ask(a2).json()["choices"][0]["message"]["content"]
        back = srv.ask(a).json()["choices"][0]["message"]["content"]
        assert back == twin and twin

        # every resident heap busy (reading long documents): one more heap -> 503 + Retry-After
        streams, clients = [], []
        for _ in range(fit):
            sid = httpx.post(srv.url + "/v1/sessions", timeout=60).json()["id"]
            c = httpx.Client(timeout=120)
            clients.append(c)
            req = c.build_request("POST", f"{srv.url}/v1/sessions/{sid}/documents", json={"text": DOC * 40})
            r = c.send(req, stream=True)
            lines = r.iter_lines()        # kept referenced: a collected iterator closes the stream
            assert any(line.startswith("event: progress") for line in lines)   # reading: its heap is busy
            streams.append((r, lines))
        refused = httpx.post(srv.url + "/v1/sessions", timeout=60).json()["id"]
        r = srv.ask(refused)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "ram_budget_exceeded" and int(r.headers["Retry-After"]) >= 1
        for (r, _), c in zip(streams, clients):
            r.close()
            c.close()
        time.sleep(0.5)

        assert srv.peak_rss <= budget, (srv.peak_rss, budget)

        # restart: twins b/b2 again; b2 answers now, b after the restart
        doc2 = DOC.replace("note", "memo")
        b, b2 = srv.new_session(doc2), srv.new_session(doc2)
        expect = srv.ask(b2).json()["choices"][0]["message"]["content"]
        before = {sid: s["tokens"] for sid, s in srv.sessions().items()}
    finally:
        srv.stop()
    assert srv.proc.returncode == 0 or srv.proc.returncode == -signal.SIGINT
    srv2 = Server(str(budget), tmp_path)
    try:
        after = srv2.sessions()
        assert {sid: s["tokens"] for sid, s in after.items()} == before
        assert all(s["state"] == ("spilled" if s["tokens"] else "empty") for s in after.values())
        assert srv2.ask(b).json()["choices"][0]["message"]["content"] == expect
    finally:
        srv2.stop()
    assert srv2.peak_rss <= budget


def test_budget_too_small_refuses_to_start_with_advice():
    r = subprocess.run([sys.executable, "-m", "localheap.cli", "serve", "--model", MODEL, "--backend", "mlx",
                        "--ram-budget", "64M", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "RAM budget 64.0 MiB is too small" in r.stderr and "--ram-budget" in r.stderr
