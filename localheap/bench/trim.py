"""`localheap bench trim`: a client that trims its oldest messages to fit its own context window
(as chat front ends with a context setting do), run through the server: cutting the session to
the shorter history (`serve --cache-reuse N`) against reading that history again (the default),
turn by turn interleaved in one run.

Every reply is the same forced text in both arms (the decode steps run on the model as usual).
Before each turn the client drops its oldest user/assistant pairs until the system message and
what is left fit in `window` tokens (counted as the chat template renders them). Two servers in
this process share the loaded model, one per arm; each turn is sent to one and then the other
(which first alternates). Reports, per turn and in all, the prompt tokens each arm read
(prompt_tokens - cached_tokens) and the seconds each request took.

With `facts` K > 0 the system message holds K pass keys (facts.FACT, held-out names), which a
trim never drops; after the last turn each arm is asked for every key (bench/turns._ask). The keys
each arm gives back say what a cut heap (its K/V still shaped by the trimmed messages) costs the
answers against one read anew. With `facts_in` "message" the keys open the user message of the
middle turn instead: the window must still hold it at the end (checked), and past the heap it has
been evicted, so the answers say whether a cut keeps what recall brings back of the kept runs.
"""

from __future__ import annotations

import time
from typing import Callable

from .turns import _ask, _planted, _post, _read, _text

ARMS = ("reuse", "again")   # --cache-reuse N, --cache-reuse 0 (the shorter history read again)


def _fit(hf, system: dict, history: list[dict], window: int) -> tuple[list[dict], int]:
    """The newest whole exchanges of `history` that fit in `window` tokens with `system` (the
    last user message always stays); and how many tokens the rendered prompt holds."""
    from .needle import encode

    kept = list(history)
    while True:
        n = len(encode(hf, hf.apply_chat_template([system] + kept, tokenize=False, add_generation_prompt=True)))
        if n <= window or len(kept) <= 1:
            return [system] + kept, n
        kept = kept[2:]   # the oldest user message and its reply


