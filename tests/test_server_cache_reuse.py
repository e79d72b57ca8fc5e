"""--cache-reuse through the server: a client that trims its oldest messages (to fit its own
context window) resends the conversation without them; with the flag the session it trims is cut
to what the shorter history keeps and only the new turn is read, without it the shorter history is
read again in a new session. Replies are forced (conftest `force`): the turns are the same text
in both servers."""

from __future__ import annotations

import re

import httpx
import pytest

openai = pytest.importorskip("openai")

from localheap.grammar import ForcedTokens  # noqa: E402
from localheap.heap import HeapConfig  # noqa: E402
from tool_server import qwen_model, serve  # noqa: E402

HEAP = HeapConfig(budget=64, slack=32, recent=16)   # the conversation outgrows it: a cut after evictions
SYSTEM = {"role": "system", "content": "You answer in one short line about the heap."}
QUESTIONS = [f"Question {i}: which tokens does the heap keep when the context grows past its budget?" for i in range(5)]
REPLY = "It keeps the sinks, the recent window and the tokens that drew attention."


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory, torch_one_thread):
    model = qwen_model(model_dirs, tmp_path_factory)
    with serve(model, heap=HEAP, cache_reuse=16) as on, serve(model, heap=HEAP) as off:
        yield {"on": on, "off": off}


def chat(srv, messages) -> tuple[dict, str]:
    svc = srv.services
    ids = svc.tokenizer.encode(REPLY, add_special_tokens=False)
    svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       json={"model": "m", "messages": messages, "max_tokens": 40})
    finally:
        svc.force_tokens = None
    assert r.status_code == 200, r.text
    return r.json(), r.headers["X-Session-Id"]


def cuts(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=60).text
    return float(re.search(r"^localheap_session_cuts(?:_total)? ([0-9.e+-]+)$", text, re.M).group(1))


def test_a_trimmed_history_is_cut_from_its_session_with_the_flag_and_read_again_without(servers):
    got = {}
    for arm, srv in servers.items():
        history, sid = [SYSTEM], None
        for q in QUESTIONS[:4]:
            history.append({"role": "user", "content": q})
            body, sid_now = chat(srv, history)
            read = body["usage"]["prompt_tokens"] - body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert sid in (None, sid_now) and body["choices"][0]["message"]["content"] == REPLY
            sid = sid_now
            history.append({"role": "assistant", "content": REPLY})
        trimmed = [SYSTEM] + history[3:] + [{"role": "user", "content": QUESTIONS[4]}]   # the first exchange dropped
        body, sid_trimmed = chat(srv, trimmed)
        session = httpx.get(f"{srv.url}/v1/sessions/{sid_trimmed}", timeout=60).json()
        got[arm] = (body["usage"], sid_trimmed == sid, session, cuts(srv), read)
    usage, same, session, n, read = got["on"]
    assert same and n == 1
    prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    print(prompt, cached, read)
    assert prompt - cached == read   # only the new turn was read, as in the untrimmed turn before it
    assert session["tokens"] == prompt + usage["completion_tokens"] - 1   # the session holds the shorter history
    assert session["heap"]["tokens_seen"] == session["tokens"]
    usage_off, same_off, _, n_off, _ = got["off"]
    assert not same_off and n_off == 0 and usage_off["prompt_tokens"] == prompt
    assert usage_off["prompt_tokens_details"]["cached_tokens"] < 20   # the system prompt at most
