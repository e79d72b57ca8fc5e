"""OpenAI's Responses API (POST /v1/responses) through the real server (uvicorn in a thread, a tiny
torch model carrying a Qwen-style template) driven by the official OpenAI SDK, unmodified: text,
reasoning and function calls as output items, whole and streamed with the typed events; a
conversation sent back as input items renders the prompt the chat route renders (and finds its
session); structured output and forced calls held by the grammar; what it cannot do refused.

A random model will not choose to call a tool, so some tests force the sampled tokens (the
server's test-only `force_tokens` hook), while the template, the parser, the stream and the
session run for real."""

from __future__ import annotations

import json
import re
import time
from typing import Optional

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from localheap.server.background import RUN_EVENTS  # noqa: E402
from localheap.server.prompts import ChatOptions, chat_prompt  # noqa: E402
from localheap.server.responses import ResponsesRequest  # noqa: E402
from localheap.server.schemas import ChatMessage  # noqa: E402
from localheap.server.toolformats import tool_format  # noqa: E402
from tool_server import CALL, CITY, NEST_LARK, nested, qwen_model, serve  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory, torch_one_thread):
    with serve(qwen_model(model_dirs, tmp_path_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model(server) -> str:
    return server.services.model_id


def events_of(client, **kw) -> list:
    with client.responses.create(stream=True, **kw) as stream:
        return list(stream)


def test_text_whole_and_streamed(server, client, force):
    kw = dict(model=model(server), input="The pass key", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    chat = client.chat.completions.create(model=model(server), messages=[{"role": "user", "content": "The pass key"}],
                                          max_tokens=12, temperature=0)
    assert whole.output_text == chat.choices[0].message.content, "the chat route's prompt and reply"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens == chat.usage.prompt_tokens
    (item,) = whole.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    events = events_of(client, **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[0].response.id == events[-1].response.id
    force("Hello there.")   # then the end of the turn
    done = client.responses.create(model=model(server), input="The pass key", max_output_tokens=40)
    assert done.status == "completed" and done.incomplete_details is None and done.output_text == "Hello there."
    assert done.output[0].status == "completed"


def test_logprobs_of_the_output_text(server, client, force):
    """include message.output_text.logprobs (and top_logprobs): the message's part lists an entry
    per token of its text, the chat route's entries for the same conversation; streamed, each
    output_text delta carries its own and the done event all of them. Reasoning's tokens are not
    listed: a reply that thinks first lists the message's."""
    kw = dict(model=model(server), input="The pass key", max_output_tokens=12, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**kw)
    part = whole.output[0].content[0]
    assert len(part.logprobs) == 12 and "".join(e.token for e in part.logprobs) == part.text
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in part.logprobs)
    chat = client.chat.completions.create(model=model(server), messages=[{"role": "user", "content": "The pass key"}],
                                          max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in part.logprobs] == [e.token for e in entries]
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    events = events_of(client, **kw)
    streamed = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    for e in events:
        if e.type == "response.output_text.delta":
            assert "".join(x.token for x in e.logprobs) == e.delta
    assert [x.token for x in streamed] == [x.token for x in part.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [x.logprob for x in done.logprobs] == pytest.approx([x.logprob for x in part.logprobs], abs=1e-5)
    plain = client.responses.create(**{**kw, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == []
    assert client.responses.create(**{**kw, "include": None}).output[0].content[0].logprobs   # top_logprobs alone
    force("<think>\nplan\n</think>\n\nHello there.")
    thought = client.responses.create(**{**kw, "max_output_tokens": 60})
    assert [i.type for i in thought.output] == ["reasoning", "message"]
    listed = "".join(e.token for e in thought.output[1].content[0].logprobs)
    assert listed.endswith("Hello there.") and "plan" not in listed


def test_a_function_call_and_its_output_sent_back(server, client, force):
    force(CALL)
    first = client.responses.create(model=model(server), input="What is the weather in Paris?", tools=TOOLS,
                                    instructions="You are a weather agent.", max_output_tokens=80)
    (call,) = first.output
    assert first.usage.output_tokens_details.reasoning_tokens == 0
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and first.status == "completed"
    assert first.output_text == ""
    force("It is sunny in Paris.")
    history = [{"role": "user", "content": "What is the weather in Paris?"}] + \
        [item.model_dump(mode="json", by_alias=True) for item in first.output] + \
        [{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}]
    second = client.responses.create(model=model(server), input=history, tools=TOOLS,
                                     instructions="You are a weather agent.", max_output_tokens=40)
    assert second.output_text == "It is sunny in Paris."
    assert second.localheap["session_id"] == first.localheap["session_id"], "the session found again"
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_the_input_items_render_as_the_chat_messages(server):
    """Items (a reasoning item, the message and two calls of one reply, their outputs) become the chat
    messages an OpenAI chat client would send: the same prompt, token for token."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Lyon?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "two"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
             {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
             {"role": "developer", "content": "Be brief."}]
    req = ResponsesRequest(model="m", input=items, instructions="You are a weather agent.", tools=TOOLS)
    calls = [{"id": f"call_{c}", "type": "function",
              "function": {"name": "get_weather", "arguments": f'{{"city": "{n}"}}'}}
             for c, n in (("a", "Paris"), ("b", "Lyon"))]
    want = [ChatMessage(role="system", content="You are a weather agent."),
            ChatMessage(role="user", content="Weather in Paris and Lyon?"),
            ChatMessage(role="assistant", content="Checking.", tool_calls=calls, reasoning_content="two"),
            ChatMessage(role="tool", tool_call_id="call_a", content="sunny"),
            ChatMessage(role="tool", tool_call_id="call_b", content="rain"),
            ChatMessage(role="developer", content="Be brief.")]
    assert req.chat_messages() == want
    tok = server.services.tokenizer
    plan = req.plan()
    opts = ChatOptions(plan.tools, tool_format(tok, None), {})
    assert chat_prompt(tok, req.chat_messages(), opts=opts).tokens == chat_prompt(tok, want, opts=opts).tokens


CODEX_TOOLS = [TOOLS[0],
               {"type": "namespace", "name": "agents", "description": "Sub-agents.",
                "tools": [{"type": "function", "name": "close", "strict": False,
                           "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}]},
               {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
               {"type": "web_search", "external_web_access": False}]
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
CODEX_CALLS = ('<tool_call>\n{"name": "agents.close", "arguments": {"id": "7"}}\n</tool_call>\n<tool_call>\n'
               + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}) + "\n</tool_call>")


EDIT_LARK = """
// an edit: a file, then one to three lines added or removed
start: "edit " FILE LF line~1..3
FILE: /[a-z]{1,8}/ ".txt"
line: ("+" | "-") /[a-z]{1,8}/ LF   -> changed
%import common.LF
"""
EDIT = re.compile(r"edit [a-z]{1,8}\.txt\n(?:[+-][a-z]{1,8}\n){1,3}")
PHONE = re.compile(r"[0-9]{3}-[0-9]{4}")
FORMAT_TOOLS = [{"type": "custom", "name": "edit", "format": {"type": "grammar", "syntax": "lark", "definition": EDIT_LARK}},
                {"type": "custom", "name": "dial", "format": {"type": "grammar", "syntax": "regex",
                                                              "definition": PHONE.pattern}},
                {"type": "custom", "name": "nest", "format": {"type": "grammar", "syntax": "lark",
                                                              "definition": NEST_LARK}},
                {"type": "custom", "name": "odd", "format": {"type": "grammar", "syntax": "lark",
                                                             "definition": 'start: "(" start ")" | /(?=x)x/'}}]


def test_a_custom_tools_grammar_holds_its_input(server, lead, caplog):
    """Responses custom tools with a `format` grammar: once the (random) model calls one, its input is
    held to the grammar: a Lark grammar without recursion (spelled out as one expression), a regex,
    or a Lark grammar with recursion (its rules, rewritten for the JSON string the input is written
    in: quotes and newlines escaped). One this server cannot rewrite (a lookahead) is not
    enforced: logged, the request still served. Without the grammar (serve --no-tool-grammar) the same
    calls' inputs do not match (the test can fail)."""
    import httpx

    def inputs(name: str, n: int = 3, most: int = 120) -> list:
        lead('<tool_call>\n{"name": "%s", "arguments": {"input": "' % name)
        out = []
        for _ in range(n):
            r = httpx.post(server.url + "/v1/responses", timeout=60, json={
                "model": model(server), "input": "Go.", "tools": FORMAT_TOOLS, "max_output_tokens": most,
                "temperature": 1.0})
            assert r.status_code == 200, r.text
            calls = [o for o in r.json()["output"] if o["type"] == "custom_tool_call"]
            out.append(calls[0]["input"] if calls and calls[0]["name"] == name else None)
        return out

    with caplog.at_level("WARNING", logger="localheap.server"):
        edits, dials, nests = inputs("edit"), inputs("dial"), inputs("nest", 4, 400)
    assert all(e is not None and EDIT.fullmatch(e) for e in edits), edits
    assert all(d is not None and PHONE.fullmatch(d) for d in dials), dials
    assert all(n is not None and nested(n) for n in nests), nests
    assert all('"' in n and "\n" in n for n in nests), nests   # (escaped in the call's JSON, read back)
    assert "odd" in caplog.text and "nest" not in caplog.text
    server.services.settings.tool_grammar = False
    loose = inputs("edit") + inputs("dial") + inputs("nest")
    assert not any(x is not None and (EDIT.fullmatch(x) or PHONE.fullmatch(x) or nested(x)) for x in loose), loose


def test_a_custom_tool_named_or_allowed_by_tool_choice_is_called_with_its_format(server):
    """Responses tool_choice {"type": "custom", "name"} forces a call of that custom tool, its input held
    to its format; allowed_tools (mode required) forces a call of one of the allowed; an allowed tool
    that is not in tools is a 400."""
    import httpx

    def call(choice) -> dict:
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": model(server), "input": "Go.", "tools": FORMAT_TOOLS, "max_output_tokens": 120,
            "temperature": 1.0, "tool_choice": choice, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        (item,) = [o for o in r.json()["output"] if o["type"] == "custom_tool_call"]
        assert r.json()["tool_choice"] == choice
        return item

    for _ in range(2):
        item = call({"type": "custom", "name": "dial"})
        assert item["name"] == "dial" and PHONE.fullmatch(item["input"]), item
        item = call({"type": "allowed_tools", "mode": "required", "tools": [{"type": "custom", "name": "edit"},
                                                                            {"type": "web_search"}]})
        assert item["name"] == "edit" and EDIT.fullmatch(item["input"]), item
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": model(server), "input": "Go.", "tools": FORMAT_TOOLS, "tool_choice": {
            "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "elsewhere"}]}})
    assert r.status_code == 400 and "elsewhere" in r.text


def test_codex_tools_namespaces_custom_and_hosted(server, force):
    """What Codex sends: a namespace's tools are offered as `<namespace>.<name>` and their calls come
    back named apart (name, namespace); a custom tool is offered as a function of one string `input`
    and its call comes back as a custom_tool_call with that input; a hosted tool (web_search) is left
    out of the prompt; client_metadata is accepted. Sent back as Codex sends them, the calls render
    the prompt again (the session's prefix is reused)."""
    import httpx

    force(CODEX_CALLS)
    body = {"model": model(server), "input": "Tidy up.", "tools": CODEX_TOOLS, "max_output_tokens": 400,
            "client_metadata": {"thread_id": "t1"}, "store": False}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    first = r.json()
    close, patch = first["output"]
    assert close["type"] == "function_call" and (close["name"], close["namespace"]) == ("close", "agents")
    assert json.loads(close["arguments"]) == {"id": "7"}
    assert patch["type"] == "custom_tool_call" and patch["name"] == "apply_patch" and patch["input"] == PATCH
    assert "namespace" not in patch and first["status"] == "completed"
    assert first["localheap"]["ignored_tools"] == ["web_search"]
    flat = [TOOLS[0],
            {"type": "function", "function": {"name": "agents.close", "description": "Sub-agents.",
                                              "parameters": CODEX_TOOLS[1]["tools"][0]["parameters"]}},
            {"type": "function", "function": {"name": "apply_patch", "description": "Edit files with a patch.",
                                              "parameters": {"type": "object",
                                                             "properties": {"input": {"type": "string"}},
                                                             "required": ["input"], "additionalProperties": False}}}]
    flat[0] = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": CITY}}
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model(server), "messages": [{"role": "user", "content": "Tidy up."}], "tools": flat,
        "max_tokens": 1}).json()
    assert first["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"], "the tools as the model reads them"
    force("Done.")
    sent_back = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tidy up."}]},
                 {"type": "function_call", "name": "close", "namespace": "agents", "arguments": close["arguments"],
                  "call_id": close["call_id"]},
                 {"type": "custom_tool_call", "call_id": patch["call_id"], "name": "apply_patch", "input": PATCH},
                 {"type": "function_call_output", "call_id": close["call_id"], "output": "closed"},
                 {"type": "custom_tool_call_output", "call_id": patch["call_id"], "output": "patched"}]
    r = httpx.post(server.url + "/v1/responses", json={**body, "input": sent_back}, timeout=60)
    second = r.json()
    assert r.status_code == 200 and second["output"][0]["content"][0]["text"] == "Done."
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]
    calls = [{"id": close["call_id"], "type": "function",
              "function": {"name": "agents.close", "arguments": close["arguments"]}},
             {"id": patch["call_id"], "type": "function",
              "function": {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})}}]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model(server), "tools": flat, "max_tokens": 1, "messages": [
            {"role": "user", "content": "Tidy up."}, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": close["call_id"], "content": "closed"},
            {"role": "tool", "tool_call_id": patch["call_id"], "content": "patched"}]}).json()
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"], "the calls as chat clients send them"
    force(CODEX_CALLS)
    events = [json.loads(line[5:]) for line in httpx.post(server.url + "/v1/responses", timeout=60, json={
        **body, "stream": True}).text.splitlines() if line.startswith("data:")]
    types = [e["type"] for e in events]
    assert types.count("response.custom_tool_call_input.done") == 1
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == PATCH and len(deltas) > 3, "the input in parts as it is written"
    assert "response.function_call_arguments.done" in types
    (added,) = [e["item"] for e in events if e["type"] == "response.output_item.added"
                and e["item"]["type"] == "custom_tool_call"]
    assert added["input"] == "" and added["name"] == "apply_patch"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["function_call", "custom_tool_call"] and done[1]["input"] == PATCH
    assert done[0]["namespace"] == "agents"
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["tools"][3]["type"] == "web_search"   # echoed as asked


