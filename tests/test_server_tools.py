"""Tool calls, reasoning and structured output through the real server (uvicorn in a thread, a
tiny torch model carrying a Qwen-style template) driven by the official OpenAI SDK, unmodified.

A random model will not choose to call a tool, so most tests force the sampled tokens (the server's
test-only `force_tokens` hook: a Constraint that lets only the given ids through the sampler)
while the template, the parser, the stream and the session run for real."""

from __future__ import annotations

import json

import pytest

from family_templates import QWEN, TEMPLATES, glm4_model, phi4_mini_model, with_template

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from localheap.grammar import ForcedTokens  # noqa: E402
from localheap.heap import HeapConfig  # noqa: E402
from tool_server import CALL, CITY, HEAP, NEST_LARK, nested, qwen_model, serve  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory, torch_one_thread):
    with serve(qwen_model(model_dirs, tmp_path_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model(client):
    return client.models.list().data[0].id


def ask(client, messages, **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model=model(client), messages=messages, **kw)


def test_a_tool_call_and_its_result_sent_back(client, force):
    force(CALL)
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(client, history)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    force("It is sunny in Paris.")
    history += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"}]
    second = ask(client, history)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None
    assert second.localheap["session_id"] == first.localheap["session_id"]
    # the reply rendered back by the template is what was generated: the whole first turn is reused
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1


def test_streamed_tool_call_deltas(client, force):
    force("<think>\nweather needs a tool\n</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
    stream = ask(client, [{"role": "user", "content": "Paris and Lyon?"}], stream=True, max_tokens=300)
    calls, reasoning, content, finish = {}, [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": "", "parts": 0})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
            c["parts"] += bool(tc.function.arguments)
    assert finish == "tool_calls" and "".join(content) == ""
    assert "".join(reasoning) == "\nweather needs a tool\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert len({c["id"] for c in calls.values()}) == 2
    assert all(c["parts"] > 1 for c in calls.values())   # the arguments stream as they are written


def test_arguments_that_are_not_json_come_back_flagged(client, force):
    force('<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>')
    r = ask(client, [{"role": "user", "content": "Paris?"}])
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == "{city: Paris}"
    (err,) = r.localheap["tool_call_errors"]
    assert err["id"] == call.id and "not valid JSON" in err["error"]
    chunks = list(ask(client, [{"role": "user", "content": "Paris?"}], stream=True))
    flagged = [c.localheap for c in chunks if getattr(c, "localheap", None) and "tool_call_errors" in c.localheap]
    assert len(flagged) == 1


NEST = {"type": "custom", "custom": {"name": "nest", "description": "Nested lists.", "format": {
    "type": "grammar", "grammar": {"syntax": "lark", "definition": NEST_LARK}}}}
SQL = {"type": "custom", "custom": {"name": "run_sql", "description": "Run a query."}}   # free text
SQL_CALL = '<tool_call>\n{"name": "run_sql", "arguments": {"input": "SELECT \\"a\\"\\nFROM t;"}}\n</tool_call>'


def test_a_custom_tool_call_whole_streamed_and_sent_back(client, force):
    """Chat Completions custom tools (OpenAI's {"type": "custom", "custom": {...}}): offered to the model
    as a function of one string, `input`; its call comes back {"type": "custom", "custom": {"name",
    "input"}} (streamed: its id and name first, then its input in parts, decoded from the JSON string
    the model writes it in), sent back in the history it
    renders the prompt as it was (the session's tokens reused), and arguments that are not
    {"input": "..."} come back as written, flagged."""
    force(SQL_CALL)
    history = [{"role": "user", "content": "Count the rows."}]
    first = ask(client, history, tools=TOOLS + [SQL])
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.type == "custom" and call.id.startswith("call_")
    assert (call.custom.name, call.custom.input) == ("run_sql", 'SELECT "a"\nFROM t;')
    chunks = list(ask(client, history, tools=TOOLS + [SQL], stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    custom = [_field(d.custom, "name") or "" for d in deltas], [_field(d.custom, "input") or "" for d in deltas]
    assert deltas[0].type == "custom" and deltas[0].id and custom[0][0] == "run_sql"   # (SDKs before the
    assert "".join(custom[1]) == 'SELECT "a"\nFROM t;' and len(deltas) > 3          # delta's custom: a dict)
    assert all(custom[1][1:]) and not any(custom[0][1:]), "the input in parts as it is written, decoded"
    force("Three rows.")
    history += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    second = ask(client, history, tools=TOOLS + [SQL])
    assert second.choices[0].message.content == "Three rows."
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    force('<tool_call>\n{"name": "run_sql", "arguments": {"query": "x"}}\n</tool_call>')
    r = ask(client, [{"role": "user", "content": "Go."}], tools=[SQL])
    (call,) = r.choices[0].message.tool_calls
    assert call.custom.input == '{"query": "x"}' and "string 'input'" in r.localheap["tool_call_errors"][0]["error"]
    chunks = list(ask(client, [{"role": "user", "content": "Go."}], tools=[SQL], stream=True))
    parts = [_field(tc.custom, "input") or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert "".join(parts) == '{"query": "x"}', "streamed: the arguments as written, once they are whole"
    assert sum("tool_call_errors" in (getattr(c, "localheap", None) or {}) for c in chunks) == 1


def _field(obj, key: str):
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def test_a_custom_tools_format_holds_its_input_and_tool_choice_names_it(client):
    """A custom tool's grammar format (a recursive Lark grammar here) holds the (random) model's input;
    tool_choice {"type": "custom", "custom": {"name"}} and allowed_tools naming it force its call; a
    choice naming a custom tool that is not offered, or a custom tool named as another tool is, is a 400."""
    choices = [{"type": "custom", "custom": {"name": "nest"}},
               {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                   {"type": "custom", "custom": {"name": "nest"}}]}}]
    for seed in range(4):
        r = ask(client, [{"role": "user", "content": "Go."}], tools=TOOLS + [NEST, SQL], temperature=1.0, seed=seed,
                max_tokens=400, tool_choice=choices[seed % 2], parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert call.type == "custom" and call.custom.name == "nest" and nested(call.custom.input), call
    bad = [dict(tools=TOOLS, tool_choice=choices[0]),
           dict(tools=TOOLS + [{"type": "custom", "custom": {"name": "get_weather"}}]),
           dict(tools=[NEST, NEST])]
    from localheap.server.schemas import ChatCompletionRequest   # (two functions of one name: as before)
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Go."}],
                                 tools=TOOLS + TOOLS[:1]).unsupported() is None
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            ask(client, [{"role": "user", "content": "Go."}], **kw)


def test_tool_choice_none_returns_text_and_a_reasoning_reply_splits(client, force):
    force(CALL)
    r = ask(client, [{"role": "user", "content": "Paris?"}], tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    force("<think>\nshort\n</think>\n\nHello!")
    r = client.chat.completions.create(model=model(client), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=40, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = r.choices[0].message
    assert msg.content == "Hello!" and msg.reasoning_content == "\nshort\n"


def test_a_reasoning_turn_then_the_next_finds_the_session(client, force):
    """The template drops past turns' reasoning (before the last question), so the history it renders
    parts from the reply as generated at the reasoning: the session is found again and rolled back
    to that point (the turn's prompt is reused)."""
    force("<think>\nshort\n</think>\n\nHi.")
    history = [{"role": "user", "content": "hello"}]
    first = client.chat.completions.create(model=model(client), messages=history, max_tokens=40)
    assert first.choices[0].message.reasoning_content == "\nshort\n"
    force("Fine.")
    for reasoning in (False, True):   # a client that sends reasoning_content back, and one that does not
        msg = {"role": "assistant", "content": "Hi."}
        if reasoning:
            msg["reasoning_content"] = "\nshort\n"
        second = client.chat.completions.create(model=model(client), max_tokens=10,
                                                messages=history + [msg, {"role": "user", "content": "and you?"}])
        assert second.localheap["session_id"] == first.localheap["session_id"]
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_a_forced_tool_choice_is_enforced_by_the_grammar(client):
    """No forced tokens: the random model is held to a call of the named function with valid arguments."""
    for seed in range(3):
        r = ask(client, [{"role": "user", "content": "any city"}], temperature=1.0, seed=seed, max_tokens=60,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather", r
        jsonschema.validate(json.loads(call.function.arguments), CITY)
        assert r.choices[0].finish_reason == "tool_calls"
    r = ask(client, [{"role": "user", "content": "anything"}], tool_choice="required", temperature=1.0, seed=7)
    assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"


# schemas a random model completes in a few tokens (an open object's keys are strings of any length)
TIGHT = [TOOLS[0], {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}]


def _calls_and_errors(client, **kw):
    r = ask(client, [{"role": "user", "content": "any city"}], temperature=1.0, tools=TIGHT, **kw)
    return r, r.choices[0].message.tool_calls or [], (getattr(r, "localheap", None) or {}).get("tool_call_errors", [])


def test_a_call_the_reply_opens_is_held_to_the_tools(server, client, lead):
    """tool_choice auto: once the (random) model has opened a call, the grammar holds it to an offered
    tool's name and to arguments valid for its schema; the reply is free again after the block. With
    serve --no-tool-grammar the same opening gives calls that are not (the test can fail)."""
    lead("<tool_call>")
    for seed in range(4):
        r, calls, errors = _calls_and_errors(client, seed=seed, max_tokens=90)
        assert calls and not errors, (seed, r)
        for call in calls:
            assert call.function.name in ("get_weather", "get_time"), call
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), CITY)
            else:
                assert json.loads(call.function.arguments) == {}
    for stream in (False, True):   # streamed: the same calls, piece by piece
        kw = dict(seed=11, max_tokens=90, temperature=1.0)
        whole = ask(client, [{"role": "user", "content": "any city"}], tools=TIGHT, **kw).choices[0].message.tool_calls
        got = {}
        for chunk in ask(client, [{"role": "user", "content": "any city"}], tools=TIGHT, stream=True, **kw):
            for choice in chunk.choices:
                for d in choice.delta.tool_calls or []:
                    c = got.setdefault(d.index, ["", ""])
                    c[0] += d.function.name or ""
                    c[1] += d.function.arguments or ""
        assert [(c.function.name, c.function.arguments) for c in whole] == [tuple(v) for v in got.values()]
    for seed in range(3):   # parallel_tool_calls false: one call, then only the end
        r, calls, errors = _calls_and_errors(client, seed=seed, max_tokens=90, parallel_tool_calls=False)
        assert len(calls) == 1 and not errors and r.choices[0].finish_reason == "tool_calls", r
    server.services.settings.tool_grammar = False
    bad = 0
    for seed in range(4):
        r, calls, errors = _calls_and_errors(client, seed=seed, max_tokens=90)
        bad += bool(errors) or not calls
    assert bad == 4


def test_a_reply_that_opens_no_call_samples_as_without_the_grammar(server, client, lead):
    """The grammar masks nothing until a call opens: the same seeds give the same replies with it and
    without it (serve --no-tool-grammar), also where the reply names the opener in its reasoning."""
    import httpx

    svc = server.services

    def fresh(seed):
        """A reply read into a new session: one that read the same prompt (its reply evicted) would be
        rewound to it instead, a heap that gives other logits (test_mark.py)."""
        for sess in httpx.get(f"{server.url}/v1/sessions", timeout=60).json()["data"]:
            httpx.delete(f"{server.url}/v1/sessions/{sess['id']}", timeout=60).raise_for_status()
        return ask(client, [{"role": "user", "content": "hello"}], temperature=1.0, seed=seed,
                   max_tokens=40).choices[0].message

    for opening in (None, "<think>\nI could write it as <tool_call>"):   # the reply goes on in its reasoning
        lead(opening)
        replies = {}
        for grammar in (True, False):
            svc.settings.tool_grammar = grammar
            replies[grammar] = [fresh(seed) for seed in range(3)]
        assert [(m.content, getattr(m, "reasoning_content", None)) for m in replies[True]] == \
            [(m.content, getattr(m, "reasoning_content", None)) for m in replies[False]]
        if opening:
            assert all("<tool_call>" in m.reasoning_content for m in replies[True])


def test_a_prompt_that_ends_inside_think_reasons_then_the_grammar_holds_what_follows(client, lead):
    """A template that opens <think> in its generation prompt (open_think here, as Qwen3-Thinking's):
    a forced call or structured output is held from </think> on, the reasoning before it is free and
    comes back as reasoning (the grammar held from the first token made the reply's call its reasoning)."""
    think = {"chat_template_kwargs": {"open_think": True}}
    lead("the user asked\n</think>\n\n")   # a random model would not close its reasoning by itself
    for seed in range(3):
        r = ask(client, [{"role": "user", "content": "any city"}], tools=TIGHT, tool_choice="required",
                temperature=1.0, seed=seed, max_tokens=60, parallel_tool_calls=False, extra_body=think)
        msg = r.choices[0].message
        assert msg.reasoning_content == "the user asked\n", r
        (call,) = msg.tool_calls
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
        assert r.choices[0].finish_reason == "tool_calls" and not msg.content
    schema = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    for seed in range(3):
        r = ask(client, [{"role": "user", "content": "on or off"}], tools=None, response_format=fmt, temperature=1.0,
                seed=seed, max_tokens=60, extra_body=think)
        msg = r.choices[0].message
        assert msg.reasoning_content == "the user asked\n" and r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(msg.content), schema)


def test_a_named_session_sent_new_messages_only_holds_what_the_whole_history_renders(client, server, force):
    """The web UI and `localheap chat` send only the new message to their session: it follows the last
    reply's end of turn (the model sampled that token and never read it: the turn was left open,
    `reply<|user|>`), so the session holds what the whole conversation renders, token for token."""
    from localheap.server.prompts import chat_prompt
    from localheap.server.schemas import ChatMessage

    svc = server.services
    force("First reply.")
    first = ask(client, [{"role": "user", "content": "one"}], tools=None)
    sid = first.localheap["session_id"]
    force("Second reply.")
    ask(client, [{"role": "user", "content": "two"}], tools=None, extra_headers={"X-Session-Id": sid})
    whole = chat_prompt(svc.tokenizer, [ChatMessage(role="user", content="one"),
                                        ChatMessage(role="assistant", content="First reply."),
                                        ChatMessage(role="user", content="two")]).tokens
    fed = list(svc.store.get(sid).fed)
    assert fed[:len(whole)] == list(whole), svc.tokenizer.decode(fed)
    # a reply max_tokens cut: its last token (sampled, sent, never read) is read before the next turn
    force("Third reply, a long one.")
    cut = ask(client, [{"role": "user", "content": "three"}], tools=None, max_tokens=3,
              extra_headers={"X-Session-Id": sid})
    assert cut.choices[0].finish_reason == "length"
    force("Fourth.")
    ask(client, [{"role": "user", "content": "four"}], tools=None, extra_headers={"X-Session-Id": sid})
    whole = chat_prompt(svc.tokenizer, [ChatMessage(role="user", content="one"),
                                        ChatMessage(role="assistant", content="First reply."),
                                        ChatMessage(role="user", content="two"),
                                        ChatMessage(role="assistant", content="Second reply."),
                                        ChatMessage(role="user", content="three"),
                                        ChatMessage(role="assistant", content=cut.choices[0].message.content),
                                        ChatMessage(role="user", content="four")]).tokens
    fed = list(svc.store.get(sid).fed)
    assert fed[:len(whole)] == list(whole), svc.tokenizer.decode(fed)


def test_a_reply_stopped_through_its_session_streams_every_token_the_session_keeps(client, server, force):
    """POST /v1/sessions/{id}/stop (the web UI's Stop): the reply ends at its next token, its stream is
    read to its end ("interrupted": "stopped"), and the next turn sent alone follows exactly the text the
    client got (a client that just leaves misses the tokens decoded before the server notices)."""
    import httpx

    from localheap.server.prompts import chat_prompt
    from localheap.server.schemas import ChatMessage

    svc = server.services
    force("First reply.")
    sid = ask(client, [{"role": "user", "content": "one"}], tools=None).localheap["session_id"]
    force("word " * 3000)
    stream = ask(client, [{"role": "user", "content": "two"}], tools=None, max_tokens=5000, stream=True,
                 extra_headers={"X-Session-Id": sid})
    parts, last = [], None
    for i, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if i == 3:
            stopped = httpx.post(f"{server.url}/v1/sessions/{sid}/stop", timeout=60).json()
            assert stopped["stopped"] == 1 and stopped["id"] == sid
        last = chunk
    assert last.localheap["interrupted"] == "stopped" and last.choices[0].finish_reason == "stop"
    reply = "".join(parts)
    assert 0 < len(reply) < len("word " * 1000)
    assert httpx.post(f"{server.url}/v1/sessions/{sid}/stop", timeout=60).json()["stopped"] == 0   # none runs
    force("Third.")
    ask(client, [{"role": "user", "content": "three"}], tools=None, extra_headers={"X-Session-Id": sid})
    history = [("user", "one"), ("assistant", "First reply."), ("user", "two"), ("assistant", reply), ("user", "three")]
    whole = list(chat_prompt(svc.tokenizer, [ChatMessage(role=r, content=c) for r, c in history]).tokens)
    fed = list(svc.store.get(sid).fed)
    assert fed[:len(whole)] == whole, svc.tokenizer.decode(fed)
    assert httpx.post(f"{server.url}/v1/sessions/nope/stop", timeout=60).status_code == 404


def test_a_completion_max_tokens_cut_on_a_named_session_goes_on_after_its_last_token(client, server):
    """Legacy completions on a named session, sent only the text that follows: the reply max_tokens cut
    had its last token sampled and sent, never read; it is read before that text (it was dropped)."""
    svc = server.services
    prompt = svc.tokenizer.encode("Once upon", add_special_tokens=False)
    for seed in range(8):   # (a random model's reply may end at once)
        first = client.completions.create(model=model(client), prompt="Once upon", max_tokens=3, temperature=1.0,
                                          seed=seed)
        if first.choices[0].finish_reason == "length":
            break
    sid = first.localheap["session_id"]
    fed_then = list(svc.store.get(sid).fed)
    assert fed_then[-len(prompt) - 2:-2] == prompt   # the prompt, two tokens of the reply read, its third not
    client.completions.create(model=model(client), prompt=" and then", max_tokens=2, extra_headers={"X-Session-Id": sid})
    then = svc.tokenizer.encode(" and then", add_special_tokens=False)
    fed = list(svc.store.get(sid).fed)
    n = len(fed_then)
    assert fed[:n] == fed_then and fed[n + 1:n + 1 + len(then)] == then, svc.tokenizer.decode(fed)
    assert svc.tokenizer.decode(fed[n - 2:n + 1]) == first.choices[0].text   # the reply whole, then the new text


@pytest.mark.parametrize("case", ["one_token", "empty", "fork"])
def test_a_named_sessions_next_turn_closes_a_reply_of_one_token_or_none_and_a_forks_too(client, server, force, case):
    """The edges of the test above (the review's): a reply max_tokens cut at its first token (none of
    it read), a reply that is its end alone, and a fork taken right after a reply: the next turn, sent
    alone, still follows that reply's text and end of turn."""
    import httpx

    from localheap.server.prompts import chat_prompt
    from localheap.server.schemas import ChatMessage

    svc = server.services
    force("First reply.")
    sid = ask(client, [{"role": "user", "content": "one"}], tools=None).localheap["session_id"]
    history = [("user", "one"), ("assistant", "First reply.")]
    if case == "fork":
        sid = httpx.post(server.url + f"/v1/sessions/{sid}/fork", timeout=60).json()["id"]
    else:
        force("" if case == "empty" else "Second reply, long.")
        r = ask(client, [{"role": "user", "content": "two"}], tools=None, extra_headers={"X-Session-Id": sid},
                **({"max_tokens": 1} if case == "one_token" else {}))
        history += [("user", "two"), ("assistant", r.choices[0].message.content or "")]
    force("Third.")
    ask(client, [{"role": "user", "content": "three"}], tools=None, extra_headers={"X-Session-Id": sid})
    whole = list(chat_prompt(svc.tokenizer, [ChatMessage(role=r, content=c) for r, c in history + [("user", "three")]]).tokens)
    fed = list(svc.store.get(sid).fed)
    assert fed[:len(whole)] == whole, svc.tokenizer.decode(fed)


def test_allowed_tools_keep_every_tool_in_the_prompt_and_hold_calls_to_the_allowed(client, lead):
    """tool_choice allowed_tools: the prompt is the same as with all tools (the session's prefix does not
    change), and the grammar lets the model call only the allowed ones: mode required forces a call of
    one of them; mode auto holds a call the reply opens to them. A name not in tools is a 400."""
    only_time = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    plain = ask(client, [{"role": "user", "content": "any city"}], tools=TIGHT, max_tokens=1)
    for seed in range(3):
        r = ask(client, [{"role": "user", "content": "any city"}], tools=TIGHT, tool_choice=only_time,
                temperature=1.0, seed=seed, max_tokens=60, parallel_tool_calls=False)
        assert r.usage.prompt_tokens == plain.usage.prompt_tokens
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"], r
        assert r.choices[0].finish_reason == "tool_calls"
    lead("<tool_call>")
    auto = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}
    for seed in range(3):
        r, calls, errors = _calls_and_errors(client, seed=seed, max_tokens=90, tool_choice=auto)
        assert calls and {c.function.name for c in calls} == {"get_weather"} and not errors, r
    lead(None)
    bad = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "nowhere"}}]}}
    with pytest.raises(openai.BadRequestError, match="nowhere"):
        ask(client, [{"role": "user", "content": "hi"}], tool_choice=bad)


