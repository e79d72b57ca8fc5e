"""A `localheap serve` subprocess on the bundled demo model (torch, a small heap with recall on,
so a document pages out and a question recalls), and what the crash tests ask of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import httpx
from server_process import free_port, wait_until_healthy

FLAGS = ["--backend", "torch", "--budget", "96", "--slack", "32", "--recent", "16", "--recall", "on",
         "--recall-budget", "32", "--page-size", "8", "--prefill-chunk", "32", "--policy", "snapkv"]
DOC = " ".join(f"Fact {i}: the heap keeps item {i * 7 % 13} in slot {i}." for i in range(24))
OPS = [("doc", DOC), ("chat", "What is fact 3?"), ("chat", "And fact 5?")]
QUESTION = "Which fact came last?"
START_TIMEOUT_S = 240
DOWN = (httpx.TransportError,)   # the server went away under the request


class Server:
    def __init__(self, sessions_dir: Path, fault: Optional[str] = None):
        self.dir = Path(sessions_dir)
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("LOCALHEAP_FAULT", None)
        if fault:
            env["LOCALHEAP_FAULT"] = fault
        self.log = open(self.dir.parent / f"{self.dir.name}.{self.url.rsplit(':', 1)[1]}.log", "w+")
        cmd = [sys.executable, "-m", "localheap.cli", "serve", "--port", self.url.rsplit(":", 1)[1],
               "--sessions-dir", str(self.dir), "--log-level", "info", *FLAGS]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            wait_until_healthy(self.proc, self.url, START_TIMEOUT_S)
        except (RuntimeError, AttributeError) as e:   # its output is in the log file, not a pipe
            raise RuntimeError(f"server did not start ({e}):\n{self.output()}") from None

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def create(self) -> str:
        r = httpx.post(self.url + "/v1/sessions", timeout=60)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def op(self, sid: str, op: tuple) -> int:
        """Run one op; returns the session's tokens once it was acknowledged."""
        kind, text = op
        if kind == "doc":
            r = httpx.post(f"{self.url}/v1/sessions/{sid}/documents", json={"text": text, "stream": False},
                           timeout=600)
        else:
            r = httpx.post(self.url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=600,
                           json={"model": "demo", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200, r.text
        return self.tokens(sid)

    def ask(self, sid: str, text: str = QUESTION) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=600,
                          json={"model": "demo", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": text}]})

    def tokens(self, sid: str) -> int:
        return httpx.get(f"{self.url}/v1/sessions/{sid}", timeout=60).json()["tokens"]

    def sessions(self) -> dict:
        return {s["id"]: s for s in httpx.get(self.url + "/v1/sessions", timeout=60).json()["data"]}

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=60).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(localheap_\w+) ([0-9.e+-]+)$", text, re.M)}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        self.log.close()


def leftovers(root: Path, sessions: dict) -> list[str]:
    """What a restart should have adopted or removed and did not: temp files, page stores of no
    session or with other states than the committed one, incomplete checkpoints."""
    bad = []
    for p in root.rglob("*"):
        name = p.name
        if name.endswith(".tmp") or ".tmp." in name or name.endswith(".own") or name in ("meta.json", "tail.npz"):
            bad.append(str(p.relative_to(root)))
    for p in root.glob("sess_*.pages"):
        sid = p.name[: -len(".pages")]
        if sid not in sessions:
            bad.append(f"{p.name}: page store of no session")
            continue
        states = sorted(f.name for f in p.glob("state.*.npz"))
        gens = sorted(int(f.name.split(".")[1]) for f in root.glob(f"{sid}.*.safetensors"))
        if len(states) > 1 or (states and [int(states[0].split(".")[1])] != gens[-1:]):
            bad.append(f"{p.name}: states {states}, heap generations {gens}")
    for folder in (root / "checkpoints").glob("*") if (root / "checkpoints").is_dir() else []:
        if folder.name not in sessions:
            bad.append(f"checkpoints/{folder.name}: of no session")
            continue
        heaps = {f.name.split(".")[0] for f in folder.glob("*.safetensors")}
        for f in folder.iterdir():
            if f.name.split(".")[0] not in heaps:
                bad.append(f"checkpoints/{folder.name}/{f.name}: no heap file completes it")
        listed = set(sessions[folder.name]["checkpoints"])
        if {int(h) for h in heaps} != listed:
            bad.append(f"checkpoints/{folder.name}: files {sorted(heaps)}, listed {sorted(listed)}")
    return bad
