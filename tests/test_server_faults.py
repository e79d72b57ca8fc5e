"""The real server (uvicorn in a thread, tiny random torch model) under faults and bad input:
a sessions directory that disappears under two concurrent sessions, out-of-range token ids
sent to a named session, empty prompts, lone surrogates, a max_tokens too large, and an
engine that dies (/health 503, the server exits with status 1)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
from server_process import free_port

pytest.importorskip("torch")

from localheap.heap import HeapConfig  # noqa: E402
from localheap.server import ServerSettings, create_app  # noqa: E402
from localheap.server.testing import ServerThread  # noqa: E402

MODEL = "random:llama:tiny"
HEAP = HeapConfig(budget=64, slack=32, recent=16, policy="h2o")


@pytest.fixture(scope="module")
def backend(torch_one_thread):
    from localheap.models import load_backend

    return load_backend(MODEL, "torch")


def settings(tmp_path, **kw) -> ServerSettings:
    kw.setdefault("max_tokens_limit", 256)
    return ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path / "sessions", **kw)


def chat(http, content, sid=None, **kw):
    headers = {"X-Session-Id": sid} if sid else {}
    return http.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL, "temperature": 0, "max_tokens": kw.pop("max_tokens", 4),
        "messages": [{"role": "user", "content": content}], **kw})


def test_spill_into_a_vanished_directory_under_two_sessions(backend, tmp_path):
    app = create_app(backend, settings(tmp_path, max_resident_sessions=1))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        a = chat(http, "first").headers["X-Session-Id"]
        shutil.rmtree(tmp_path / "sessions")
        (tmp_path / "sessions").write_text("not a directory")
        results = {}

        def ask(name, content, sid=None):
            results[name] = chat(http, content, sid, max_tokens=24)

        threads = [threading.Thread(target=ask, args=("a", "again", a)),
                   threading.Thread(target=ask, args=("b", "second"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["a"].status_code == 200
        b = results["b"]
        if b.status_code == 200:   # b ran beside a busy a: the spill failed after its reply, logged
            b = chat(http, "a third session needs room")
        assert b.status_code == 507, b.text
        assert b.json()["error"]["code"] == "sessions_dir_unwritable"
        assert str(tmp_path / "sessions") in b.json()["error"]["message"]
        assert http.get("/health").status_code == 200
        assert http.get(f"/v1/sessions/{a}").json()["state"] == "resident"
        assert chat(http, "still here", a).status_code == 200


def test_bad_input_answers_400_and_keeps_the_session(backend, tmp_path):
    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        r = http.post(f"/v1/sessions/{sid}/documents", json={"text": "a long document " * 40, "stream": False})
        assert r.status_code == 200
        tokens = http.get(f"/v1/sessions/{sid}").json()["tokens"]
        for prompt in ([1, 2, 10**9], [-5], []):
            r = http.post("/v1/completions", headers={"X-Session-Id": sid},
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "the prompt is empty"
        raw = '{"model": "%s", "prompt": "bad \\ud800 text", "max_tokens": 2}' % MODEL
        r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json",
                                                                "X-Session-Id": sid})
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
        raw = '{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL
        assert http.post("/v1/chat/completions", content=raw,
                         headers={"Content-Type": "application/json"}).status_code == 400
        raw = '{"text": "doc \\ud83d"}'
        assert http.post(f"/v1/sessions/{sid}/documents", content=raw,
                         headers={"Content-Type": "application/json"}).status_code == 400
        r = chat(http, "hi", sid, max_tokens=10**9)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert http.get(f"/v1/sessions/{sid}").json()["tokens"] == tokens
        r = http.post("/v1/completions", headers={"X-Session-Id": sid},
                      json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens


def test_a_dead_engine_says_so_and_the_server_exits(backend, tmp_path):
    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        engine = srv.services.engine

        def bug():
            raise RuntimeError("a bug outside any request")

        engine._admit = bug
        r = chat(http, "hello")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        assert http.get("/health").status_code == 503

    from localheap.server.runner import serve_app

    s = settings(tmp_path / "second", port=free_port())
    app = create_app(backend, s)
    result = []
    thread = threading.Thread(target=lambda: result.append(serve_app(app, s, "warning")), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{s.port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    app.state.services.engine._admit = bug
    with httpx.Client(base_url=url, timeout=30) as http:
        chat(http, "hello")
    t0 = time.monotonic()
    thread.join(15)
    assert result == [1] and time.monotonic() - t0 < 10
    time.sleep(0.5)   # the exit deadline is disarmed once the shutdown ended (or it would end pytest)
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer) and t.is_alive()]


def test_the_sessions_dir_is_checked_at_start(backend, tmp_path):
    from localheap.errors import UserError
    from localheap.sessions import SpillFailed

    (tmp_path / "sessions").write_text("a file")
    with pytest.raises(SpillFailed, match="cannot save sessions to .*sessions") as e:
        create_app(backend, settings(tmp_path, persist_sessions=True))
    assert isinstance(e.value, UserError)   # the CLI prints it and exits 2, no traceback


def post_raw(http, path, raw):
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def test_a_lone_surrogate_anywhere_is_a_400_that_names_where(backend, tmp_path):
    """Any field of any route: tool descriptions, a past call's arguments, a message's name, stop
    strings, metadata, a schema, embeddings' inputs, a conversation's items. 400 naming the field in
    the route family's shape, nothing run or made (the tokenizer's TypeError was a 500; a stored
    response's metadata failed to be written after the reply ran; a stop string or a name passed)."""
    app = create_app(backend, settings(tmp_path))
    bad = "\\ud800"
    user = '{"role": "user", "content": "hi"}'
    chat_body = '{"model": "%s", "max_tokens": 2, "messages": [%s]' % (MODEL, user)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        for path, raw, param in (
            ("/v1/chat/completions", chat_body + ', "tools": [{"type": "function", "function": {"name": "f", '
             '"description": "d%s"}}]}' % bad, "tools.0.function.description"),
            ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [%s, {"role": "assistant", '
             '"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '
             '"{\\"a\\": \\"%s\\"}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}' % (MODEL, user, bad),
             "messages.1.tool_calls.0.function.arguments"),
            ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": '
             '"hi", "name": "n%s"}]}' % (MODEL, bad), "messages.0.name"),
            ("/v1/chat/completions", chat_body + ', "stop": ["a", "b\\udfff"]}', "stop.1"),
            ("/v1/chat/completions", chat_body + ', "store": true, "metadata": {"k": "v%s"}}' % bad, "metadata.k"),
            ("/v1/chat/completions", chat_body + ', "response_format": {"type": "json_schema", "json_schema": '
             '{"name": "x", "schema": {"type": "object", "description": "d%s"}}}}' % bad,
             "response_format.json_schema.schema.description"),
            ("/v1/chat/completions", chat_body + ', "logit_bias": {"1%s": 1}}' % bad, "logit_bias.1\\ud800"),
            ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "hi", "stop": "a%s"}' % (MODEL, bad),
             "stop"),
            ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [%s], "tools": [{"name": "f", '
             '"description": "d%s", "input_schema": {"type": "object"}}]}' % (MODEL, user, bad),
             "tools.0.description"),
            ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [%s], "system": "s%s"}' % (MODEL, user, bad),
             "system"),
            ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [%s], "stop_sequences": ["a%s"]}'
             % (MODEL, user, bad), "stop_sequences.0"),
            ("/v1/responses", '{"model": "%s", "max_output_tokens": 2, "input": "hi", "metadata": {"k": "v%s"}}'
             % (MODEL, bad), "metadata.k"),
            ("/v1/responses", '{"model": "%s", "max_output_tokens": 2, "input": "hi", "instructions": "i%s"}'
             % (MODEL, bad), "instructions"),
            ("/v1/embeddings", '{"model": "%s", "input": ["fine", "a%s"]}' % (MODEL, bad), "input.1"),
            ("/v1/conversations", '{"metadata": {"k": "v%s"}}' % bad, "metadata.k"),
            ("/v1/conversations", '{"items": [{"type": "message", "role": "user", "content": "a%s"}]}' % bad,
             "items.0.content"),
            ("/v1/sessions", '{"title": "t%s"}' % bad, "title"),
            ("/tokenize", '{"content": "a%s"}' % bad, "content"),
            ("/completion", '{"prompt": "hi", "n_predict": 2, "stop": ["a%s"]}' % bad, "stop.0"),
            ("/api/generate", '{"model": "%s", "stream": false, "prompt": "hi", "options": {"stop": ["a%s"]}}'
             % (MODEL, bad), "options.stop.0"),
            # (a surrogate written as UTF-8's three bytes, which Python's JSON reader takes too)
            ("/v1/chat/completions", chat_body[:-1] + ', {"role": "user", "content": "a\xed\xa0\x80"}]}',
             "messages.1.content"),
        ):
            r = http.post(path, content=raw.encode("latin-1") if "\xed" in raw else raw,
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            body = r.json()
            err = body["error"] if path.startswith("/v1/") or not path.startswith("/api/") else \
                {"message": body["error"], "param": body["localheap"]["param"]}
            assert err["param"] == param and "lone surrogate" in err["message"], (path, err)
            assert body.get("type") == ("error" if path == "/v1/messages" else None), body   # the family's shape
        r = http.post("/v1/chat/completions", content=chat_body.encode()[:-2] + b'\xff"}]}',
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not UTF-8 text (invalid start byte" in r.json()["error"]["message"], r.text
        # a pair (an emoji as ensure_ascii writes it) is text, an escaped backslash before "ud800" too
        for text, back in (("\\ud83d\\ude00", "\U0001F600"), ("\\\\ud800", "\\ud800")):
            r = http.post("/tokenize", content='{"content": "%s"}' % text, headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            assert http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["content"] == back
        assert http.get("/health").json()["status"] == "ok"
        assert len(srv.services.conversations._convs) == 0   # the refused conversations were not made
        assert http.get("/v1/sessions").json()["data"] == []   # nor sessions, nor replies run
        assert len(srv.services.responses._kept) == 0


def test_every_api_route_checks_its_body_for_lone_surrogates(backend, tmp_path):
    """Every route is a JsonRoute (the test above: what its check answers), so a router added later
    without api_router() fails here."""
    from fastapi.routing import APIRoute

    from localheap.server.routes import JsonRoute

    def walk(routes):   # (FastAPI >= 0.16x keeps an included router whole: its routes are inside)
        for r in routes:
            inner = getattr(r, "original_router", None)
            yield from walk(inner.routes) if inner is not None else [r]

    app = create_app(backend, settings(tmp_path))
    routes = [r for r in walk(app.routes) if isinstance(r, APIRoute) and r.path != "/"]
    assert len(routes) > 50 and all(isinstance(r, JsonRoute) for r in routes), \
        [r.path for r in routes if not isinstance(r, JsonRoute)]


def test_a_route_that_takes_no_body_refuses_one_that_says_something(backend, tmp_path):
    """A checkpoint, a spill, a delete: a body with fields is a 400 naming them (a client sending
    `{"tokens": N}` to checkpoint, which fork takes, learns that it was not read); none, `{}` or
    `null` is what clients send."""
    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = chat(http, "hello there").headers["X-Session-Id"]
        r = http.post(f"/v1/sessions/{sid}/checkpoint", json={"tokens": 3})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == ("POST /v1/sessions/{session_id}/checkpoint takes no body "
                                                "(it was sent one with: tokens)")
        assert http.get(f"/v1/sessions/{sid}").json()["checkpoints"] == []   # nothing was made
        for body in (None, "{}", " null "):
            r = http.post(f"/v1/sessions/{sid}/checkpoint", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 201, r.text
        assert http.post(f"/v1/sessions/{sid}/spill", content="not json").status_code == 400
        assert http.post(f"/v1/sessions/{sid}/spill", json={}).status_code == 200
        assert http.post(f"/v1/sessions/{sid}/stop", json={"now": True}).status_code == 400
        assert http.post(f"/v1/sessions/{sid}/stop", json={}).json()["stopped"] == 0   # (nothing runs on it)
        r = http.request("DELETE", "/v1/responses/resp_x", json={"force": True})
        assert r.status_code == 400 and "takes no body" in r.json()["error"]["message"], r.text
        assert http.delete("/v1/responses/resp_x").status_code == 404   # without one: read as it was
        r = http.post(f"/v1/sessions/{sid}/fork", json={"tokens": 10**6})   # (takes one: the latest checkpoint)
        assert r.status_code == 201, r.text


def test_a_client_gone_before_its_body_is_whole_is_no_internal_error(backend, tmp_path, caplog):
    """Half a body, then the connection closed: a 400 nobody reads, nothing logged as an error (the
    body read before FastAPI's raised ClientDisconnect: two tracebacks, "internal error")."""
    import logging
    import socket

    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http, \
            caplog.at_level(logging.WARNING):
        for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"Content-Length: 500\r\n\r\n{{\"messages\":".encode())
                time.sleep(0.3)
        time.sleep(0.5)
        assert chat(http, "hi").status_code == 200
    # (the server's own records: asyncio may log another test's client, collected meanwhile)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("localheap", "uvicorn"))]
    assert not errors, [r.getMessage() for r in errors]


def test_null_for_an_optional_field_is_leaving_it_out(backend, tmp_path):
    """OpenAI's API takes null for any optional parameter and SDKs send it (`temperature=None`):
    the default, on every route family, where it was a 400 ("Input should be a valid number").
    A required field's null is still a 400."""
    app = create_app(backend, settings(tmp_path))
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "top_k": None}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        a = chat(http, "hello", seed=3, temperature=0.9).json()["choices"][0]["message"]["content"]
        r = chat(http, "hello", seed=3, **{**nulls, "temperature": 0.9})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == a, r.text
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **nulls}),
                           ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                              "temperature": None, "top_p": None, "stream": None}),
                           ("/v1/messages", {"model": MODEL, "max_tokens": 2, "temperature": None, "stream": None,
                                             "messages": [{"role": "user", "content": "hi"}]})):
            assert http.post(path, json=body).status_code == 200, (path, http.post(path, json=body).text)
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": None})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        # an id with a colon of its own answers to ID:latest on Ollama's routes too, as the README says
        r = http.post("/api/show", json={"model": MODEL + ":latest"})
        assert r.status_code == 200, r.text


