"""`localheap bench serve`: concurrent clients against running servers, the batched engine
against the round-robin one measured in the same run.

Starts one `localheap serve` subprocess per engine (same model and heap flags), gives every
client its own session holding a document of `context` tokens, then for each client count N
sends N streaming completions at once (servers interleaved: N=1 batched, N=1 round-robin,
N=2 ...). Reports aggregate decode tokens/s, time to first token, inter-token latency p50/p99
and the server's peak RSS. A second table: one chat decoding while another session reads a
long document, against each alone. Talks HTTP only (stdlib), so it measures what a client sees.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional
from urllib.parse import urlparse

import numpy as np
import psutil

WORDS = ("river stone cloud lamp honey mango quartz jasper kite umber amber cedar falcon meadow harbor "
         "lantern orchard pepper saddle thistle velvet walnut yarrow zephyr").split()


class Server:
    """A `localheap serve` subprocess on a free port; samples its RSS while it runs."""

    def __init__(self, name: str, serve_args: list[str], threads: Optional[int], log: Callable[[str], None],
                 extra_env: Optional[dict] = None, persist: bool = False):
        """persist: the server saves every turn (serve's default), its sessions directory in the
        server's own temp dir; else --no-persist."""
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.TemporaryDirectory(prefix="localheap-bench-serve-")
        env = dict(os.environ, LOCALHEAP_CACHE=self.dir.name)
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        env.update(extra_env or {})
        cmd = [sys.executable, "-m", "localheap.cli", "serve", "--port", str(self.port),
               *([] if persist else ["--no-persist"]), "--log-level", "warning", *serve_args]
        log(f"[{name}] {' '.join(cmd[2:])}")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.peak_rss = 0
        self._stop = threading.Event()
        try:   # (interrupted while it starts: stopped here, the caller does not hold it yet)
            self._wait_healthy(300.0)
            self.model = request(self.url, "GET", "/v1/models")[1]["data"][0]["id"]
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:   # (a bad model or flag: its own error, said as the command's)
                said = [line for line in self.proc.stdout.read().splitlines() if line.strip()]
                raise ValueError(f"server {self.name} exited with status {self.proc.returncode}: "
                                 + "\n".join(said[-12:]))
            try:
                if request(self.url, "GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server {self.name} did not start in {timeout_s:.0f} s")

    def _sample_rss(self) -> None:
        while not self._stop.is_set():
            self.sample_rss()
            time.sleep(0.05)

    def sample_rss(self) -> None:
        try:
            self.peak_rss = max(self.peak_rss, psutil.Process(self.proc.pid).memory_info().rss)
        except psutil.Error:
            pass

    def reset_peak(self) -> None:
        """From now on (sampled at once: a round shorter than the sampling interval still has one)."""
        self.peak_rss = 0
        self.sample_rss()

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect(url: str, timeout: float = 600.0) -> http.client.HTTPConnection:
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def request(url: str, method: str, path: str, body: Optional[dict] = None, headers: Optional[dict] = None):
    """(status, parsed JSON or None) of one request."""
    conn = _connect(url, timeout=600.0)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data else None)
    finally:
        conn.close()


def sse(url: str, path: str, body: dict, headers: Optional[dict] = None) -> Iterator[tuple[float, str, str]]:
    """(arrival time, event name, data) of a server-sent event stream."""
    conn = _connect(url)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: {resp.status} {resp.read()[:300]!r}")
        event, data = "message", []
        for raw in resp:
            line = raw.decode().rstrip("\r\n")
            if not line:
                if data:
                    yield time.monotonic(), event, "\n".join(data)
                event, data = "message", []
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
    finally:
        conn.close()


def words_text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def text_of_tokens(url: str, tokens: int, seed: int) -> str:
    """Text the server's tokenizer reads as about `tokens` tokens (measured with /v1/tokenize)."""
    sample = words_text(2000, seed)
    per_word = request(url, "POST", "/v1/tokenize", {"text": sample})[1]["count"] / 2000
    return words_text(max(1, int(tokens / per_word)), seed)


def new_session(url: str) -> str:
    status, snap = request(url, "POST", "/v1/sessions")
    assert status == 201, (status, snap)
    return snap["id"]


def feed(url: str, sid: str, text: str, progress: Optional[list] = None) -> dict:
    """Read `text` into session `sid` as a raw document; `progress` gets (time, tokens done)."""
    for at, event, data in sse(url, f"/v1/sessions/{sid}/documents", {"text": text, "raw": True}):
        body = json.loads(data)
        if event == "progress" and progress is not None:
            progress.append((at, body["done"]))
        elif event == "done":
            return body
        elif event == "error":
            raise RuntimeError(f"document read failed: {data}")
    raise RuntimeError("document stream ended without done")