def test_a_custom_call_cut_short_keeps_the_input_read_so_far(server, force):
    """max_output_tokens cuts a custom call inside its input: the item is incomplete, its input
    what was decoded of the string so far; its deltas join to the input its done event gives. A
    function call cut so is an incomplete item too."""
    import httpx

    force("<tool_call>\n" + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH * 4}}))
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": model(server), "input": "Edit.", "tools": CODEX_TOOLS[2:3], "max_output_tokens": 40,
            "stream": stream})
        if not stream:
            body = r.json()
            (call,) = body["output"]
            continue
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
        (done,) = [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"]
        assert "".join(deltas) == done == call["input"] and events[-1]["type"] == "response.incomplete"
    assert body["status"] == "incomplete" and call["status"] == "incomplete"
    assert 0 < len(call["input"]) < len(PATCH * 4) and (PATCH * 4).startswith(call["input"])
    force("<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Paris " * 20}}))
    body = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": model(server), "input": "Weather?", "tools": CODEX_TOOLS[:1], "max_output_tokens": 30}).json()
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete" and body["status"] == "incomplete"


def test_custom_tool_arguments_that_do_not_read_come_back_flagged(server, force):
    import httpx

    force('<tool_call>\n{"name": "apply_patch", "arguments": {"patch": "x"}}\n</tool_call>')
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": model(server), "input": "Edit.", "tools": CODEX_TOOLS[2:3], "max_output_tokens": 60}).json()
    (call,) = r["output"]
    assert call["type"] == "custom_tool_call" and json.loads(call["input"]) == {"patch": "x"}
    assert r["localheap"]["tool_call_errors"][0]["call_id"] == call["call_id"]


