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
QUESTION = "which tokens does the heap keep when the context grows past its budget?"
REPLY = "It keeps the sinks, the recent window and the tokens that drew attention."


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory, torch_one_thread):
    model = qwen_model(model_dirs, tmp_path_factory)
    with serve(model, heap=HEAP, cache_reuse=16) as on, serve(model, heap=HEAP) as off:
        yield {"on": on, "off": off}


def chat(srv, messages, forced: str = REPLY, **extra) -> tuple[dict, str]:
    svc = srv.services
    ids = svc.tokenizer.encode(forced, add_special_tokens=False)
    svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       json={"model": "m", "messages": messages, "max_tokens": 80, **extra})
    finally:
        svc.force_tokens = None
    assert r.status_code == 200, r.text
    return r.json(), r.headers["X-Session-Id"]


def cuts(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=60).text
    return float(re.search(r"^localheap_session_cuts(?:_total)? ([0-9.e+-]+)$", text, re.M).group(1))


def converse(srv, system: dict, topic: str, forced: str = REPLY, **extra) -> dict:
    """Four turns, then the history without its first exchange and a fifth question (`extra` in that
    request's body): its usage, whether it ran on the same session, that session, the server's
    cuts, and how many tokens the fourth turn read."""
    history, sid = [system], None
    for i in range(4):
        history.append({"role": "user", "content": f"{topic} {i}: {QUESTION}"})
        body, sid_now = chat(srv, history, forced)
        assert sid in (None, sid_now) and body["choices"][0]["message"]["content"] == REPLY
        read = body["usage"]["prompt_tokens"] - body["usage"]["prompt_tokens_details"]["cached_tokens"]
        sid = sid_now
        history.append({"role": "assistant", "content": REPLY})
    before = cuts(srv)
    trimmed = [system] + history[3:] + [{"role": "user", "content": f"{topic} 4: {QUESTION}"}]
    body, sid_trimmed = chat(srv, trimmed, forced, **extra)
    session = httpx.get(f"{srv.url}/v1/sessions/{sid_trimmed}", timeout=60).json()
    return {"usage": body["usage"], "same": sid_trimmed == sid, "session": session, "cuts": cuts(srv) - before,
            "read": read}


def test_a_trimmed_history_is_cut_from_its_session_with_the_flag_and_read_again_without(servers):
    got = {arm: converse(srv, SYSTEM, "Question") for arm, srv in servers.items()}
    on = got["on"]
    assert on["same"] and on["cuts"] == 1
    prompt, cached = on["usage"]["prompt_tokens"], on["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt - cached == on["read"]   # only the new turn was read, as in the untrimmed turn before it
    assert on["session"]["tokens"] == prompt + on["usage"]["completion_tokens"] - 1   # the shorter history
    assert on["session"]["heap"]["tokens_seen"] == on["session"]["tokens"]
    off = got["off"]
    assert not off["same"] and off["cuts"] == 0 and off["usage"]["prompt_tokens"] == prompt
    assert off["usage"]["prompt_tokens_details"]["cached_tokens"] < 20   # the system prompt at most


def test_a_request_sets_its_own_cache_reuse_as_llama_servers_n_cache_reuse(servers):
    system = {"role": "system", "content": "You answer in one line about eviction."}
    asked = converse(servers["off"], system, "Query", n_cache_reuse=16)
    assert asked["same"] and asked["cuts"] == 1
    refused = converse(servers["on"], system, "Query", n_cache_reuse=0)
    assert not refused["same"] and refused["cuts"] == 0


def test_llama_servers_completion_route_takes_n_cache_reuse():
    from localheap.server.llamacpp import LlamaRequest

    assert LlamaRequest(prompt="x", n_cache_reuse=256).n_cache_reuse == 256
    with pytest.raises(ValueError):
        LlamaRequest(prompt="x", n_cache_reuse=-1)


def test_gpt_oss_is_cut_with_its_sliding_layers_as_they_are(model_dirs, tmp_path_factory, torch_one_thread):
    """gpt-oss (harmony; sliding layers beside the heap, which a cut leaves as they are where their
    window lies in the last span kept). A final answer comes back as it was sampled; a reply with
    reasoning comes back without it (the template drops past analysis), which each turn cuts out
    of the session, the answer kept. Either way the trimmed history's runs reach the session's
    end and only the new turn is read."""
    from family_templates import harmony_model

    model = harmony_model(model_dirs, tmp_path_factory.mktemp("harmony") / "m")
    final = "<|channel|>final<|message|>" + REPLY
    thought = "<|channel|>analysis<|message|>the heap question again<|end|><|start|>assistant" + final
    with serve(model, heap=HEAP, cache_reuse=16) as srv:
        plain = converse(srv, SYSTEM, "Question", forced=final)
        before = cuts(srv)
        reasoned = converse(srv, SYSTEM, "Query", forced=thought)
        assert cuts(srv) - before >= 4   # the analysis of each of the 3 later turns, then the trim
    for got in (plain, reasoned):
        assert got["same"] and got["cuts"] == 1
        assert got["session"]["tokens"] == got["usage"]["prompt_tokens"] + got["usage"]["completion_tokens"] - 1
        usage = got["usage"]
        assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] == got["read"]