@dataclass
class Reply:
    began: float
    arrivals: list[float] = field(default_factory=list)   # one per streamed chunk with text
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.began

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.arrivals))


def complete(server: Server, sid: str, prompt: str, max_tokens: int) -> Reply:
    """A streamed completion on session `sid`; greedy."""
    url = server.url
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    reply = Reply(time.monotonic())
    for at, _, data in sse(url, "/v1/completions", body, {"X-Session-Id": sid}):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            reply.tokens = chunk["usage"]["completion_tokens"]
        if any(c.get("text") for c in chunk.get("choices", [])):
            reply.arrivals.append(at)
    return reply


def together(fns: list[Callable[[], object]]) -> list:
    """Run the calls in threads released at once; their results in order."""
    out: list = [None] * len(fns)
    errors: list = []
    gate = threading.Barrier(len(fns))

    def run(i: int, fn) -> None:
        gate.wait()
        try:
            out[i] = fn()
        except Exception as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def clients_round(server: Server, sessions: list[str], n: int, max_tokens: int, prompt: str) -> dict:
    """n clients at once, each on its own session: one row of the concurrency table."""
    server.reset_peak()
    replies = together([lambda sid=sid: complete(server, sid, prompt, max_tokens) for sid in sessions[:n]])
    first = min(r.arrivals[0] for r in replies if r.arrivals)
    last = max(r.arrivals[-1] for r in replies if r.arrivals)
    decoded = sum(max(0, len(r.arrivals) - 1) for r in replies)
    gaps = [g for r in replies for g in r.gaps]
    return {"engine": server.name, "clients": n, "tokens": sum(r.tokens for r in replies),
            "decode_tok_s": decoded / (last - first) if last > first else None,
            "ttft_ms": 1e3 * float(np.median([r.ttft for r in replies])),
            "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else None,
            "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else None,
            "peak_rss": (server.sample_rss(), server.peak_rss)[1]}


def chat_beside_document(server: Server, doc_tokens: int, max_tokens: int, prompt: str,
                         log: Callable[[str], None]) -> dict:
    """A chat's decode rate and a document's ingest rate, each alone, then at the same time."""
    url = server.url
    text = text_of_tokens(url, doc_tokens, seed=99)
    chat = new_session(url)
    complete(server, chat, prompt, 4)                       # warm: the session exists with its prompt
    alone_chat = _decode_rate(complete(server, chat, prompt, max_tokens))
    progress: list = []
    feed(url, new_session(url), text, progress)
    alone_doc = _ingest_rate(progress, progress[0][0], progress[-1][0])
    log(f"[{server.name}] alone: chat {alone_chat or 0:.1f} tok/s, document {alone_doc or 0:,.0f} tok/s")
    progress = []
    reader = threading.Thread(target=feed, args=(url, new_session(url), text, progress))
    reader.start()
    while not progress or progress[-1][1] < doc_tokens * 0.1:   # the read is well under way
        time.sleep(0.05)
    reply = complete(server, chat, prompt, max_tokens)
    reader.join()
    side_chat = _decode_rate(reply)
    side_doc = _ingest_rate(progress, reply.arrivals[0], reply.arrivals[-1])
    return {"engine": server.name, "doc_tokens": doc_tokens, "chat_alone": alone_chat, "chat_beside": side_chat,
            "chat_ratio": side_chat / alone_chat if side_chat and alone_chat else None, "doc_alone": alone_doc,
            "doc_beside": side_doc, "doc_ratio": side_doc / alone_doc if side_doc and alone_doc else None}


def _decode_rate(reply: Reply) -> Optional[float]:
    """Tokens/s after the first; None where there is no second token to time (shown "-", JSON null)."""
    span = reply.arrivals[-1] - reply.arrivals[0] if reply.arrivals else 0.0
    return (len(reply.arrivals) - 1) / span if span > 0 else None


def _ingest_rate(progress: list, start: float, end: float) -> Optional[float]:
    """Tokens/s of a document read between `start` and `end`, from its (time, done) progress events."""
    at = np.array([t for t, _ in progress])
    done = np.array([d for _, d in progress], dtype=float)
    if end <= start or len(at) < 2:
        return None
    return float((np.interp(end, at, done) - np.interp(start, at, done)) / (end - start))