def test_a_forced_call_cut_by_max_tokens_returns_no_markup_as_content(client):
    """The grammar's call cut short: no content (its markup is not the model's text), finish_reason length;
    the call comes back, flagged, once its name is written. A forced reply's content is null, never ""
    (whole, and in every chunk streamed), cut before a call's name too."""
    for max_tokens in (2, 6, 12, 20):
        for stream in (False, True):
            kw = dict(tool_choice="required", temperature=1.0, seed=max_tokens, max_tokens=max_tokens)
            if not stream:
                r = ask(client, [{"role": "user", "content": "any city"}], **kw)
                msg, finish = r.choices[0].message, r.choices[0].finish_reason
                content, calls = msg.content, msg.tool_calls or []
            else:
                content, calls, finish = "", {}, None
                for chunk in ask(client, [{"role": "user", "content": "any city"}], stream=True, **kw):
                    for choice in chunk.choices:
                        assert choice.delta.content is None, chunk
                        content += choice.delta.content or ""
                        for d in choice.delta.tool_calls or []:
                            calls.setdefault(d.index, d.function.name)
                        finish = choice.finish_reason or finish
            assert content is None if not stream else not content, (max_tokens, stream, content)
            assert finish == "length", (max_tokens, stream, finish)
            names = [c.function.name for c in calls] if not stream else list(calls.values())
            assert set(names) <= {"get_weather", "get_time"}, names