def test_seeds_are_64_bit_numbers_signed_or_not(backend, tmp_path):
    from localheap.generation import SamplingParams

    assert SamplingParams(seed=-1).seed == 2**64 - 1 and SamplingParams(seed=2**64 + 5).seed == 5
    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        for seed in (2**64, -(2**63) - 1, 10**30):
            r = chat(http, "hi", seed=seed, temperature=1.0)
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        replies = {}
        for seed in (-1, 2**64 - 1, 2**63 - 1):   # (the last with n=2: its second choice's seed wraps)
            r = chat(http, "hi", seed=seed, temperature=1.0, max_tokens=8, n=2)
            assert r.status_code == 200, r.text
            replies[seed] = [c["message"]["content"] for c in r.json()["choices"]]
        assert replies[-1] == replies[2**64 - 1]   # the same seed, written signed and unsigned
        r = http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False,
                                             "options": {"seed": 2**70, "num_predict": 2}})
        assert r.status_code == 400 and r.json()["localheap"]["param"] == "options.seed", r.text


def test_deleting_a_busy_session_ends_its_reply_saying_so(backend, tmp_path):
    """DELETE of a session a request is running on stops that request (it does not wait for it):
    the reply ends with "interrupted": "deleted", nothing saved, and the session is gone."""
    app = create_app(backend, settings(tmp_path, persist_sessions=True, max_tokens_limit=20000))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = chat(http, "first turn").headers["X-Session-Id"]
        chunks = []
        with http.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": sid}, json={
                "model": MODEL, "max_tokens": 20000, "stream": True,
                "logit_bias": {str(t): -100 for t in backend.eos_token_ids},   # (no end before the DELETE)
                "messages": [{"role": "user", "content": "first turn"}, {"role": "assistant", "content": "x"},
                             {"role": "user", "content": "a long reply"}]}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 3:
                        r = http.delete(f"/v1/sessions/{sid}")
                        assert r.status_code == 200 and r.json()["deleted"] is True
        last = chunks[-1]["localheap"]
        assert last["interrupted"] == "deleted" and "saved" not in last and "kept" not in last, last
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) < 19000
        assert http.get(f"/v1/sessions/{sid}").status_code == 404
        assert not list((tmp_path / "sessions").glob(f"{sid}*"))