ENGINE_FLAGS = {"batched": [], "mixed": ["--prefill-lane", "off"], "passive": [], "round-robin": ["--round-robin"]}
ENGINE_ENV = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}}   # batched, OpenMP workers sleeping between steps
CLIENT_COLUMNS = [("clients", "clients", "d"), ("engine", "engine", ""), ("decode_tok_s", "decode tok/s", ",.1f"),
                  ("vs_one", "x 1 client", ".2f"), ("vs_round_robin", "x round-robin", ".2f"),
                  ("ttft_ms", "TTFT ms (p50)", ",.0f"), ("itl_p50_ms", "ITL p50 ms", ".1f"),
                  ("itl_p99_ms", "ITL p99 ms", ".1f"), ("peak_rss", "peak RSS MiB", ",.0f")]
SIDE_COLUMNS = [("engine", "engine", ""), ("doc_tokens", "document", ","), ("chat_alone", "chat alone tok/s", ".1f"),
                ("chat_beside", "chat beside tok/s", ".1f"), ("chat_ratio", "chat kept", ".2f"),
                ("doc_alone", "doc alone tok/s", ",.0f"), ("doc_beside", "doc beside tok/s", ",.0f"),
                ("doc_ratio", "doc kept", ".2f")]


def run(args) -> int:
    """The command: start the servers, fill the sessions, run the rounds interleaved, print tables."""
    import shlex

    from ..bench.report import emit, table

    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINE_FLAGS for e in engines):
        raise ValueError(f"--engines are some of {', '.join(ENGINE_FLAGS)}: {args.engines!r}")
    most = max(args.clients)
    common = ["--max-active", str(max(most, 2)), "--max-resident-sessions", str(most + 4), "--max-queue", str(most)]
    if args.random_model:
        common += ["--random-model", args.random_model]
    elif args.model:
        common += ["--model", args.model]
    common += ["--backend", args.backend, *shlex.split(args.serve_args)]
    own = {"batched": [f"--max-batch={args.max_batch}"] if args.max_batch else [], "round-robin": []}
    if args.mixed_chunk:
        own["batched"].append(f"--mixed-chunk={args.mixed_chunk}")
    own["mixed"] = own["passive"] = own["batched"]
    servers = {}
    try:
        for name in engines:
            servers[name] = Server(name, common + ENGINE_FLAGS[name] + own[name], args.threads, log, ENGINE_ENV.get(name),
                                   persist=args.persist)
        prompt = " The pass key of river is"
        sessions = {}
        for name, server in servers.items():
            sessions[name] = []
            began = time.monotonic()
            for i in range(most):
                sid = new_session(server.url)
                feed(server.url, sid, text_of_tokens(server.url, args.context[0] + i * args.stagger // most, seed=1 + i))
                complete(server, sid, prompt, 2)   # warm: the prompt's template and first token
                sessions[name].append(sid)
            log(f"[{name}] {most} sessions of {args.context[0]:,} tokens ready in {time.monotonic() - began:.0f} s")
        rows = []
        for n in args.clients:
            for name, server in servers.items():
                row = clients_round(server, sessions[name], n, args.decode_tokens, prompt)
                log(f"[{name}] {n} clients: {row['decode_tok_s'] or 0:.1f} tok/s")
                rows.append(row)
        for r in rows:
            one = next((x for x in rows if x["engine"] == r["engine"] and x["clients"] == min(args.clients)), None)
            rr = next((x for x in rows if x["engine"] == "round-robin" and x["clients"] == r["clients"]), None)
            r["vs_one"] = r["decode_tok_s"] / one["decode_tok_s"] if one and one["decode_tok_s"] else None
            r["vs_round_robin"] = r["decode_tok_s"] / rr["decode_tok_s"] if rr and rr["decode_tok_s"] else None
            r["peak_rss"] = r["peak_rss"] / 2**20
        side = []
        if args.doc_tokens[0] > 0:
            for name, server in servers.items():
                side.append(chat_beside_document(server, args.doc_tokens[0], args.decode_tokens, prompt, log))
    finally:
        for server in servers.values():
            server.stop()
    model = args.random_model and f"random:{args.random_model}" or args.model or "demo"
    head = (f"model {model} | context {args.context[0]:,} tokens per session (+ up to {args.stagger}) | {args.decode_tokens} tokens per client"
            f" | threads {args.threads or 'default'} | serve flags: {' '.join(common)}")
    text = head + "\n" + table(rows, CLIENT_COLUMNS)
    if side:
        text += "\n\nchat beside a document read\n" + table(side, SIDE_COLUMNS)
    emit("serve", text, {"model": model, "rows": rows, "beside": side, "serve_flags": common})
    return 0
