"""`localheap bench turns`: a conversation whose chat template rewrites each reply, run past the
heap through the server: rewinding the heap to where the reply began (`--rewind on`, the default)
against reading the conversation again (`--rewind off`), turn by turn interleaved in one run.

Every reply is the same forced text in both arms: a reasoning block then an answer (the decode
steps run as usual, on the model, whatever its weights). The client sends back only the answer, as
clients of reasoning models do (Qwen3's template drops past reasoning itself), so each next prompt
leaves the session where the reply began. Two servers in this process share the loaded model, one
per arm; each turn is sent to one and then the other (which first alternates). Reports, per turn and in all, the prompt
tokens each arm read (prompt_tokens - cached_tokens) and the seconds each request took.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Callable
from urllib.parse import urlparse

ARMS = ("rewind", "again")   # --rewind on, --rewind off (the conversation read again)


def _text(tokenizer, n: int, what: str) -> str:
    """Words about `what` that the tokenizer reads as about `n` tokens."""
    ids = tokenizer.encode(" ".join(f"{what} {i} of the talk" for i in range(n)), add_special_tokens=False)
    return tokenizer.decode(ids[:n]).strip()


def _post(url: str, body: dict, timeout: float = 3600.0) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"the server answered {resp.status}: {data}")
        return data
    finally:
        conn.close()


def run(backend, cfg, turns: int, question: int, reasoning: int, answer: int, log: Callable[[str], None]) -> dict:
    """question, reasoning, answer: about how many tokens each user message, reply's reasoning and
    reply's answer holds."""
    from ..grammar import ForcedTokens
    from ..server import ServerSettings, create_app
    from ..server.testing import ServerThread

    servers = {arm: ServerThread(create_app(backend, ServerSettings(heap=cfg.with_(rewind=arm == "rewind"),
                                                                    web_dir=None))).start() for arm in ARMS}
    try:
        for srv in servers.values():   # warm-up (first-use costs), a session no turn shares enough with
            srv.services.force_tokens = None
            _post(srv.url, {"model": srv.services.model_id, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "warm up"}]})
        history = {arm: [] for arm in ARMS}
        rows = []
        for t in range(turns):
            tok = backend.tokenizer
            said = _text(tok, answer, f"answer {t} word")
            reply = f"<think>\n{_text(tok, reasoning, f'thought {t}')}\n</think>\n\n{said}"
            ids = tok.encode(reply, add_special_tokens=False)
            asked = _text(tok, question, f"note {t} line")
            row = {"turn": t + 1}
            for arm in (ARMS if t % 2 == 0 else ARMS[::-1]):   # interleaved, each arm first every other turn
                srv = servers[arm]
                srv.services.force_tokens = lambda: ForcedTokens(ids, backend.eos_token_ids)
                history[arm].append({"role": "user", "content": asked})
                start = time.perf_counter()
                out = _post(srv.url, {"model": srv.services.model_id, "messages": history[arm],
                                      "max_tokens": len(ids) + 8, "temperature": 0})
                seconds = time.perf_counter() - start
                history[arm].append({"role": "assistant", "content": said})   # the reasoning dropped
                usage = out["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                row.update({"prompt": usage["prompt_tokens"], f"{arm}_read": usage["prompt_tokens"] - cached,
                            f"{arm}_s": seconds, f"{arm}_session": out.get("localheap", {}).get("session_id")})
            log(f"turn {t + 1}: prompt {row['prompt']} tokens; read {row['rewind_read']} (rewind), "
                f"{row['again_read']} (read again)")
            rows.append(row)
    finally:
        for srv in servers.values():
            srv.stop()
    total = {arm: {"read": sum(r[f"{arm}_read"] for r in rows), "seconds": sum(r[f"{arm}_s"] for r in rows),
                   "sessions": len({r[f"{arm}_session"] for r in rows})} for arm in ARMS}
    return {"rows": rows, "total": total,
            "read_ratio": total["again"]["read"] / max(1, total["rewind"]["read"]),
            "seconds_ratio": total["again"]["seconds"] / max(1e-9, total["rewind"]["seconds"])}


def report(result: dict, cfg, table) -> str:
    t = result["total"]
    return "\n".join([
        f"heap budget {cfg.budget} (+{cfg.sinks} sinks, {cfg.slack} slack); prompt tokens read per turn "
        "(prompt_tokens - cached_tokens) and seconds per request, rewinding or reading the conversation again",
        table(result["rows"], [("turn", "turn", "d"), ("prompt", "prompt", "d"), ("rewind_read", "read: rewind", "d"),
                               ("again_read", "read: again", "d"), ("rewind_s", "s: rewind", ".2f"),
                               ("again_s", "s: again", ".2f")]),
        f"in all: rewind read {t['rewind']['read']} tokens in {t['rewind']['seconds']:.1f} s "
        f"({t['rewind']['sessions']} session(s)); reading again {t['again']['read']} tokens in "
        f"{t['again']['seconds']:.1f} s ({t['again']['sessions']} sessions): {result['read_ratio']:.1f}x the "
        f"tokens, {result['seconds_ratio']:.2f}x the time"])