def test_errors_name_the_field_as_the_request_wrote_it(backend, tmp_path):
    """param is the request's own path (no union member names), the reply limit goes by the route's
    name for it, and values OpenAI does not define are refused instead of ignored."""
    app = create_app(backend, settings(tmp_path))
    user = {"role": "user", "content": "hi"}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        for path, body, param in (
            ("/v1/responses", {"model": MODEL, "input": [{"role": "bogus", "content": "x"}]}, "input.0.role"),
            ("/v1/responses", {"model": MODEL, "input": [{"type": "message", "role": "bogus", "content": "x"}]},
             "input.0.role"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                                  "txt": "x"}]}]},
             "messages.0.content.0.text"),
            ("/v1/responses", {"model": MODEL, "input": "x", "include": ["bogus"]}, "include.0"),
            ("/v1/responses", {"model": MODEL, "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [user], "reasoning_effort": "extreme"},
             "reasoning_effort"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "refusal", "refusal": "no"}]}]}, "messages.0"),
            ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
            ("/completion", {"prompt": "x", "n_predict": 10**6}, "n_predict"),
            ("/completions", {"prompt": "x", "n_predict": 10**6}, "n_predict"),   # (llama-server's other name)
            ("/v1/chat/completions", {"model": MODEL, "messages": [user], "max_tokens": 10**6}, "max_tokens"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [user], "max_completion_tokens": 10**6},
             "max_completion_tokens"),   # (the field it was given in, not max_tokens)
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        ):
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (path, err)
            assert "MessageItem" not in err["message"] and "not supported" not in err["message"], err
        r = http.post("/api/generate", json={"model": MODEL, "prompt": "x", "stream": False,
                                             "options": {"num_predict": 10**6}})
        assert r.status_code == 400 and r.json()["error"].startswith("num_predict 1000000 is over"), r.text
        for effort in ("none", "minimal", "xhigh"):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [user], "max_tokens": 2,
                                                        "reasoning_effort": effort})
            assert r.status_code == 200, r.text
        r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2,
                                             "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]})
        assert r.status_code == 200, r.text
        # an SDK sends a past refusal back as an assistant's part: read as its text
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            user, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}, user]})
        assert r.status_code == 200, r.text