def _agent(client, force, turns: int = 30):
    """An agent's session: history resent every turn, with calls and results. Every turn after the
    first finds the session and reuses all it holds (the rendered history is what was generated)."""
    history = [{"role": "system", "content": "You are a weather agent."},
               {"role": "user", "content": "Track the weather in Paris for me, every hour."}]
    session, tokens = None, 0
    for turn in range(turns):
        force(CALL if turn % 3 != 2 else f"Report {turn}: still fine.")
        r = ask(client, history, max_tokens=60)
        msg, usage = r.choices[0].message, r.usage
        if turn == 0:
            session = r.localheap["session_id"]
            assert usage.prompt_tokens_details.cached_tokens == 0
        else:
            assert r.localheap["session_id"] == session, turn
            assert usage.prompt_tokens_details.cached_tokens >= tokens, (turn, usage)
        tokens = usage.prompt_tokens + usage.completion_tokens - 1
        history.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                            "content": f"hour {turn}: 18C, sunny, wind 10 km/h from the west"})
        else:
            history.append({"role": "user", "content": "Go on."})
    return r


def test_an_agent_session_of_30_turns_reuses_its_session_past_the_heap(client, force):
    r = _agent(client, force)
    heap = r.localheap["heap"]
    assert r.usage.prompt_tokens > 10 * HEAP.budget and heap["evicted"] > 0, heap