def test_streamed_function_calls_and_reasoning(server, client, force):
    force("<think>\nplan\n</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
    events = events_of(client, model=model(server), input="Paris and Lyon?", tools=TOOLS, max_output_tokens=120)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["reasoning", "function_call", "function_call"]
    assert [i.name for i in added[1:]] == ["get_weather", "get_weather"]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    for index, city in ((1, "Paris"), (2, "Lyon")):
        deltas = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta" and e.output_index == index)
        assert json.loads(deltas) == {"city": city} == json.loads(final.output[index].arguments)
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index]
        assert done.arguments == final.output[index].arguments
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == final.output[0].content[0].text == "\nplan\n"
    reasoning = server.services.tokenizer.encode("\nplan\n", add_special_tokens=False)
    assert final.usage.output_tokens_details.reasoning_tokens == len(reasoning)   # (its text re-tokenized)
    whole = client.responses.create(model=model(server), input="Paris and Lyon?", tools=TOOLS, max_output_tokens=120)
    assert [(i.type, getattr(i, "arguments", None)) for i in whole.output] == \
        [(i.type, getattr(i, "arguments", None)) for i in final.output]


def test_structured_output_and_forced_calls_hold(server, client):
    """No forced tokens: the random model is held by the grammar to the schema, and to a call."""
    for seed in range(2):
        r = client.responses.create(model=model(server), input="a city", temperature=1.0, max_output_tokens=60,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                                     "strict": True}})
        jsonschema.validate(json.loads(r.output_text), CITY)
    r = client.responses.create(model=model(server), input="any city", tools=TOOLS, temperature=1.0,
                                max_output_tokens=60, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_previous_response_id_continues_a_kept_response(server, client, force):
    """Three turns by previous_response_id (a call, its output, a question): each renders the prompt
    the whole conversation sent as input renders, and finds the session; GET returns a kept
    response, DELETE forgets it (its continuation is then a 404), store: false keeps none."""
    force(CALL)
    first = client.responses.create(model=model(server), input="Weather in Paris?", tools=TOOLS, max_output_tokens=60)
    (call,) = first.output
    force("Sunny.")
    second = client.responses.create(model=model(server), previous_response_id=first.id, tools=TOOLS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sun"}])
    assert second.previous_response_id == first.id and second.output_text == "Sunny."
    assert second.localheap["session_id"] == first.localheap["session_id"]
    force("Nice too.")
    third = client.responses.create(model=model(server), previous_response_id=second.id, tools=TOOLS,
                                    input="And Nice?", max_output_tokens=20)
    assert third.localheap["session_id"] == first.localheap["session_id"]
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
    # the same conversation sent whole: the same prompt (its length), the same session
    whole = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(mode="json", by_alias=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sun"},
             {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Nice?"}]
    again = client.responses.create(model=model(server), input=whole, tools=TOOLS, max_output_tokens=20)
    assert again.usage.input_tokens == third.usage.input_tokens
    assert again.localheap["session_id"] == first.localheap["session_id"]
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == "Sunny."
    assert client.responses.delete(second.id) is None
    for gone in (lambda: client.responses.retrieve(second.id),
                 lambda: client.responses.create(model=model(server), previous_response_id=third.id, input="x")):
        with pytest.raises(openai.NotFoundError):   # the chain through the deleted one is broken
            gone()
    unkept = client.responses.create(model=model(server), input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_the_log_drops_its_oldest_and_says_so():
    from localheap.server.responses import ResponseLog, ResponseNotFound

    log = ResponseLog(max_kept=3)
    ids = []
    for i in range(5):
        req = ResponsesRequest(model="m", input=f"turn {i}", previous_response_id=ids[-1] if ids else None)
        body = {"id": f"resp_{i}", "output": [{"type": "message", "id": f"msg_{i}", "role": "assistant",
                                               "status": "completed",
                                               "content": [{"type": "output_text", "text": f"reply {i}"}]}]}
        log.add(body, req, owner=None)
        ids.append(body["id"])
    kept = log.get("resp_3", None).items + log.get("resp_4", None).items
    assert [m.content for m in ResponsesRequest(model="m", input="x").chat_messages(kept)] == \
        ["turn 3", "reply 3", "turn 4", "reply 4", "x"]
    assert [m.role for m in ResponsesRequest(model="m", input="x").chat_messages(kept)] == \
        ["user", "assistant", "user", "assistant", "user"]
    with pytest.raises(ResponseNotFound):   # resp_0 and resp_1 were dropped: the chain says so
        log.conversation("resp_4", None)
    with pytest.raises(ResponseNotFound):   # another key's response is not this one's
        log.get("resp_4", owner="someone")
    assert len(log._kept) == 3 and log.chars == sum(k.chars for k in log._kept.values())


def _kept_turns(log, n: int, first: int = 0) -> list[str]:
    ids = []
    for i in range(first, first + n):
        input_ = [{"role": "user", "content": f"turn {i}"},
                  {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}", "async": False}]
        req = ResponsesRequest(model="m", input=input_, previous_response_id=f"resp_{i - 1}" if i else None)
        body = {"id": f"resp_{i}", "output": [{"type": "message", "id": f"msg_{i}", "role": "assistant",
                                               "status": "completed",
                                               "content": [{"type": "output_text", "text": f"reply {i}"}]}]}
        log.add(body, req, owner="key-1")
        ids.append(body["id"])
    return ids


def test_the_log_outlives_a_restart_and_a_torn_line(tmp_path):
    """With a file (the sessions directory's): responses added and deleted are there after a
    restart, items and chains alike; a line a crash cut short loses that response alone; the file
    is private and rewritten when it holds mostly what is no longer kept."""
    from localheap.server.responses import ResponseLog, ResponseNotFound

    path = tmp_path / "responses.jsonl"
    log = ResponseLog(max_kept=50, path=path)
    ids = _kept_turns(log, 6)
    log.delete("resp_2", "key-1")
    log.flush()
    assert path.stat().st_mode & 0o777 == 0o600
    before = ResponsesRequest(model="m", input="x").chat_messages(log.get("resp_4", "key-1").items +
                                                                  log.get("resp_5", "key-1").items)
    log.close()
    again = ResponseLog(max_kept=50, path=path)
    assert list(again._kept) == [i for i in ids if i != "resp_2"] and again.chars == log.chars
    assert again.get("resp_5", "key-1").body == log.get("resp_5", "key-1").body
    after = ResponsesRequest(model="m", input="x").chat_messages(again.get("resp_4", "key-1").items +
                                                                 again.get("resp_5", "key-1").items)
    assert [m.model_dump() for m in after] == [m.model_dump() for m in before]
    with pytest.raises(ResponseNotFound):
        again.conversation("resp_5", "key-1")   # through the deleted one
    with pytest.raises(ResponseNotFound):
        again.get("resp_4", None)                # another owner's
    _kept_turns(again, 1, first=6)
    again.close()
    data = path.read_bytes()
    path.write_bytes(data[:-20])                # a crash in the middle of the last line
    torn = ResponseLog(max_kept=50, path=path)
    assert list(torn._kept) == [i for i in ids if i != "resp_2"]   # resp_6's line was cut: it alone is lost
    assert path.read_bytes().endswith(b"\n") and ResponseLog(max_kept=50, path=path)._kept.keys() == torn._kept.keys()
    torn.close()
    small = ResponseLog(max_kept=3, path=path)   # most lines are dropped responses now
    _kept_turns(small, 80, first=100)
    small.close()
    lines = path.read_bytes().count(b"\n")
    assert lines <= 2 * 3 + 64
    assert list(ResponseLog(max_kept=3, path=path)._kept) == ["resp_177", "resp_178", "resp_179"]


def test_a_restarted_server_continues_a_kept_response(model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    with serve(model_dir, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        first = client.responses.create(model=model(srv), input="The pass key", max_output_tokens=8, temperature=0)
    with serve(model_dir, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(model=model(srv), previous_response_id=first.id, input="And then?",
                                         max_output_tokens=4, temperature=0)
        assert second.localheap["session_id"] == first.localheap["session_id"]   # its session restored too
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"previous_response_id": "resp_1", "store": False}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),   # (the request's own path)
    ({"tools": [TOOLS[0], {"type": "namespace", "name": "n", "tools": [TOOLS[1]]}, {**TOOLS[1], "name": "n.get_time"}]},
     "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),   # (none is kept: a 404)
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"background": True, "store": False}, "store"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),   # (16 keys at most, as OpenAI's)
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),   # hosted: none run
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
])
def test_what_it_cannot_do_is_a_400(server, fields, param):
    import httpx

    body = {"model": model(server), "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == (404 if param in ("previous_response_id", "input.0", "conversation") else 400), r.text
    assert r.json()["error"]["param"] == param


def test_max_tool_calls_is_accepted_and_returned(server, client, force):
    """It bounds hosted tools' calls (OpenAI's); none is ever made here, so any bound holds. A
    function call is not a hosted tool's: it still comes back."""
    force('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    r = client.responses.create(model=model(server), input="Paris?", tools=TOOLS + [{"type": "web_search"}],
                                max_tool_calls=0, max_output_tokens=60)
    assert r.max_tool_calls == 0 and [i.type for i in r.output] == ["function_call"]


def test_an_unknown_model_is_a_404(server):
    import httpx

    r = httpx.post(server.url + "/v1/responses", json={"model": "gpt-9", "input": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_arguments_that_are_not_json_come_back_flagged(server, client, force):
    force('<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>')
    r = client.responses.create(model=model(server), input="Paris?", tools=TOOLS, max_output_tokens=60)
    (call,) = r.output
    assert call.type == "function_call" and call.arguments == "{city: Paris}"
    (err,) = r.localheap["tool_call_errors"]
    assert err["call_id"] == call.call_id and err["index"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_agents_sdk_runs_a_tool_through_the_responses_route(server, stream):
    """OpenAI's Agents SDK (its Responses model, unmodified): the model reasons and calls a function
    tool, the SDK runs it and sends its output back, and the model answers; whole and streamed."""
    import asyncio

    agents = pytest.importorskip("agents")
    from localheap.grammar import ForcedTokens

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        seen.append(city)
        return f"18C in {city}"

    svc = server.services
    replies = ["<think>\nlook it up\n</think>\n\n" + CALL, "It is 18C in Paris."]
    ids = [svc.tokenizer.encode(t, add_special_tokens=False) for t in replies]
    svc.force_tokens = lambda: ForcedTokens(ids.pop(0), svc.backend.eos_token_ids)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(name="weather", instructions="You are a weather agent.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model=model(server), openai_client=client),
                             model_settings=agents.ModelSettings(max_tokens=200))
        if not stream:
            return await agents.Runner.run(agent, "Weather in Paris?")
        result = agents.Runner.run_streamed(agent, "Weather in Paris?")
        async for _ in result.stream_events():
            pass
        return result

    try:
        result = asyncio.run(run())
    finally:
        svc.force_tokens = None
    assert seen == ["Paris"] and not ids
    assert result.final_output == "It is 18C in Paris."
    assert [type(i).__name__ for i in result.new_items] == \
        ["ReasoningItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]


def test_an_item_reference_is_the_kept_item(server, force):
    """The AI SDK's OpenAI provider sends a stored response's reasoning back as
    {"type": "item_reference", "id": "rs_..."}: it renders as the item itself would; an id no kept
    response holds is a 404 naming the input item."""
    import httpx

    force("<think>\nplan\n</think>\n\n" + CALL)
    url = server.url + "/v1/responses"
    first = httpx.post(url, timeout=60, json={"model": model(server), "input": "Weather in Paris?", "tools": TOOLS,
                                              "max_output_tokens": 200}).json()
    reasoning, call = first["output"]
    force("Sunny.")
    rest = [{"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"],
             "id": call["id"]}, {"type": "function_call_output", "call_id": call["call_id"], "output": "18C"}]
    user = {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    answers = [httpx.post(url, timeout=60, json={"model": model(server), "tools": TOOLS, "max_output_tokens": 40,
                                                 "input": [user, sent] + rest, "store": False}).json()
               for sent in ({"type": "item_reference", "id": reasoning["id"]}, reasoning)]
    assert [a["usage"]["input_tokens"] for a in answers] == [answers[1]["usage"]["input_tokens"]] * 2
    assert answers[0]["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert answers[0]["output"][0]["content"][0]["text"] == "Sunny."
    by_ref = httpx.post(url, timeout=60, json={"model": model(server), "max_output_tokens": 4, "input": [
        user, {"type": "item_reference", "id": call["id"]}]})
    assert by_ref.status_code == 200   # a call referenced: its output is missing, but it renders
    gone = httpx.post(url, timeout=60, json={"model": model(server), "max_output_tokens": 4, "input": [
        user, {"type": "item_reference", "id": "rs_nope"}]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "input.1"
    assert httpx.delete(f"{url}/{first['id']}", timeout=60).status_code == 200
    deleted = httpx.post(url, timeout=60, json={"model": model(server), "max_output_tokens": 4, "input": [
        user, {"type": "item_reference", "id": reasoning["id"]}]})
    assert deleted.status_code == 404, "its response deleted (no other kept one holds it), the item is gone"


def test_an_item_held_by_two_kept_responses_stays_referable_until_both_go(tmp_path):
    """A client that sends an output item back whole keeps it in its next response too: the
    reference resolves while either response is kept (and only for the key that owns one)."""
    from localheap.server.responses import ResponseLog, ResponseNotFound, resolve_references

    log = ResponseLog(max_kept=10, path=tmp_path / "responses.jsonl")
    _kept_turns(log, 1)   # resp_0 holds msg_0 (its output)
    again = ResponsesRequest(model="m", input=[{"type": "message", "id": "msg_0", "role": "assistant",
                                                "content": [{"type": "output_text", "text": "reply 0"}]}])
    log.add({"id": "resp_9", "output": []}, again, owner="key-1")   # resp_9 holds msg_0 too (its input)

    def resolved(owner="key-1"):
        req = ResponsesRequest(model="m", input=[{"type": "item_reference", "id": "msg_0"}])
        item, = resolve_references(req.input, [lambda i: log.find_item(i, owner)], "input")
        return item.model_dump(exclude_none=True)

    assert resolved()["content"][0]["text"] == "reply 0"
    with pytest.raises(ResponseNotFound):
        resolved("key-2")
    log.delete("resp_9", "key-1")
    assert resolved()["id"] == "msg_0", "resp_0 still holds it"
    log.delete("resp_0", "key-1")
    with pytest.raises(ResponseNotFound):
        resolved()
    log.close()


# --- background responses --------------------------------------------------------------------

def _ended(client, response_id: str, timeout: float = 120.0):
    """Poll a background response until it leaves queued and in_progress."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"{response_id} still {r.status}"
        time.sleep(0.05)


class _Stalled:
    """The engine thread held between steps (a call that waits): what is submitted meanwhile
    stays queued, what runs does not step, until `release`."""

    def __init__(self, server):
        import threading

        self.go, self.held = threading.Event(), threading.Event()

        def hold():
            self.held.set()
            self.go.wait(60)

        self.done = server.services.engine.call(hold)
        assert self.held.wait(30)

    def release(self) -> None:
        self.go.set()
        self.done.result(30)


def test_a_background_response_is_answered_at_once_and_polled_to_its_end(server, client, force):
    """background: true answers queued before the engine has taken it (the engine held here), runs
    on, and polls to the reply the same request gives in the foreground; it can be continued by
    previous_response_id once it has ended, not before."""
    force("Hello there.")
    fore = client.responses.create(model=model(server), input="Say hello", max_output_tokens=20)
    stall = _Stalled(server)
    try:
        back = client.responses.create(model=model(server), input="Say hello", max_output_tokens=20, background=True)
        assert back.status == "queued" and back.background is True and back.output == []
        assert client.responses.retrieve(back.id).status == "queued"
        import httpx

        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert re.search(r"^localheap_background_responses 1\.0$", metrics, re.M)
        with pytest.raises(openai.BadRequestError) as e:   # not before it has ended
            client.responses.create(model=model(server), previous_response_id=back.id, input="x")
        assert e.value.body["param"] == "previous_response_id"
    finally:
        stall.release()
    done = _ended(client, back.id)
    assert done.status == "completed" and done.error is None and done.background is True
    assert done.output_text == fore.output_text == "Hello there."
    assert done.usage.output_tokens == fore.usage.output_tokens
    assert done.localheap["session_id"] == fore.localheap["session_id"]   # the same conversation's session
    force("Fine.")
    after = client.responses.create(model=model(server), previous_response_id=back.id, input="And then?")
    assert after.output_text == "Fine." and after.localheap["session_id"] == done.localheap["session_id"]
    assert fore.background is False


def test_a_background_stream_outlives_its_client_and_is_read_again(server, client, force):
    """A streamed background response: created and queued, in_progress once admitted, then the
    reply's events. The client leaving does not stop it, and GET ?stream=true&starting_after=N
    gives the events after N, as they were sent."""
    import httpx

    force("One two three four.")
    kw = dict(model=model(server), input="Count", max_output_tokens=40, temperature=0)
    whole = events_of(client, background=True, **kw)
    types = [e.type for e in whole]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"], types
    assert types[-1] == "response.completed" and [e.sequence_number for e in whole] == list(range(len(whole)))
    assert whole[0].response.status == "queued" and whole[2].response.status == "in_progress"
    rid = whole[0].response.id
    assert whole[-1].response.output_text == "One two three four."
    again = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in whole[4:]]
    # a client that leaves after the first event: the reply runs on to its end
    stall = _Stalled(server)
    try:
        with httpx.stream("POST", server.url + "/v1/responses", json={**kw, "stream": True, "background": True},
                          timeout=60) as r:
            first = next(r.iter_lines())
        assert first == "event: response.created"
        (gone,) = [rid for rid, run in server.services.backgrounds._runs.items() if not run.ended]
    finally:
        stall.release()
    left = _ended(client, gone)
    assert left.status == "completed" and left.output_text == "One two three four."


def _running_in_background(client, **kw) -> str:
    """A background response's id, once its stream has sent text (the stream then left)."""
    stream = client.responses.create(input="Run a while", background=True, stream=True, **kw)
    rid = None
    for event in stream:
        rid = rid or event.response.id
        if event.type == "response.output_text.delta":
            break
    stream.close()
    return rid


def test_a_background_response_whose_session_is_stopped_ends_cancelled(server, client, force):
    """POST /v1/sessions/{id}/stop on the session a background response runs on ends it "cancelled", with the
    text it had (as its own cancel does), not "failed" as a server stopping would, run again at the restart."""
    import httpx

    sid = httpx.post(server.url + "/v1/sessions", json={}, timeout=60).json()["id"]
    force("one two three " * 400)
    rid = _running_in_background(client, model=model(server), max_output_tokens=3000, extra_headers={"X-Session-Id": sid})
    assert httpx.post(f"{server.url}/v1/sessions/{sid}/stop", timeout=60).json()["stopped"] == 1
    stopped = _ended(client, rid)
    assert stopped.status == "cancelled" and stopped.output_text and stopped.localheap["session_id"] == sid
    assert 0 < stopped.usage.output_tokens < 1200
    # in the foreground, its stream read to the end: incomplete, for that reason (not completed)
    last, asked = None, False
    with client.responses.create(model=model(server), input="Run a while", stream=True, max_output_tokens=3000,
                                 extra_headers={"X-Session-Id": sid}) as stream:
        for last in stream:
            if last.type == "response.output_text.delta" and not asked:
                asked = True
                assert httpx.post(f"{server.url}/v1/sessions/{sid}/stop", timeout=60).json()["stopped"] == 1
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "stopped"
    assert last.response.localheap["interrupted"] == "stopped" and last.response.output_text


def test_a_background_response_is_cancelled_queued_or_running(server, client, force):
    """Cancel while queued: it ends cancelled with nothing generated. Cancel while running (the
    engine held after its first tokens): it ends cancelled with the text it had, which its session
    keeps. A second cancel returns it as it is; cancelling one that completed, or one not run in
    the background, is a 400; so is streaming again a response that was not a background one."""
    from concurrent.futures import ThreadPoolExecutor

    kw = dict(model=model(server), max_output_tokens=3000, temperature=0)
    stall = _Stalled(server)
    try:
        queued = client.responses.create(input="Never run", background=True, **kw)
        with client.responses.retrieve(queued.id, stream=True) as events:   # its first events, while queued
            it = iter(events)
            first = [next(it).type, next(it).type]   # (each out once on the disk)
        assert first == ["response.created", "response.queued"]
        assert client.responses.retrieve(queued.id).status == "queued"
        with ThreadPoolExecutor(1) as pool:   # (a cancel waits for the engine to end the run)
            cancelling = pool.submit(client.responses.cancel, queued.id)
            stall.release()
            cancelled = cancelling.result(60)
    finally:
        stall.go.set()
    assert cancelled.status == "cancelled" and cancelled.output == [] and cancelled.usage is None
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"   # again: as it is

    force("one two three " * 400)   # (a random model's own reply may end at once)
    rid = _running_in_background(client, **kw)
    stall = _Stalled(server)
    try:
        running = client.responses.retrieve(rid)
        assert running.status == "in_progress" and running.output_text   # its output so far
        with ThreadPoolExecutor(1) as pool:
            cancelling = pool.submit(client.responses.cancel, rid)
            stall.release()
            cancelled = cancelling.result(60)
    finally:
        stall.go.set()
    assert cancelled.status == "cancelled" and cancelled.output[0].status == "incomplete"
    assert 0 < cancelled.usage.output_tokens < 3000 and cancelled.output_text.startswith(running.output_text)
    session = server.services.store.info(cancelled.localheap["session_id"])
    assert session["tokens"] >= cancelled.usage.input_tokens + cancelled.usage.output_tokens - 1   # kept

    force("Done.")
    finished = _ended(client, client.responses.create(model=model(server), input="Quick", background=True).id)
    foreground = client.responses.create(model=model(server), input="Quick")
    for rid in (finished.id, foreground.id):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.cancel(rid)
        assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as e:
        list(client.responses.retrieve(foreground.id, stream=True))
    assert e.value.body["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_background_errors_come_back_at_once_or_as_a_failed_response(server, client):
    """Refused before it is queued (a 400): store: false, max_output_tokens over the limit, an
    unknown session. One the engine fails is a failed response with the error."""
    import httpx

    base = {"model": model(server), "input": "hi", "background": True}
    for fields, param in [({"store": False}, "store"), ({"max_output_tokens": 10 ** 7}, "max_output_tokens")]:
        r = httpx.post(server.url + "/v1/responses", json={**base, **fields}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/responses", json=base, headers={"X-Session-Id": "sess_" + "0" * 20}, timeout=60)
    assert r.status_code == 404, r.text
    svc = server.services

    class Breaks:   # a constraint that fails the run on the engine after its first token
        def __init__(self):
            self.first = svc.tokenizer.encode("Hello", add_special_tokens=False)[0]
            self.calls = 0

        def allowed(self):
            import numpy as np

            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("the constraint broke")
            mask = np.zeros(self.first + 1, bool)
            mask[self.first] = True
            return mask

        def advance(self, token):
            pass

    svc.force_tokens = Breaks
    try:
        back = client.responses.create(model=model(server), input="Fail", max_output_tokens=20, background=True)
    finally:
        svc.force_tokens = None
    failed = _ended(client, back.id)
    assert failed.status == "failed" and failed.error.code == "internal_error"
    assert "the details are in the server log" in failed.error.message   # (as a foreground request's 500)
    assert failed.background is True and failed.usage is None


def test_a_background_response_the_server_stopped_in_reads_back_to_run_again(tmp_path):
    """A background response kept queued (or running) when the server stopped, with its request,
    reads back to run again, unless it was stopped in RUNS runs in a row that kept no reply token
    (a run that kept one begins the count again; one kept before the count: RUNS runs in all); then,
    or kept without its request, it reads back failed with an error that says so. One that ended
    reads back as it ended."""
    from localheap.server.responses import RUNS, ResponseLog

    path = tmp_path / "responses.jsonl"
    log = ResponseLog(path=path)
    req = ResponsesRequest(model="m", input="hi", background=True)

    def queued(rid: str, status: str = "queued") -> dict:
        return {"id": rid, "status": status, "background": True, "error": None, "output": []}

    again = {"request": req.model_dump(mode="json", exclude_unset=True), "session_id": None}
    log.add(queued("resp_a"), req, None)   # (no request kept with it: as a server before resuming kept them)
    log.add(queued("resp_b", "in_progress"), req, None, {**again, "runs": 1})
    done = {**queued("resp_b"), "status": "completed"}
    log.add(done, req, None, {**again, "runs": 1})   # resp_b ended: added again, nothing to run again
    log.add(queued("resp_c"), req, None, {**again, "runs": 1})
    log.add(queued("resp_d"), req, "key2", {**again, "runs": RUNS})
    log.add(queued("resp_e"), req, None, {**again, "runs": RUNS + 4, "stalled": 0})   # its last run went on
    log.add(queued("resp_f"), req, None, {**again, "runs": RUNS + 4, "stalled": RUNS})
    assert len(log._kept) == 6 and log.chars == sum(k.chars for k in log._kept.values())
    log.close()
    back = ResponseLog(path=path)
    a = back.get("resp_a", None).body
    assert a["status"] == "failed" and a["error"]["code"] == "server_error" and "stopped" in a["error"]["message"]
    assert back.get("resp_b", None).body == done
    d = back.get("resp_d", "key2").body
    assert d["status"] == "failed" and f"in {RUNS} runs in a row that wrote nothing more" in d["error"]["message"]
    assert back.get("resp_f", None).body["error"] == d["error"]
    (rid, kept), (rid_e, _) = back.resumable()
    assert rid == "resp_c" and kept.body["status"] == "queued" and kept.resume["runs"] == 1 and rid_e == "resp_e"
    assert ResponsesRequest.model_validate(kept.resume["request"]).input == "hi" and back.resumable() == []
    back.fail("resp_c", {"code": "x", "message": "gone"})
    assert [m.content for m in ResponsesRequest(model="m", input="x").chat_messages(back.conversation("resp_a", None))] \
        == ["hi", "x"]
    back.close()
    third = ResponseLog(path=path)
    assert third.get("resp_c", None).body["error"]["message"] == "gone"
    assert [rid for rid, _ in third.resumable()] == ["resp_e"]
    third.close()


def test_a_running_response_is_kept_as_it_was_when_kept(tmp_path):
    """A background response kept queued or running is kept as it stood then: its output, which
    goes on growing in the run (and which the writer thread may write out again later), is not
    the kept one."""
    from localheap.server.responses import ResponseLog

    log = ResponseLog(path=tmp_path / "responses.jsonl")
    req = ResponsesRequest(model="m", input="hi", background=True)
    body = {"id": "resp_a", "status": "in_progress", "background": True, "error": None, "output": []}
    log.add(body, req, None, {"request": req.model_dump(mode="json", exclude_unset=True), "session_id": None,
                              "runs": 1, "stalled": 1})
    body["output"].append({"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress",
                           "content": []})
    assert log.get("resp_a", None).body["output"] == [] and log._records()[0]["body"]["output"] == []
    log.close()


def _forced_server(model_dir, text: str, **settings):
    """The tool server with its replies forced to `text` from its first request on (a background
    response run again at start included)."""
    from localheap.grammar import ForcedTokens
    from localheap.models import load_backend
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread
    from tool_server import HEAP

    app = create_app(load_backend(str(model_dir), "torch"), ServerSettings(heap=HEAP, web_dir=None, **settings))
    svc = app.state.services
    ids = svc.tokenizer.encode(text, add_special_tokens=False)
    svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
    return ServerThread(app)


class _Paced:
    """The engine held `gap` s between steps (a call it runs between steps; the next is sent once
    that one has run) until `stop`: a reader of a reply that a fast machine decodes in a fraction
    of a second (a schema's 30 words: 0.23 s once) still catches it midway."""

    def __init__(self, server, gap: float = 0.02):
        import threading

        self.on = threading.Event()
        self.on.set()

        def pace():
            while self.on.is_set():
                try:
                    server.services.engine.call(lambda: time.sleep(gap)).result(5)
                except Exception:   # the engine stopped (or stalled): nothing left to pace
                    return

        self.thread = threading.Thread(target=pace, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """No more pauses (the one under way, on an engine that stopped, gives up after 5 s: not joined)."""
        self.on.clear()


def _stopped_midway(model_dir, forced: Optional[str], settings: dict, seen=12, max_output_tokens: int = 3000,
                    **request):
    """A background response the server stops in midway: its reply forced to `forced` (None: the
    model's own), the server held
    once a reader has `seen` of its events (or once seen(the events so far) holds; returned, with the
    response), then stopped."""
    enough = seen if callable(seen) else lambda got: len(got) == seen
    with (_forced_server(model_dir, forced, **settings) if forced is not None else serve(model_dir, **settings)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        stall = _Stalled(srv)   # queued, the first of a fresh server: its first events reach a reader (once fsynced)
        try:
            back = client.responses.create(model=model(srv), input="Go on", max_output_tokens=max_output_tokens,
                                           background=True, **request)
            with client.responses.retrieve(back.id, stream=True, timeout=30) as queued:
                it = iter(queued)
                assert [next(it).type, next(it).type] == ["response.created", "response.queued"]
        finally:
            stall.release()
        paced = _Paced(srv)
        events = []
        stream = client.responses.retrieve(back.id, stream=True)
        try:
            for event in stream:
                events.append(event)
                if enough(events):
                    break
        finally:
            stream.close()   # (a reader left open would hold the server's stop for its grace period)
        stall = _Stalled(srv)
        try:
            assert client.responses.retrieve(back.id).status == "in_progress"
        finally:
            stall.release()   # it runs on a step or two, paced still; the server stops under it
    paced.stop()
    return back, events


def _resume_kept(sessions_dir, response_id: str) -> dict:
    """`runs` and `stalled` of what runs a background response again, as last kept."""
    lines = (sessions_dir / "responses.jsonl").read_text().splitlines()
    resume = [r for r in map(json.loads, lines) if r.get("add") == response_id][-1]["resume"]
    return {k: resume[k] for k in ("runs", "stalled")}


def _deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_background_response_the_server_stopped_in_goes_on_after_its_restart(model_dirs, tmp_path_factory,
                                                                               tmp_path, torch_one_thread):
    """The server stops while a background response runs, some of its reply sent: at the restart it
    goes on from there under its id. Its events kept are sent again as they were (numbers, item
    ids); its reply goes on from its last token kept (run 2 forces another text: the reply is run
    1's tokens, then run 2's from that place on); usage and logprobs count both runs' tokens. A reader of
    a kept event is sent what follows it, one of an event not kept is told (409) rather than sent
    a splice of two runs; it is then continued by previous_response_id, and a third start leaves it
    as it ended."""
    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    back, seen = _stopped_midway(model_dir, "one two three " * 400, settings, instructions="Be brief.",
                                 include=["message.output_text.logprobs"], top_logprobs=2)
    assert _resume_kept(tmp_path, back.id) == {"runs": 1, "stalled": 0}   # (run 1 kept tokens: not counted)
    lines = (tmp_path / "responses.jsonl").read_text().splitlines()
    asked = [r for r in map(json.loads, lines) if r.get("add") == back.id][-1]["items"][0]["id"]   # its input's id
    with _forced_server(model_dir, "four five six " * 100, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = _ended(client, back.id)
        assert [i.id for i in client.responses.input_items.list(back.id).data] == [asked]   # the same id
        assert got.status == "completed" and got.background is True
        assert got.created_at == back.created_at and got.instructions == "Be brief."
        events = list(client.responses.retrieve(back.id, stream=True))
        kept = [e for e in events if e.sequence_number < RUN_EVENTS]
        assert [e.model_dump() for e in kept[:len(seen)]] == [e.model_dump() for e in seen]   # as they were sent
        assert [e.sequence_number for e in events] == \
            list(range(len(kept))) + list(range(RUN_EVENTS, RUN_EVENTS + len(events) - len(kept)))
        assert events[-1].type == "response.completed" and events[-1].response.output[0].id == seen[-1].item_id
        tok = srv.services.tokenizer
        first = tok.encode("one two three " * 400, add_special_tokens=False)
        second = tok.encode("four five six " * 100, add_special_tokens=False)
        before = _deltas(kept)
        k = next(k for k in range(len(first)) if tok.decode(first[:k]) == before)   # the tokens run 1 kept
        assert len(seen) < k + 4 < len(second)   # (a delta a token, from the in_progress event on)
        assert got.output_text == before + tok.decode(second[k:]) == _deltas(events)
        assert got.usage.output_tokens == len(second) + 1   # (its EOS too, as any reply's)
        assert len(got.output[0].content[0].logprobs) == len(second)   # each token's, kept and new
        later = list(client.responses.retrieve(back.id, stream=True, starting_after=3))   # a kept event
        assert [e.sequence_number for e in later] == [e.sequence_number for e in events[4:]]
        with pytest.raises(openai.ConflictError, match="was an earlier run's and was not kept"):
            client.responses.retrieve(back.id, stream=True, starting_after=len(kept))   # run 1's response.failed
        again = client.responses.create(model=model(srv), previous_response_id=back.id, input="Again?",
                                        max_output_tokens=2, instructions="Be brief.")
        assert again.status in ("completed", "incomplete")
        assert again.localheap["session_id"] == got.localheap["session_id"]
        assert again.usage.input_tokens_details.cached_tokens > 0
    assert not list((tmp_path / "background").glob("*"))   # what it kept is gone with its end
    with serve(model_dir, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(back.id).output_text == got.output_text
        assert srv.services.backgrounds.running == 0


def test_a_background_response_stopped_inside_a_tool_call_goes_on_with_the_same_call(model_dirs, tmp_path_factory,
                                                                                    tmp_path, torch_one_thread):
    """The server stops while a background response writes a tool call's arguments: at the restart
    the call goes on, the same item and call id (the parser's ids come from the response's seeded
    source: read again, they are the ones sent), and its arguments end whole."""
    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    note = "many words " * 80
    text = "Noting it. <tool_call>\n" + json.dumps({"name": "take_note", "arguments": {"text": note}}) + "\n</tool_call>"
    tools = [{"type": "function", "name": "take_note", "description": "Keep a note",
              "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}]
    args = lambda got: sum(e.type == "response.function_call_arguments.delta" for e in got) == 20   # noqa: E731
    back, seen = _stopped_midway(model_dir, text, settings, args, max_output_tokens=20000, tools=tools)
    added = next(e for e in seen if e.type == "response.output_item.added" and e.item.type == "function_call")
    with _forced_server(model_dir, text, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = _ended(client, back.id)
        assert got.status == "completed", got.error
        events = list(client.responses.retrieve(back.id, stream=True))
    assert [e.model_dump() for e in events[:len(seen)]] == [e.model_dump() for e in seen]
    assert any(e.sequence_number >= RUN_EVENTS and e.type == "response.function_call_arguments.delta" for e in events)
    call = got.output[-1]
    assert call.type == "function_call" and (call.id, call.call_id) == (added.item.id, added.item.call_id)
    assert json.loads(call.arguments) == {"text": note} and got.status == "completed"


def test_a_background_response_held_to_a_schema_goes_on_held_to_it(model_dirs, tmp_path_factory, tmp_path,
                                                                   torch_one_thread):
    """The model's own reply held to a JSON schema, stopped midway: at the restart its grammar is
    brought past the kept reply, and the reply it goes on to reads as JSON valid for the schema."""
    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    schema = {"type": "object", "properties": {"words": {"type": "array", "minItems": 30, "maxItems": 30,
                                                         "items": {"type": "string", "maxLength": 6}}},
              "required": ["words"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "words", "schema": schema, "strict": True}}
    back, seen = _stopped_midway(model_dir, None, settings, 30, text=fmt)
    with serve(model_dir, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = _ended(client, back.id)
        events = list(client.responses.retrieve(back.id, stream=True))
    assert [e.model_dump() for e in events[:len(seen)]] == [e.model_dump() for e in seen]
    assert got.status == "completed" and got.output_text.startswith(_deltas(seen)) and events[-1].sequence_number > RUN_EVENTS
    jsonschema.validate(json.loads(got.output_text), schema)


def test_a_background_response_whose_kept_reply_is_torn_or_does_not_read_again(model_dirs, tmp_path_factory,
                                                                               tmp_path, torch_one_thread):
    """What a crash leaves of a background response's kept reply: a last line cut short is dropped
    and the reply goes on from the line before it; a reply that does not read again as it was sent
    (a line changed) runs again from its start, its events numbered as run 2's."""
    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    back, seen = _stopped_midway(model_dir, "one two three " * 400, settings)
    path = tmp_path / "background" / f"{back.id}.jsonl"
    lines = path.read_bytes().split(b"\n")[:-1]
    records = [json.loads(line) for line in lines]
    assert [[e["type"] for e in r["e"]] for r in records[:2]] == \
        [["response.created", "response.queued"], ["response.in_progress"]]
    path.write_bytes(b"\n".join(lines[:8]) + b"\n" + lines[8][:20])   # torn within its 9th line
    whole = sum(len(r["e"]) for r in records[:8])
    with _forced_server(model_dir, "four five six " * 100, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = _ended(client, back.id)
        events = list(client.responses.retrieve(back.id, stream=True))
        kept = [e for e in events if e.sequence_number < RUN_EVENTS]
        assert [e.model_dump() for e in kept] == [e.model_dump() for e in seen[:whole]]
        assert got.output_text.startswith(_deltas(seen[:whole])) and "four" in got.output_text
    back, seen = _stopped_midway(model_dir, "one two three " * 400, settings)
    path = tmp_path / "background" / f"{back.id}.jsonl"
    records = [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]
    records[4]["d"][0] += "X"   # a piece read again that gives other events than those kept of it
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with _forced_server(model_dir, "four five six " * 100, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = _ended(client, back.id)
        second = srv.services.tokenizer.encode("four five six " * 100, add_special_tokens=False)
        assert got.status == "completed" and got.output_text == srv.services.tokenizer.decode(second)
        events = list(client.responses.retrieve(back.id, stream=True))
        assert events[0].type == "response.created" and events[0].sequence_number == RUN_EVENTS
        assert not path.exists()


class HeldWriter:
    """The kept responses' writer thread (FileBacked.submit) as a test holds it: what is submitted
    runs when `run` says."""

    def __init__(self):
        self.calls = []

    def submit(self, fn, arg):
        self.calls.append((fn, arg))

    def run(self):
        calls, self.calls = self.calls, []
        for fn, arg in calls:
            fn(arg)


def test_a_background_response_s_progress_is_written_before_its_events_go_out(tmp_path):
    """Each record of a background response's progress is in its file when `add` returns (before
    its events are sent: a crash of the server cannot take an event a reader saw), its fsync left to
    the writer thread: one for the records written meanwhile, none once the file is deleted. Of
    many responses written to (the queued write their first events), OPEN_FILES files stay open."""
    from localheap.server.background import Progress

    held = HeldWriter()   # a writer thread that has not come round yet
    progress = Progress(tmp_path / "background", held)
    records = [{"e": [{"sequence_number": n, "type": "x"}]} for n in range(3)]
    progress.add("resp_a", records[0])
    progress.add("resp_a", records[1])
    assert progress.read("resp_a") == records[:2]
    assert [arg for _, arg in held.calls] == ["resp_a"]   # one sync for both
    fn, arg = held.calls.pop()
    fn(arg)
    progress.add("resp_a", records[2])
    assert progress.read("resp_a") == records and [arg for _, arg in held.calls] == ["resp_a"]
    progress.drop("resp_a")
    for fn, arg in held.calls:
        fn(arg)
    assert not progress.path("resp_a").exists()
    from localheap.server.background import OPEN_FILES
    many = [f"resp_{i}" for i in range(OPEN_FILES + 8)]   # (queued ones too write their first events)
    for n, rid in enumerate(many + many):
        progress.add(rid, {"n": n})
        assert len(progress._fds) <= OPEN_FILES
    assert all(progress.read(rid) == [{"n": i}, {"n": i + len(many)}] for i, rid in enumerate(many))
    progress.close()
    assert not progress._fds


def test_a_background_run_s_readers_get_its_events_once_their_lines_are_fsynced(tmp_path, monkeypatch):
    """A reader of a background run is sent an event only once the line holding it is fsynced (a
    crash of the machine cannot take an event a reader saw, so reading on after a restart from the
    last event seen never meets one the restart does not know); events that are never kept (a
    stopping server's last) go out at once, with any still unsynced before them; an end goes out
    once on the disk too."""
    import asyncio
    import os
    from types import SimpleNamespace

    from localheap.server import background as bg
    from localheap.server.routes.responses import _push

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(bg.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    held = HeldWriter()   # the writer thread, run by hand
    backgrounds = bg.Backgrounds(progress=bg.Progress(tmp_path / "background", held))
    svc = SimpleNamespace(backgrounds=backgrounds)
    event = lambda n: {"type": "response.output_text.delta", "sequence_number": n}   # noqa: E731

    async def main():
        run = bg.Run(SimpleNamespace(sequence=0, id="resp_a"), None)
        backgrounds.add(run)
        seen = []

        async def reader():
            async for message in run.read():
                seen.append(json.loads(message["data"])["sequence_number"])

        task = asyncio.create_task(reader())
        _push(svc, run, [event(0), event(1)])
        _push(svc, run, [event(2)])
        await asyncio.sleep(0.05)
        assert seen == [] and run.visible == 0 and not synced   # written, not fsynced: not sent
        held.run()   # one fsync for both lines
        await asyncio.sleep(0.05)
        assert seen == [0, 1, 2] and len(synced) == 1
        _push(svc, run, [event(3)])
        await asyncio.sleep(0.05)
        assert seen == [0, 1, 2]
        run.push([event(4)])   # never kept (a stopping server's): out at once, with 3 before it
        await asyncio.sleep(0.05)
        assert seen == [0, 1, 2, 3, 4]
        held.run()
        whole = {"status": "completed"}
        assert backgrounds.progress.add(run.id, {"e": [event(5)], "end": whole}, len(run.events) + 1)
        run.end(whole, [event(5)], synced=False)   # as routes/responses._ended ends it
        await asyncio.sleep(0.05)
        assert seen == [0, 1, 2, 3, 4] and not task.done()   # its end not on the disk yet: the stream open
        held.run()
        await asyncio.wait_for(task, 1)
        assert seen == [0, 1, 2, 3, 4, 5]

    asyncio.run(main())


def test_a_progress_line_and_a_kept_response_are_synced_to_the_drive(tmp_path, monkeypatch):
    """On macOS fsync leaves data in the drive's cache: a background response's progress line (whose
    readers wait for its sync) and a kept response's line are flushed with F_FULLFSYNC where the
    system has it (sessions.disk.fsync_fd), plain fsync where it is refused or unknown (Linux)."""
    import os

    from localheap.sessions import disk
    from localheap.server.background import Progress
    from localheap.server.jsonlines import JsonLines

    calls = []

    class MacFcntl:   # fcntl as on macOS
        F_FULLFSYNC = 51
        refuse = False

        @classmethod
        def fcntl(cls, fd, op):
            calls.append(("full", op))
            if cls.refuse:
                raise OSError(45, "Operation not supported")

    real_fsync = os.fsync
    monkeypatch.setattr(disk, "fcntl", MacFcntl)
    monkeypatch.setattr(disk.os, "fsync", lambda fd: (calls.append(("fsync", None)), real_fsync(fd)))

    held = HeldWriter()
    progress = Progress(tmp_path / "background", held)
    progress.add("resp_a", {"e": []}, 0)
    held.run()
    assert calls == [("full", 51)]
    MacFcntl.refuse, calls[:] = True, []   # a file system that refuses it
    lines = JsonLines(tmp_path / "kept.jsonl", "kept responses")
    lines._write_line(b'{"a":1}\n')
    assert calls == [("full", 51), ("fsync", None)]
    assert (tmp_path / "kept.jsonl").read_bytes() == b'{"a":1}\n'
    lines.close()
    progress.close()


def test_a_background_response_whose_end_a_crash_kept_only_in_its_progress_reads_back_ended(
        model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    """A background response ends and the server dies before its end is kept (here: the kept
    responses never get it, and its progress file is not deleted): its end was written to its
    progress before any reader was sent it, so at the restart it reads back ended as it was, its
    events all there, and is not run again (run 2 would force another text)."""
    from localheap.server.responses import UNFINISHED

    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    with _forced_server(model_dir, "one two three " * 5, **settings) as srv:
        svc = srv.services
        add = svc.responses.add
        svc.responses.add = lambda whole, *a, **k: add(whole, *a, **k) if whole["status"] in UNFINISHED else None
        svc.backgrounds.progress.drop = lambda rid: None
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        back = client.responses.create(model=model(srv), input="Go on", background=True, max_output_tokens=100)
        got = _ended(client, back.id)
        events = list(client.responses.retrieve(back.id, stream=True))
    assert got.status == "completed" and got.output_text == "one two three " * 5
    assert (tmp_path / "background" / f"{back.id}.jsonl").exists()
    with _forced_server(model_dir, "four five six " * 100, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        again = client.responses.retrieve(back.id)
        assert again.model_dump() == got.model_dump()
        assert [e.model_dump() for e in client.responses.retrieve(back.id, stream=True)] == \
            [e.model_dump() for e in events]
        later = list(client.responses.retrieve(back.id, stream=True, starting_after=3))
        assert [e.model_dump() for e in later] == [e.model_dump() for e in events[4:]]
        assert srv.services.backgrounds.running == 0
    assert not (tmp_path / "background" / f"{back.id}.jsonl").exists()
    with serve(model_dir, **settings) as srv:   # (and it was kept ended)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(back.id).model_dump() == got.model_dump()


def test_a_background_response_that_cannot_run_again_reads_back_failed_with_why(model_dirs, tmp_path_factory,
                                                                                tmp_path, torch_one_thread):
    """The server restarts serving the model under another name: the response it stopped in, which
    names the old one, is not run again; it reads back failed with the reason its request would now
    be refused for, and a third start leaves it so."""
    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    with _forced_server(model_dir, "one two three " * 400, served_model_names=["first"], **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        stall = _Stalled(srv)
        try:
            back = client.responses.create(model="first", input="Go on", max_output_tokens=3000, background=True)
        finally:
            stall.release()   # it runs; the server stops under it
    for _ in range(2):
        with serve(model_dir, served_model_names=["second"], **settings) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            got = _ended(client, back.id, timeout=30)   # (the resume runs as the server starts)
            assert got.status == "failed" and "'first' is not served here" in got.error.message
            assert got.error.code == "model_not_found" and srv.services.backgrounds.running == 0


def test_input_tokens_counts_the_prompt_a_response_reads(server, client, force):
    """POST /v1/responses/input_tokens: the prompt's tokens, as the response's usage.input_tokens
    (whole conversation, a chain continued, tools and instructions rendered)."""
    force("Fine.")
    kw = dict(input="Weather in Paris?", instructions="Be brief.", tools=TOOLS)
    counted = client.responses.input_tokens.count(model=model(server), **kw)
    first = client.responses.create(model=model(server), max_output_tokens=8, **kw)
    assert counted.object == "response.input_tokens" and counted.input_tokens == first.usage.input_tokens
    more = client.responses.input_tokens.count(previous_response_id=first.id, input="And Nice?", tools=TOOLS)
    second = client.responses.create(model=model(server), previous_response_id=first.id, input="And Nice?",
                                     tools=TOOLS, max_output_tokens=8)
    assert more.input_tokens == second.usage.input_tokens > counted.input_tokens


def test_input_items_lists_what_a_response_was_asked_with(server, client, force):
    force("Fine.")
    one = client.responses.create(model=model(server), input="Just this", max_output_tokens=8)
    (item,) = client.responses.input_items.list(one.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Just this"
    assert item.id.startswith("msg_")
    sent = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "noon"}]
    two = client.responses.create(model=model(server), input=sent, tools=TOOLS, max_output_tokens=8)
    every = list(client.responses.input_items.list(two.id, order="asc", limit=1))   # the SDK pages by after
    assert [i.type for i in every] == ["message", "message", "function_call", "function_call_output"]
    assert len({i.id for i in every}) == 4
    newest = client.responses.input_items.list(two.id, limit=2)   # desc by default
    assert [i.id for i in newest.data] == [every[3].id, every[2].id] and newest.has_more
    assert [i.id for i in client.responses.input_items.list(two.id, order="asc")] == [i.id for i in every]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_a_background_response_the_server_stopped_inside_a_character_goes_on_without_a_replacement_char(
        model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    """The server stops (SIGTERM) between the tokens of one character: what was held back of it is not
    sent as U+FFFD (the restart's next token finishes the character, sent whole: both were sent once)."""
    text = "\U0001F642" * 600   # each four byte-level tokens in the tiny qwen tokenizer
    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    with _forced_server(model_dir, text, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        engine = srv.services.engine
        back = client.responses.create(model=model(srv), input="Go on", max_output_tokens=3000, background=True)

        def inside_a_character():   # on the engine thread, between two steps
            for r in engine._active:
                if len(r.completion) > 40 and len(r.completion) % 4 == 2:
                    engine.interrupt("shutdown")
                    return True
            return False

        deadline = time.monotonic() + 60
        while not engine.call(inside_a_character).result(10):
            assert time.monotonic() < deadline
        _ended(client, back.id)
    with _forced_server(model_dir, text, **settings) as srv:
        got = _ended(openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), back.id)
        assert got.output_text and set(got.output_text) == {"\U0001F642"}, repr(got.output_text[:60])