def run(backend, cfg, turns: int, window: int, question: int, answer: int, min_chunk: int,
        log: Callable[[str], None], facts: int = 0, facts_in: str = "system") -> dict:
    """window: tokens the client's prompt may hold; question, answer: about how many tokens each
    user message and reply holds; min_chunk: the reuse arm's --cache-reuse."""
    from ..grammar import ForcedTokens
    from ..server import ServerSettings, create_app
    from ..server.testing import ServerThread
    from . import needle
    from .facts import FACT

    hf = needle._hf(backend.tokenizer)
    planted = _planted(facts)
    keys = "".join(" " + FACT.format(name=n, key=k).strip() for n, k in planted)
    system = {"role": "system", "content": "You answer briefly." + (keys if facts_in == "system" else "")}
    keyed = turns // 2 if facts_in == "message" and planted else None   # the turn whose message holds them
    servers = {arm: ServerThread(create_app(backend, ServerSettings(
        heap=cfg, web_dir=None, cache_reuse=min_chunk if arm == "reuse" else 0))).start() for arm in ARMS}
    try:
        for srv in servers.values():   # warm-up (first-use costs), a session no turn shares enough with
            srv.services.force_tokens = None
            _post(srv.url, {"model": srv.services.model_id, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "warm up"}]})
        history: list[dict] = []
        rows = []
        for t in range(turns):
            tok = backend.tokenizer
            said = _text(tok, answer, f"answer {t} word")
            ids = tok.encode(said, add_special_tokens=False)
            text = _text(tok, question, f"note {t} line")
            history.append({"role": "user", "content": keys.strip() + " " + text if t == keyed else text})
            messages, n = _fit(hf, system, history, window)
            history = messages[1:]
            row = {"turn": t + 1, "prompt": n, "messages": len(messages)}
            for arm in (ARMS if t % 2 == 0 else ARMS[::-1]):   # interleaved, each arm first every other turn
                srv = servers[arm]
                srv.services.force_tokens = lambda: ForcedTokens(ids, backend.eos_token_ids)
                start = time.perf_counter()
                out = _post(srv.url, {"model": srv.services.model_id, "messages": messages,
                                      "max_tokens": len(ids) + 8, "temperature": 0})
                seconds = time.perf_counter() - start
                row.update({"prompt": out["usage"]["prompt_tokens"], f"{arm}_read": _read(out["usage"]),
                            f"{arm}_s": seconds, f"{arm}_session": out.get("localheap", {}).get("session_id")})
            history.append({"role": "assistant", "content": said})
            log(f"turn {t + 1}: prompt {row['prompt']} tokens ({row['messages']} messages); read "
                f"{row['reuse_read']} (reuse), {row['again_read']} (read again)")
            rows.append(row)
        cuts = servers["reuse"].services.store.cuts   # the turns' (the probe's first question may trim once more)
        probes = None
        if planted:
            messages, _ = _fit(hf, system, history + [{"role": "user", "content": "?"}], window)
            if keyed is not None and not any(keys.strip() in str(m["content"]) for m in messages):
                raise ValueError(f"the window no longer holds turn {keyed + 1}'s keys at the end: a larger "
                                 f"--window, or fewer --turns")
            probes = {arm: _ask(backend, servers[arm], messages[:-1], planted) for arm in ARMS}
    finally:
        for srv in servers.values():
            srv.stop()
    trimmed = [r for r in rows if r["messages"] < 2 * r["turn"]]
    total = {arm: {"read": sum(r[f"{arm}_read"] for r in rows), "seconds": sum(r[f"{arm}_s"] for r in rows),
                   "trimmed_s": sum(r[f"{arm}_s"] for r in trimmed),
                   "sessions": len({r[f"{arm}_session"] for r in rows})} for arm in ARMS}
    if probes is not None:
        for arm in ARMS:
            log(f"{arm}: {probes[arm]['hits']} of {len(planted)} keys ({probes[arm]['keys']})")
    return {"rows": rows, "total": total, "cuts": cuts, "trimmed_turns": len(trimmed), "facts_in": facts_in,
            "facts": {"planted": planted, **probes} if probes else None,
            "read_ratio": total["again"]["read"] / max(1, total["reuse"]["read"]),
            "seconds_ratio": total["again"]["seconds"] / max(1e-9, total["reuse"]["seconds"]),
            "trimmed_seconds_ratio": (total["again"]["trimmed_s"] / max(1e-9, total["reuse"]["trimmed_s"])
                                      if trimmed else None)}   # (no turn trimmed: no ratio to give)


def report(result: dict, cfg, window: int, min_chunk: int, table) -> str:
    t = result["total"]
    lines = [
        f"heap budget {cfg.budget} (+{cfg.sinks} sinks, {cfg.slack} slack); a client window of {window} tokens; "
        f"prompt tokens read per turn (prompt_tokens - cached_tokens) and seconds per request, cutting the session "
        f"to the trimmed history (--cache-reuse {min_chunk}) or reading it again",
        table(result["rows"], [("turn", "turn", "d"), ("messages", "messages", "d"), ("prompt", "prompt", "d"),
                               ("reuse_read", "read: reuse", "d"), ("again_read", "read: again", "d"),
                               ("reuse_s", "s: reuse", ".2f"), ("again_s", "s: again", ".2f")]),
        f"in all: reuse read {t['reuse']['read']} tokens in {t['reuse']['seconds']:.1f} s ({t['reuse']['sessions']} "
        f"session(s), {result['cuts']} cuts); reading again {t['again']['read']} tokens in {t['again']['seconds']:.1f} s "
        f"({t['again']['sessions']} sessions): {result['read_ratio']:.1f}x the tokens, {result['seconds_ratio']:.2f}x "
        f"the time; " + (f"over the {result['trimmed_turns']} trimmed turns {result['trimmed_seconds_ratio']:.2f}x the time"
                         if result["trimmed_turns"] else "no turn was trimmed (the window held every turn: more "
                         "--turns, or a smaller --window)")]
    found = result.get("facts")
    if found:
        k = len(found["planted"])
        where = "the system message" if result.get("facts_in", "system") == "system" else "the middle turn's message"
        lines.append(f"pass keys in {where}, asked after the last turn: reuse {found['reuse']['hits']} "
                     f"of {k}, read again {found['again']['hits']} of {k}")
    return "\n".join(lines)