def test_the_agent_session_with_recall_pages_what_it_evicts(model_dirs, tmp_path_factory, torch_one_thread):
    """The same agent on a heap with the recall tier (as serve runs by default): evicted tokens go
    to pages on disk, and every turn still reuses the session."""
    heap = HeapConfig(budget=96, slack=32, recent=16, policy="snapkv", recall=True, recall_budget=32, page_size=8)
    with serve(with_template(model_dirs("qwen2"), tmp_path_factory.mktemp("qr") / "m", QWEN), heap) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        svc = srv.services

        def force(text):
            ids = svc.tokenizer.encode(text, add_special_tokens=False)
            svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)

        r = _agent(c, force, turns=12)
        stats = r.localheap["heap"]
        assert stats["evicted"] > 0 and stats["pages"] is not None, stats
        assert any(isinstance(v, int) and v > 0 for v in stats["pages"].values()), stats["pages"]


@pytest.mark.parametrize("family,reply", [
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]'),
    ("llama3.1", '{"name": "get_weather", "parameters": {"city": "Nice"}}'),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n</function>\n"
                    "</tool_call>"),
    ("glm-4.5", "\n<think>a call</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Nice</arg_value>\n"
                "</tool_call>"),
])
def test_a_call_and_its_result_round_trip_in_each_family(model_dirs, tmp_path_factory, torch_one_thread,
                                                          family, reply):
    """Mistral's template writes the call's id into the call (9 letters and digits, checked by the
    template), so the history it renders differs from the reply as generated: the session is reused
    by rolling back to where they part (within the heap). Llama 3.1's calls are whole-reply JSON;
    Qwen3-Coder's are XML with raw-text values, GLM-4.5's key and value pairs after its reasoning (both
    streamed in parts as the JSON they are read as). Each of these families' calls streams in parts."""
    tmp = tmp_path_factory.mktemp(family) / "m"
    with serve(with_template(model_dirs("llama"), tmp, TEMPLATES[family]), HeapConfig(budget=1024)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        svc = srv.services
        ids = svc.tokenizer.encode(reply, add_special_tokens=False)
        svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
        history = [{"role": "user", "content": "Nice?"}]
        first = ask(c, history)
        (call,) = first.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Nice"}
        assert first.choices[0].finish_reason == "tool_calls"
        if family == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()
        history += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "20C"}]
        second = ask(c, history)
        assert second.localheap["session_id"] == first.localheap["session_id"]
        # at least the first prompt (its last token may merge with the reply's first when re-tokenized)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
        streamed = {}
        for chunk in ask(c, [{"role": "user", "content": "Nice, again?"}], stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                streamed.setdefault(tc.index, [tc.function.name, []])[1].append(tc.function.arguments or "")
        ((name, parts),) = streamed.values()
        assert name == "get_weather" and json.loads("".join(parts)) == {"city": "Nice"}
        assert sum(bool(p) for p in parts) > 2, parts   # in parts as it is written


def _held_and_free(c, svc, opener: str, seeds: int = 3, **kw) -> None:
    """Replies made to open a call with `opener` (a random model never would): held by the grammar,
    each comes back as valid calls of TIGHT's tools; free (serve --no-tool-grammar), the same openings
    give none (the test can fail)."""
    svc.lead_tokens = svc.tokenizer.encode(opener, add_special_tokens=False)
    for seed in range(seeds):
        r = ask(c, [{"role": "user", "content": "any city"}], tools=TIGHT, temperature=1.0, seed=seed,
                max_tokens=90, **kw)
        calls = r.choices[0].message.tool_calls or []
        assert calls and not (getattr(r, "localheap", None) or {}).get("tool_call_errors"), r
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                jsonschema.validate(args, CITY)
            else:
                assert call.function.name == "get_time" and args == {}
    svc.settings.tool_grammar = False
    for seed in range(seeds):
        r = ask(c, [{"role": "user", "content": "any city"}], tools=TIGHT, temperature=1.0, seed=seed,
                max_tokens=90, **kw)
        calls = r.choices[0].message.tool_calls or []
        assert not calls or (getattr(r, "localheap", None) or {}).get("tool_call_errors"), r
    svc.settings.tool_grammar, svc.lead_tokens = True, None


@pytest.mark.parametrize("family", ["qwen3-coder", "glm-4.5"])
def test_an_xml_call_the_reply_opens_is_held_to_the_tools(model_dirs, tmp_path_factory, torch_one_thread, family):
    """Qwen3-Coder's and GLM-4.5's calls (tool_choice auto): once the random model has opened one, the
    grammar holds it to an offered tool and its parameters; each comes back with arguments valid for
    the schema."""
    tmp = tmp_path_factory.mktemp(family) / "m"
    with serve(with_template(model_dirs("qwen2"), tmp, TEMPLATES[family])) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        svc = srv.services
        _held_and_free(c, svc, "<tool_call>", seeds=4)


def test_phi4_mini_calls_results_and_held_calls_through_the_server(model_dirs, tmp_path_factory, torch_one_thread):
    """Phi-4-mini (its own template, on the phi3 architecture): the tools in the system message's
    `tools` field, a list of calls without its closing token (as the model often writes it) read as
    two calls, whole and streamed; the results sent back as `tool` turns reuse the whole first turn
    (the calls written back as generated, <|end|> its EOS). With tool_choice auto a call the reply
    opens is held to the tools (free, the same openings give none); with tool_choice required the
    reply is calls only."""
    reply = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Nice"}}, '
             '{"name": "get_time", "arguments": {}}]<|/tool_call|>')
    with serve(phi4_mini_model(model_dirs, tmp_path_factory.mktemp("phi4") / "m"), HeapConfig(budget=1024)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        svc = srv.services
        for text in (reply, reply[:-len("<|/tool_call|>")]):
            ids = svc.tokenizer.encode(text, add_special_tokens=False)
            svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
            history = [{"role": "user", "content": "Nice?"}]
            first = ask(c, history)
            assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
            calls = first.choices[0].message.tool_calls
            assert [(x.function.name, json.loads(x.function.arguments)) for x in calls] == \
                [("get_weather", {"city": "Nice"}), ("get_time", {})]
            streamed = {}
            for chunk in ask(c, history, stream=True):
                for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    streamed.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            assert [(n, json.loads(a)) for n, a in streamed.values()] == [("get_weather", {"city": "Nice"}),
                                                                        ("get_time", {})]
        ids = svc.tokenizer.encode(reply, add_special_tokens=False)
        first = ask(c, history)
        history += [first.choices[0].message] + [{"role": "tool", "tool_call_id": x.id, "content": "20C"}
                                                 for x in first.choices[0].message.tool_calls]
        svc.force_tokens = None
        second = ask(c, history, max_tokens=4)
        assert second.localheap["session_id"] == first.localheap["session_id"]
        assert second.usage.prompt_tokens_details.cached_tokens >= \
            first.usage.prompt_tokens + first.usage.completion_tokens - 1
        # <|tool_call|> is one token, read by the grammar a step late: the draw after it is held on the
        # device (grammar.IfLast), so even a random model's next token is the call's "["; one call
        # (parallel_tool_calls false): a random model's list is not cut short
        _held_and_free(c, svc, "<|tool_call|>", parallel_tool_calls=False)
        r = ask(c, [{"role": "user", "content": "any city"}], tools=TIGHT, tool_choice="required",
                temperature=1.0, seed=5, max_tokens=90)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None, r


def test_glm4_0414_calls_results_and_held_calls_through_the_server(model_dirs, tmp_path_factory, torch_one_thread):
    """GLM-4-0414 (its template's structure, the glm4 architecture): a reply that is a tool's name and
    its JSON arguments comes back as a call; the call goes back as an assistant turn with `metadata`
    and the result as an `observation` turn, and the whole first turn is reused (the model stopped
    at <|observation|>, which the template writes there); a text reply loses the template's leading
    newline and is reused the same way. With tool_choice auto a reply that begins with a tool's name
    is held to that call (free, the same openings give none); tool_choice required gives one call."""
    with serve(glm4_model(model_dirs, tmp_path_factory.mktemp("glm4") / "m"), HeapConfig(budget=1024)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        svc = srv.services

        def force(text, stop="<|observation|>"):
            ids = svc.tokenizer.encode(text + stop, add_special_tokens=False)
            svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)

        force('get_weather \n{"city": "Nice"}')
        history = [{"role": "user", "content": "Nice?"}]
        first = ask(c, history)
        (call,) = first.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Nice"})
        assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
        history += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "20C"}]
        force("\nIt is 20C in Nice.", "<|user|>")
        second = ask(c, history)
        assert second.choices[0].message.content == "It is 20C in Nice." and not second.choices[0].message.tool_calls
        assert second.localheap["session_id"] == first.localheap["session_id"]
        assert second.usage.prompt_tokens_details.cached_tokens >= \
            first.usage.prompt_tokens + first.usage.completion_tokens - 1   # all it fed (not its last token)
        history += [second.choices[0].message, {"role": "user", "content": "Thanks."}]
        svc.force_tokens = None
        third = ask(c, history, max_tokens=4)
        assert third.usage.prompt_tokens_details.cached_tokens >= \
            second.usage.prompt_tokens + second.usage.completion_tokens - 1
        _held_and_free(c, svc, "get_weather")
        r = ask(c, [{"role": "user", "content": "any city"}], tools=TIGHT, tool_choice="required",
                temperature=1.0, seed=5, max_tokens=90)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1, r
        chat = [{"role": "user", "content": "Hello?"}]   # no tools: the text loses the newline all the same
        force("\nHello there, a long reply.", "<|user|>")
        plain = c.chat.completions.create(model=model(c), messages=chat, max_tokens=40)
        assert plain.choices[0].message.content == "Hello there, a long reply."
        svc.force_tokens = None
        chat += [plain.choices[0].message, {"role": "user", "content": "And?"}]
        again = c.chat.completions.create(model=model(c), messages=chat, max_tokens=4)
        assert again.usage.prompt_tokens_details.cached_tokens >= \
            plain.usage.prompt_tokens + plain.usage.completion_tokens - 1


