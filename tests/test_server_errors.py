"""Every error the server can answer, in OpenAI's shape: 400, 401, 404, 413, 503."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("mlx.core")
openai = pytest.importorskip("openai")

from test_server_openai import HEAP, MODEL, load_mlx_backend  # noqa: E402

from localheap.engine import AdmitAll  # noqa: E402
from localheap.governor import Admission  # noqa: E402
from localheap.server import ServerSettings, create_app  # noqa: E402
from localheap.server.testing import ServerThread  # noqa: E402

KEY = "sekret"
MAX_BODY = 4096


class SwitchableGovernor(AdmitAll):
    refuse = False

    def admit(self, resident, idle_lru):
        if self.refuse:
            return Admission("reject", reason="RAM budget exceeded: every resident heap is busy", retry_after_s=2)
        return Admission("admit")


GOVERNOR = SwitchableGovernor()


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(heap=HEAP, web_dir=None, api_key=KEY, max_body_bytes=MAX_BODY,
                              max_active=1, max_queued=0, admission_timeout=0.5)
    with ServerThread(create_app(load_mlx_backend(), settings, governor=GOVERNOR)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    kw.setdefault("max_tokens", 4)
    return client.chat.completions.create(model=kw.pop("model", MODEL), **kw)


def assert_error(response: httpx.Response, status: int, param=None, code=None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("fields,param", [
    ({"n": 9}, "n"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "x": 1}}]}, "tools.0.function.x"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),          # a digit to str.isdigit, not an id (a 500's message)
    ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),   # Arabic-Indic "12": was read as token 12
    ({"max_tokens": True}, "max_tokens"),   # (read as 1) and the rest: the type OpenAI takes, or a 400
    ({"n": True}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"temperature": "0.5"}, "temperature"),
    ({"logprobs": "true"}, "logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"temperature": 5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"frobnicate": True}, "frobnicate"),
])
def test_400_for_bad_or_unsupported_fields(http, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("choice,said", [
    ({"type": "function"}, "a function tool carries its `function` object"),
    ({"type": "function", "function": {}}, "function.name: Field required"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "allowed_tools.tools"),
    ({"type": "web_search"}, "type is 'function', 'custom' or 'allowed_tools'"),
])
def test_a_malformed_tool_choice_object_says_what_is_wrong_with_it(http, choice, said):
    """(each was "Input should be 'none', 'auto' or 'required'": the union's first branch's error)"""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tool_choice": choice,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, param="tool_choice")
    assert said in err["message"] and "'none', 'auto' or 'required'" not in err["message"], err


@pytest.mark.parametrize("part,what", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "an image"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio"),
])
def test_400_for_an_image_or_audio_part_says_text_only(http, part, what):
    content = [{"type": "text", "text": "What is this?"}, part]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, param="messages.0.content.1")
    assert "reads text only" in err["message"] and what in err["message"], err
    odd = {**body, "messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]}
    err = assert_error(http.post("/v1/chat/completions", json=odd), 400, param="messages.0.content.0")
    assert "'video'" in err["message"] and "valid string" not in err["message"], err


def test_400_through_the_sdk_and_for_bad_json(client, http):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, n=9)
    assert e.value.status_code == 400 and "less than or equal to 8" in e.value.message
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(r, 400)
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y"}), 400, "suffix")


def test_401_without_or_with_a_wrong_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        chat(bad)
    assert_error(httpx.get(server.url + "/v1/models"), 401, code="invalid_api_key")
    assert_error(httpx.get(server.url + "/metrics"), 401)
    assert httpx.get(server.url + "/health").status_code == 200   # health stays open


def test_every_api_route_but_health_needs_the_key(server):
    """Each route the app has (OpenAI's, Anthropic's, Ollama's, llama-server's, the sessions'),
    called without a key: 401 before anything runs."""
    paths = {p: ops for p, ops in server.app.openapi()["paths"].items() if p != "/health"}
    assert {"/completion", "/infill", "/tokenize", "/props", "/slots", "/v1/messages", "/api/chat"} <= set(paths)
    for route, ops in paths.items():
        path = route.replace("{session_id}", "sess_x").replace("{model}", "m").replace(
            "{response_id}", "resp_x").replace("{id_slot}", "0")
        for method in ops:
            r = httpx.request(method.upper(), server.url + path, json={}, timeout=10)
            assert r.status_code == 401, (method, path, r.status_code)


def test_404_unknown_model_session_and_route(client, http):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="gpt-4o")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, extra_headers={"X-Session-Id": "sess_nope"})
    assert e.value.code == "session_not_found"
    assert_error(http.get("/v1/sessions/sess_nope"), 404, code="session_not_found")
    assert_error(http.post("/v1/sessions/sess_nope/documents", json={"text": "x"}), 404)
    assert_error(http.get("/v1/nothing-here"), 404)


def test_413_body_too_large(client, http):
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, messages=[{"role": "user", "content": "x" * (2 * MAX_BODY)}])
    assert e.value.status_code == 413
    chunks = (b'{"model": "m", "messages": [' + b" " * 1000 for _ in range(8))   # no Content-Length
    assert_error(http.post("/v1/chat/completions", content=chunks), 413, code="request_too_large")


def test_503_when_the_queue_is_full(client, http):
    stream = chat(client, max_tokens=5000, temperature=0, stream=True)   # max_active=1, max_queued=0
    try:
        next(iter(stream))
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert_error(r, 503, code="overloaded")
        assert int(r.headers["retry-after"]) >= 1
    finally:
        stream.close()


def test_slots_show_the_run_on_each_and_a_balancers_probe_gets_503_while_none_is_free(client, http):
    """llama-server's GET /slots: max_active entries; the running stream's slot is processing with
    its counts, settings and (to its owner) its session; fail_on_no_slot is a 503 while it runs;
    once it is gone the slot is free and shows the run it held. Slot actions are a 501."""
    for _ in range(100):   # (a stream an earlier test cancelled may still be leaving its slot)
        if not http.get("/slots").json()[0]["is_processing"]:
            break
        time.sleep(0.05)
    stream = chat(client, max_tokens=5000, temperature=0.5, top_p=0.9, stream=True)
    try:
        it = iter(stream)
        for _ in range(3):
            next(it)
        view = http.get("/slots").json()
        assert len(view) == 1 and view[0]["id"] == 0 and view[0]["is_processing"] is True
        s = view[0]
        assert s["next_token"]["has_next_token"] is True and s["next_token"]["n_decoded"] >= 1
        assert s["next_token"]["n_remain"] == 5000 - s["next_token"]["n_decoded"]
        assert s["params"]["temperature"] == 0.5 and s["params"]["top_p"] == 0.9 and s["params"]["n_predict"] == 5000
        assert s["n_prompt_tokens"] > 0 and s["localheap"]["session_id"] and s["n_ctx"] > 0
        assert_error(http.get("/slots", params={"fail_on_no_slot": 1}), 503, code="no_slot_available")
        session_id, task = s["localheap"]["session_id"], s["id_task"]
    finally:
        stream.close()
    for _ in range(200):
        after = http.get("/slots", params={"fail_on_no_slot": 1})
        if after.status_code == 200:
            break
        time.sleep(0.05)
    s = after.json()[0]
    assert s["is_processing"] is False and s["id_task"] == task and s["localheap"]["session_id"] == session_id
    assert s["next_token"]["has_next_token"] is False and s["next_token"]["n_decoded"] >= 3
    assert_error(http.post("/slots/0", params={"action": "save"}, json={"filename": "a.bin"}), 501)
    assert http.get("/props").json()["endpoint_slots"] is True


def metric(http, name: str) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_503_when_over_the_ram_budget(http):
    failed, rejected = metric(http, "localheap_requests_failed_total"), metric(http, "localheap_requests_rejected_total")
    GOVERNOR.refuse = True
    try:
        for _ in range(50):   # the cancelled stream above may still be finishing
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "y"}]})
            if r.json()["error"]["code"] != "overloaded":
                break
            time.sleep(0.05)
        assert_error(r, 503, code="ram_budget_exceeded")
        assert "retry-after" in r.headers
        # a refusal is not a failure (issue 12: budget 503s were counted as failed)
        assert metric(http, "localheap_requests_rejected_total") > rejected
        assert metric(http, "localheap_requests_failed_total") == failed
    finally:
        GOVERNOR.refuse = False
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "y"}],
                                                   "max_tokens": 2}).status_code == 200


def test_a_request_nested_too_deeply_or_an_id_past_int32_is_a_400_not_a_500(http, caplog):
    """A body nested past what the JSON reader takes (with a surrogate escape, which is read before the
    route), a tool schema nested past the grammar's walk, and llama-server's prompt ids past an int32:
    each a 400 saying what, nothing logged as an exception (they were 500s with two tracebacks)."""
    import logging
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)   # Python's own (torch's inductor raises it to 2,000 for the process once it compiles)
    try:
        _nested_and_past_int32(http, caplog)
    finally:
        sys.setrecursionlimit(limit)


def _nested_and_past_int32(http, caplog):
    import logging

    deep = "[" * 1500 + '"\\ud800"' + "]" * 1500   # (this server's bodies are 4 KiB at most)
    with caplog.at_level(logging.ERROR):
        r = http.post("/v1/chat/completions", content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "nested_too_deeply", r.text
        schema = {"type": "string"}
        for _ in range(300):
            schema = {"anyOf": [schema]}
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": tools, "tool_choice": "required", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "nested_too_deeply", r.text
        for path, prompt in (("/completion", [2**40]), ("/completions", ["hi", 2**31])):
            r = http.post(path, json={"prompt": prompt, "n_predict": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_token_id", r.text
    assert not [rec for rec in caplog.records if rec.exc_info], [rec.getMessage() for rec in caplog.records]
