"""`localheap bench slots`: what a llama-server slot file (POST /slots/ID?action=save|restore,
serve --slot-save-path) saves a client that comes back to a long session on a server that does not
hold it (a restart with a fresh sessions directory, another machine): restoring the file and then
sending the next turn, against sending the same prompt to a server that reads it all again.

Per context length: one server reads the prompt (random ids) and replies one token; its slot is
saved (the save's milliseconds and the file's bytes). Then, `repeats` times, alternately first:
a fresh server restores the file and answers the prompt extended by a short follow-up (restore
plus reply, timed from the restore's request to the reply), and a fresh server answers the same
extended prompt read from nothing (timed likewise). Both fresh servers share the loaded model; a
server's start is not timed. Reports each arm's mean, and the ratio read / restore.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

ARMS = ("restore", "read")
FOLLOW = 16   # tokens of the follow-up turn


def _post(url: str, path: str, body: dict, params=None) -> dict:
    import httpx

    r = httpx.post(url + path, json=body, params=params, timeout=3600)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
    return r.json()


def run(backend, cfg, contexts: list[int], repeats: int, log: Callable[[str], None]) -> dict:
    from ..server import ServerSettings, create_app
    from ..server.testing import ServerThread

    root = Path(tempfile.mkdtemp(prefix="localheap-bench-slots-"))
    made = [0]

    def server():
        made[0] += 1
        return ServerThread(create_app(backend, ServerSettings(
            heap=cfg, web_dir=None, sessions_dir=root / f"sessions{made[0]}", slot_save_path=root / "slots",
            default_max_tokens=1)))

    try:
        return _run(backend, contexts, repeats, log, server)
    finally:
        shutil.rmtree(root, ignore_errors=True)   # (the files grow with the contexts: 78 MiB at 64K)


def _run(backend, contexts: list[int], repeats: int, log: Callable[[str], None], server) -> dict:
    rng = np.random.default_rng(0)
    rows = []
    for n in contexts:
        prompt = rng.integers(10, backend.vocab_size, n).tolist()
        follow = rng.integers(10, backend.vocab_size, FOLLOW).tolist()
        name = f"ctx{n}.bin"
        with server() as srv:
            t0 = time.perf_counter()
            _post(srv.url, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0})
            read_s = time.perf_counter() - t0
            held = srv.services.engine.slots.slots[0].last["session_id"]
            tokens = list(srv.services.store.get(held).fed)
            saved = _post(srv.url, "/slots/0", {"filename": name}, {"action": "save"})
        log(f"{n} tokens: read in {read_s:.2f} s; saved {saved['n_saved']} tokens, "
            f"{saved['n_written'] / 2**20:.1f} MiB in {saved['timings']['save_ms']:.0f} ms")
        whole = tokens + follow
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cached: dict[str, int] = {}
        for r in range(repeats):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                with server() as srv:
                    t0 = time.perf_counter()
                    if arm == "restore":
                        _post(srv.url, "/slots/0", {"filename": name}, {"action": "restore"})
                    out = _post(srv.url, "/completion", {"prompt": whole, "n_predict": 1, "temperature": 0})
                    times[arm].append(time.perf_counter() - t0)
                    cached[arm] = out["tokens_cached"]
            log(f"  repeat {r + 1}: restore {times['restore'][-1]:.2f} s, read {times['read'][-1]:.2f} s")
        mean = {arm: sum(v) / len(v) for arm, v in times.items()}
        rows.append({"tokens": len(tokens), "file_mib": saved["n_written"] / 2**20,
                     "save_ms": saved["timings"]["save_ms"], "restore_s": mean["restore"], "read_s": mean["read"],
                     "ratio": mean["read"] / max(mean["restore"], 1e-9), "restore_cached": cached["restore"],
                     "read_cached": cached["read"], "times": times})
    return {"rows": rows, "repeats": repeats, "follow": FOLLOW}


def report(result: dict, cfg, table) -> str:
    recall = "on" if cfg.recall else "off"
    return "\n".join([
        f"heap budget {cfg.budget} (+{cfg.sinks} sinks), recall {recall}; a session's next turn ({result['follow']} "
        f"tokens, one token replied) on a server that does not hold it: its slot file restored first, or the whole "
        f"prompt read again; mean of {result['repeats']}, interleaved",
        table(result["rows"], [("tokens", "tokens", "d"), ("file_mib", "file MiB", ".1f"), ("save_ms", "save ms", ".0f"),
                               ("restore_s", "restore+reply s", ".3f"), ("read_s", "read+reply s", ".3f"),
                               ("ratio", "read / restore", ".1f"), ("restore_cached", "cached: restore", "d"),
                               ("read_cached", "cached: read", "d")])])