def test_llamacpp_and_ollama_options_take_null_as_their_default_and_refuse_what_is_not_a_number(backend, tmp_path):
    """llama-server's json_value reads a null as the default, and Ollama's options are JSON numbers:
    /completion's nulls were a 400 ("Input should be a valid integer"), Ollama's a 400 with a raw
    Python message; a stop option that was not text was a 500 (a traceback in the stop matcher),
    NaN and Infinity reached the sampler (a traceback in the engine, or a reply that could not be
    written as JSON), and a seed past 64 bits wrapped silently."""
    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        def completion(**kw):
            return http.post("/completion", json={"prompt": "hello there", "n_predict": 6, "seed": 5,
                                                  "temperature": 1.0, **kw})

        want = completion().json()["content"]
        nulls = {k: None for k in ("top_k", "top_p", "min_p", "stream", "n_probs", "cache_prompt", "id_slot",
                                   "return_tokens", "n_indent", "repeat_penalty", "samplers")}
        r = completion(**nulls)
        assert r.status_code == 200 and r.json()["content"] == want, r.text

        def generate(stream=False, **options):
            return http.post("/api/generate", json={"model": MODEL, "prompt": "hello there", "stream": stream,
                                                    "options": {"num_predict": 6, "seed": 5, **options}})

        want = generate().json()["response"]
        r = generate(temperature=None, top_p=None, top_k=None, min_p=None, repeat_penalty=None, stop=None)
        assert r.status_code == 200 and r.json()["response"] == want, r.text
        for options, name in (({"stop": [1]}, "stop"), ({"stop": ["ok", 2]}, "stop"), ({"stop": {"a": 1}}, "stop"),
                              ({"temperature": "0.5"}, "temperature"), ({"top_k": True}, "top_k"),
                              ({"seed": 2**64}, "seed")):
            for stream in (False, True):
                r = generate(stream, **options)
                assert r.status_code == 400 and r.json()["localheap"]["param"] == f"options.{name}", (options, r.text)
        # NaN and Infinity: Python's JSON reader takes them (no JSON writer sends them)
        for path, body, param in (("/api/generate", '{"model": "%s", "prompt": "hi", "options": {"temperature": NaN}}'
                                   % MODEL, "options.temperature"),
                                  ("/completion", '{"prompt": "hi", "n_predict": 2, "temperature": Infinity}',
                                   "temperature"),
                                  ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "top_p": NaN, '
                                   '"messages": [{"role": "user", "content": "hi"}]}' % MODEL, "top_p")):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            err = r.json()
            assert (err["localheap"]["param"] if path == "/api/generate" else err["error"]["param"]) == param, r.text
        r = completion(seed=2**64)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        for prompt in ([True, 2], [[1, False]]):   # a boolean is no token id (true was read as the id 1)
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400, r.text