def test_tools_on_a_template_without_them_are_described_in_a_system_message(model_dirs, torch_one_thread):
    with serve(model_dirs("llama")) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        svc = srv.services
        ids = svc.tokenizer.encode(CALL, add_special_tokens=False)
        svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
        history = [{"role": "user", "content": "Paris?"}]
        first = ask(c, history)
        (call,) = first.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and first.choices[0].finish_reason == "tool_calls"
        history += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
        svc.force_tokens = None
        second = ask(c, history, max_tokens=4)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert second.localheap["session_id"] == first.localheap["session_id"]


def test_langchain_tool_calling_agent(server, client):
    """LangChain's own agent (create_agent over ChatOpenAI), unmodified: it sends the tools, runs the
    tool the model called, sends the result back, and ends with the model's answer."""
    pytest.importorskip("langchain_openai")
    agents = pytest.importorskip("langchain.agents")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    seen = []

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        seen.append(city)
        return f"18C and sunny in {city}"

    svc = server.services
    replies = [CALL, "It is 18C and sunny in Paris."]
    ids = [svc.tokenizer.encode(t, add_special_tokens=False) for t in replies]
    svc.force_tokens = lambda: ForcedTokens(ids.pop(0), svc.backend.eos_token_ids)
    try:
        llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=model(client), max_tokens=80,
                         temperature=0, max_retries=0)
        agent = agents.create_agent(llm, [get_weather])
        out = agent.invoke({"messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
    finally:
        svc.force_tokens = None
    assert seen == ["Paris"] and not ids
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    assert out["messages"][-1].content == "It is 18C and sunny in Paris."


def test_a_clients_own_session_header_is_ignored(server, client):
    """opencode sends `x-session-id: ses_...` (its own conversation id) on every request, its title
    request and its agent's alike: not an id of this server (sess_...), so it addresses nothing.
    Each conversation finds its own session by prefix; an id of this server's form that names no
    session is still a 404."""
    import httpx

    header = {"X-Session-Id": "ses_ddc538f9dffeSZTiFWjl8zlVAn"}
    url = server.url + "/v1/chat/completions"
    title = {"model": model(client), "max_tokens": 4, "temperature": 0,
             "messages": [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "hi"}]}
    agent = {"model": model(client), "max_tokens": 4, "temperature": 0, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": CITY}}], "messages": [{"role": "user", "content": "Weather in Nice?"}]}
    a = httpx.post(url, json=title, headers=header, timeout=60)
    b = httpx.post(url, json=agent, headers=header, timeout=60)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.headers["X-Session-Id"] != b.headers["X-Session-Id"], "two conversations, two sessions"
    turn = {**agent, "messages": agent["messages"] + [b.json()["choices"][0]["message"],
                                                      {"role": "user", "content": "And Lyon?"}]}
    c = httpx.post(url, json=turn, headers=header, timeout=60)
    assert c.status_code == 200 and c.headers["X-Session-Id"] == b.headers["X-Session-Id"]
    assert c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= b.json()["usage"]["prompt_tokens"]
    gone = httpx.post(url, json=title, headers={"X-Session-Id": "sess_nope"}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"


def test_a_reasoning_reply_that_evicted_is_rewound_not_read_again(server, client, force):
    """The template drops a past turn's reasoning, so the next prompt leaves the session where the
    reply began; the reply evicted, and the session rewinds to that
    point instead of a new session reading the whole conversation again (backends/slots.py). The
    prompt filled the heap, so a reply longer than the slack evicted."""
    thoughts = " ".join(f"step {i} of the plan checks the forecast" for i in range(2))
    force(f"<think>\n{thoughts}\n</think>\n\nIt is sunny in Nice.")
    question = " ".join(f"line {i} of a long note about Nice and its weather" for i in range(12))
    history = [{"role": "user", "content": question}]
    first = ask(client, history, tools=None, max_tokens=400)
    msg = first.choices[0].message
    assert msg.content == "It is sunny in Nice." and first.usage.completion_tokens > HEAP.slack
    assert first.usage.prompt_tokens > HEAP.budget + HEAP.slack
    force("Yes.")
    history += [{"role": "assistant", "content": msg.content, "reasoning_content": msg.reasoning_content},
                {"role": "user", "content": "Sure?"}]
    import httpx

    def rewinds():
        lines = httpx.get(server.url + "/metrics", timeout=60).text.splitlines()
        return float(next(x for x in lines if x.startswith("localheap_session_rewinds_total ")).split()[1])

    before = rewinds()
    second = ask(client, history, tools=None)
    assert second.localheap["session_id"] == first.localheap["session_id"]
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert rewinds() == before + 1


def test_a_stop_then_a_delete_before_the_next_step_ends_the_reply_deleted_and_saves_nothing(
        model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    """The web UI's Stop, then the conversation deleted, both between two engine steps: the delete wins (its
    reply says "deleted" and no heap is written for a session that is gone), as a delete alone."""
    import threading
    import time

    import httpx

    with serve(qwen_model(model_dirs, tmp_path_factory), sessions_dir=tmp_path, persist_sessions=True) as srv:
        svc, engine = srv.services, srv.services.engine
        ids = svc.tokenizer.encode("word " * 3000, add_special_tokens=False)
        svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
        sid = httpx.post(srv.url + "/v1/sessions", json={}, timeout=60).json()["id"]
        lines = []

        def chat():
            body = {"model": svc.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                    "stream": True}
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid},
                              timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: {"))

        t = threading.Thread(target=chat)
        t.start()
        writes = []
        real_write = svc.store.write_heap
        svc.store.write_heap = lambda s: (writes.append(s.id), real_write(s))[1]
        deadline = time.monotonic() + 60
        while not engine.call(lambda: any(len(r.completion) > 10 for r in engine._active)).result(10):
            assert time.monotonic() < deadline
        engine.call(lambda: (engine.stop_session(sid), engine.delete_session(sid))).result(30)
        t.join(60)
        last = json.loads(lines[-1][6:])["localheap"]
        assert sid not in svc.store and last.get("interrupted") == "deleted" and "saved" not in last and not writes


@pytest.mark.parametrize("family", ["llama", "phi4_mini"])
def test_a_named_sessions_new_messages_with_tools_add_no_second_tool_list(model_dirs, tmp_path_factory, family):
    """A template that cannot render tools has them written into the system message (the first turn's);
    the continuation a named session's new messages get, sent with `tools` again, opens no second system
    message with the list mid-conversation: the session holds what the whole history renders."""
    from transformers import AutoTokenizer

    from localheap.models import resolve_model
    from localheap.server.prompts import ChatOptions, chat_prompt
    from localheap.server.schemas import ChatMessage
    from localheap.server.toolformats import tool_format

    if family == "llama":
        tok = AutoTokenizer.from_pretrained(str(resolve_model("random:llama:tiny")[0]))
    else:
        tok = AutoTokenizer.from_pretrained(str(phi4_mini_model(model_dirs, tmp_path_factory.mktemp("phi4") / "m")))
    from localheap.heap import HeapConfig
    from localheap.sessions import Session
    from localheap.sessions.match import continue_session
    from localheap.sessions.session import token_array

    opts = ChatOptions(TOOLS, tool_format(tok))
    assert opts.prompted
    one, reply, two = (ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hello."),
                       ChatMessage(role="user", content="Weather in Paris?"))
    encode = lambda text: tok.encode(text, add_special_tokens=False)   # noqa: E731

    def next_turn(first_opts):
        """The session after turn one (its reply's end of turn never read), then turn two sent alone."""
        s = Session(id="sess_x", cfg=HeapConfig())
        s.fed = token_array(list(chat_prompt(tok, [one], opts=first_opts).tokens) + encode("Hello."))
        s.ends_in_reply = True
        m = continue_session(s, chat_prompt(tok, [two], opts=opts), encode, tok.decode)
        return tok.decode(list(s.fed) + list(m.new_tokens))

    whole = tok.decode(list(chat_prompt(tok, [one, reply, two], opts=opts).tokens))
    assert next_turn(opts) == whole   # tools from the first turn on: held, not written again
    later = next_turn(None)            # tools sent first now: written into the new turn, as before
    assert later.count(opts.fmt.listing(TOOLS)) == 1 and later.startswith(tok.decode(list(
        chat_prompt(tok, [one]).tokens)) + "Hello."), later
