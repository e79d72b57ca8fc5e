"""`localheap bench turns`: a conversation whose chat template rewrites each reply, run past the
heap through the server: rewinding the heap to where the reply began (`--rewind on`, the default)
against reading the conversation again (`--rewind off`), turn by turn interleaved in one run.

Every reply is the same forced text in both arms: a reasoning block then an answer (the decode
steps run as usual, on the model, whatever its weights). The client sends back only the answer, as
clients of reasoning models do (Qwen3's template drops past reasoning itself), so each next prompt
leaves the session where the reply began. Two servers in this process share the loaded model, one
per arm; each turn is sent to one and then the other (which first alternates). Reports, per turn and in all, the prompt
tokens each arm read (prompt_tokens - cached_tokens) and the seconds each request took.

With `facts` K > 0 the first user message opens with K pass keys (facts.FACT, held-out names), and
after the last turn each arm is asked for every key in turn, as the demo model was trained to be
asked (bench/facts: the question, then the answer's prefix; each next question after the last
answer): the first question is the turn the arm rewinds (or reads again) for, the others continue
it. The keys each arm gives back say what a rewound heap costs the answers against a heap read anew.
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


def _post(url: str, body: dict, timeout: float = 3600.0, path: str = "/v1/chat/completions") -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"the server answered {resp.status}: {data}")
        return data
    finally:
        conn.close()


def _read(usage: dict) -> int:
    """Prompt tokens a request read (prompt_tokens - cached_tokens)."""
    return usage["prompt_tokens"] - ((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def _planted(k: int, seed: int = 0) -> list[tuple[str, str]]:
    """k (name, key) pairs: held-out names, keys of distinct digits (needle.make_key)."""
    import numpy as np

    from . import facts, needle

    rng = np.random.default_rng(seed)
    names = list(facts.names(held_out=True))
    if k > len(names):
        raise ValueError(f"--facts: at most {len(names)} (the held-out names)")
    return [(names[i], needle.make_key(rng)) for i in rng.permutation(len(names))[:k]]


def _ask(backend, srv, history: list[dict], planted: list[tuple[str, str]]) -> dict:
    """Each planted key asked after the conversation, one question after the other's answer:
    token ids rendered by the chat template as the chat route renders them, the answer's prefix
    after the generation prompt. Returns the keys given, the hits and the tokens the first read."""
    from . import facts, needle

    hf = needle._hf(backend.tokenizer)
    srv.services.force_tokens = None
    ids, given, read = None, [], None
    for name, key in planted:
        if ids is None:
            text = hf.apply_chat_template(history + [{"role": "user", "content": facts.QUESTION_OF.format(name=name)}],
                                          tokenize=False, add_generation_prompt=True)
            ids = needle.encode(hf, text + facts.ANSWER_OF.format(name=name))
        else:
            ids = ids + facts.follow_up(hf, name)
        out = _post(srv.url, {"model": srv.services.model_id, "prompt": ids, "temperature": 0,
                              "max_tokens": needle.MAX_ANSWER_TOKENS}, path="/v1/completions")
        if read is None:
            read = _read(out["usage"])
        said = out["choices"][0]["text"]
        given.append(needle.read_key(said))
        ids = ids + needle.encode(hf, said)
    return {"keys": given, "hits": sum(g == key for g, (_, key) in zip(given, planted)), "read": read}


def run(backend, cfg, turns: int, question: int, reasoning: int, answer: int, log: Callable[[str], None],
        facts: int = 0) -> dict:
    """question, reasoning, answer: about how many tokens each user message, reply's reasoning and
    reply's answer holds; facts: pass keys planted in the first message and asked after the last turn."""
    from ..grammar import ForcedTokens
    from ..server import ServerSettings, create_app
    from ..server.testing import ServerThread

    from .facts import FACT

    planted = _planted(facts)
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
            if t == 0 and planted:
                asked = "".join(FACT.format(name=n, key=k) for n, k in planted).strip() + " " + asked
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
                row.update({"prompt": out["usage"]["prompt_tokens"], f"{arm}_read": _read(out["usage"]),
                            f"{arm}_s": seconds, f"{arm}_session": out.get("localheap", {}).get("session_id")})
            log(f"turn {t + 1}: prompt {row['prompt']} tokens; read {row['rewind_read']} (rewind), "
                f"{row['again_read']} (read again)")
            rows.append(row)
        probes = {arm: _ask(backend, servers[arm], history[arm], planted) for arm in ARMS} if planted else None
    finally:
        for srv in servers.values():
            srv.stop()
    total = {arm: {"read": sum(r[f"{arm}_read"] for r in rows), "seconds": sum(r[f"{arm}_s"] for r in rows),
                   "sessions": len({r[f"{arm}_session"] for r in rows})} for arm in ARMS}
    if probes is not None:
        for arm in ARMS:
            log(f"{arm}: {probes[arm]['hits']} of {len(planted)} keys ({probes[arm]['keys']}; "
                f"the first question read {probes[arm]['read']} tokens)")
    return {"rows": rows, "total": total, "facts": {"planted": planted, **probes} if probes else None,
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
        f"tokens, {result['seconds_ratio']:.2f}x the time"] + _facts_lines(result.get("facts")))


def _facts_lines(found) -> list[str]:
    if not found:
        return []
    k = len(found["planted"])
    return [f"pass keys planted in the first message, asked after the last turn: rewind {found['rewind']['hits']} "
            f"of {k}, read again {found['again']['hits']} of {k} (the first question read "
            f"{found['rewind']['read']} and {found['again']['read']} tokens)"]