def refused_alike(http, cases, says: str) -> None:
    """Each (path, body, param): a 400 saying `says` whose param (Ollama's routes: in `localheap`) is param."""
    for path, body, param in cases:
        r = http.post(path, json={"model": MODEL, **body})
        err = r.json()
        got = err["localheap"]["param"] if path.startswith("/api/") else err["error"]["param"]
        assert r.status_code == 400 and got == param and says in r.text, (path, r.text)


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_where_it_was_given(backend, tmp_path):
    """The JSON schema's compile error was a ValueError past the route: a 400 with param null on chat,
    Responses, Messages and Ollama alike."""
    bad = {"type": "nonsense"}
    user = [{"role": "user", "content": "hi"}]
    cases = (("/v1/chat/completions", {"messages": user, "response_format": {
                 "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}}, "response_format"),
             ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": bad}}},
              "text.format"),
             ("/v1/messages", {"max_tokens": 4, "messages": user,
                               "output_config": {"format": {"type": "json_schema", "schema": bad}}},
              "output_config.format"),
             ("/api/chat", {"messages": user, "stream": False, "format": bad}, "format"),
             ("/api/generate", {"prompt": "hi", "stream": False, "format": bad}, "format"))
    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        refused_alike(http, cases, "cannot be enforced")


def test_a_tool_whose_parameters_are_not_an_object_is_a_400(backend, tmp_path):
    """A call's arguments are an object: a tool whose parameters are a string's schema was taken, and
    its forced calls (which the grammar wrote) came back flagged as "not valid JSON". OpenAI and
    Anthropic refuse such a tool; so does every route here, naming it."""
    string = {"type": "string", "maxLength": 4}
    user = [{"role": "user", "content": "hi"}]
    cases = (("/v1/chat/completions", {"messages": user, "max_tokens": 4, "tool_choice": "required",
                                       "tools": [{"type": "function", "function": {"name": "f", "parameters": string}}]},
              "tools.0.function.parameters"),
             ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": string}]},
              "tools.0.parameters"),
             ("/v1/messages", {"max_tokens": 4, "messages": user, "tools": [{"name": "f", "input_schema": string}]},
              "tools.0.input_schema"),
             ("/api/chat", {"messages": user, "stream": False,
                            "tools": [{"type": "function", "function": {"name": "f", "parameters": string}}]},
              "tools.0.function.parameters"),
             ("/api/chat", {"messages": user, "stream": False,   # (Ollama's function is any object: a 500)
                            "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
              "tools.0.function.parameters"))
    app = create_app(backend, settings(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        refused_alike(http, cases, "must be a JSON Schema")
        ok = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": user, "max_tokens": 2,
                                                       "tools": [ok]}).status_code == 200
