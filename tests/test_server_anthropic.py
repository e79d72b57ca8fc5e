"""The Anthropic Messages API through the real server (a tiny torch model carrying a Qwen-style
template) driven by the official `anthropic` SDK, unmodified: messages, streaming with Anthropic's
event types, tool use and results, thinking blocks, stop sequences, count_tokens, x-api-key, and
the same sessions (prefix reuse) as the OpenAI routes. Tool calls are forced tokens (the server's
test-only hook); template, parser, stream and session run for real."""

from __future__ import annotations

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from tool_server import CALL, qwen_model, serve  # noqa: E402

KEY = "sk-test-key"
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory, torch_one_thread):
    with serve(qwen_model(model_dirs, tmp_path_factory), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def model(server):
    return server.services.model_id


def test_a_message_and_a_multi_turn_conversation(client, server, force):
    force("Hello from the heap.")
    r = client.messages.create(model=model(server), max_tokens=40, system="Be brief.",
                               messages=[{"role": "user", "content": "hi"}])
    assert r.type == "message" and r.role == "assistant" and r.stop_reason == "end_turn"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Hello from the heap."
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.usage.cache_read_input_tokens == 0
    force("Again.")
    r2 = client.messages.create(model=model(server), max_tokens=40, system="Be brief.", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": r.content[0].text},
        {"role": "user", "content": [{"type": "text", "text": "once more"}]}])
    assert r2.content[0].text == "Again."
    assert r2.usage.cache_read_input_tokens >= r.usage.input_tokens   # the session was found again
    assert r2.model_extra["localheap"]["session_id"] == r.model_extra["localheap"]["session_id"]


def test_tool_use_then_tool_result(client, server, force):
    force(CALL)
    history = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.messages.create(model=model(server), max_tokens=80, tools=TOOLS, messages=history)
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    force("Sunny, 18C.")
    history += [{"role": "assistant", "content": r.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C sunny"}]}]
    r2 = client.messages.create(model=model(server), max_tokens=80, tools=TOOLS, messages=history)
    assert r2.stop_reason == "end_turn" and r2.content[0].text == "Sunny, 18C."
    assert r2.usage.cache_read_input_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1
    # the blocks as the SDK dumps them (its optional fields as None: caller, toolset_name) are taken too
    history[1] = {"role": "assistant", "content": [b.model_dump() for b in r.content]}
    history[2]["content"][0]["toolset_name"] = None
    force("Sunny, 18C.")
    r3 = client.messages.create(model=model(server), max_tokens=80, tools=TOOLS, messages=history)
    assert r3.content[0].text == "Sunny, 18C." and r3.usage.cache_read_input_tokens >= r2.usage.cache_read_input_tokens


def test_streaming_events_thinking_and_tool_use(client, server, force):
    force("<think>\nneed the tool\n</think>\n\nChecking." + CALL)
    with client.messages.stream(model=model(server), max_tokens=120, tools=TOOLS,
                                thinking={"type": "enabled", "budget_tokens": 1024},
                                messages=[{"role": "user", "content": "Paris?"}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "\nneed the tool\n" and final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_the_raw_event_sequence(server, force):
    force("Hi there.")
    body = {"model": model(server), "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas + \
        ["content_block_stop", "message_delta", "message_stop"] and deltas >= 1


def test_stop_sequences_say_which_one(client, server, force):
    force("one two STOP three END four")
    r = client.messages.create(model=model(server), max_tokens=40, stop_sequences=["END", "STOP"],
                               messages=[{"role": "user", "content": "count"}])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP" and r.content[0].text == "one two "
    # only the reply's text is searched: not its thinking, nor a tool call's markup or JSON
    force("<think>\nsay STOP\n</think>\n\nok" + CALL)
    r = client.messages.create(model=model(server), max_tokens=80, stop_sequences=["STOP", "name", "\n"], tools=TOOLS,
                               messages=[{"role": "user", "content": "count"}])
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"] and r.content[2].input == {"city": "Paris"}
    assert r.content[0].thinking == "\nsay STOP\n" and r.stop_reason == "tool_use" and r.stop_sequence is None
    force("<think>\nhm\n</think>\n\nthe answer STOP more")
    with client.messages.stream(model=model(server), max_tokens=40, stop_sequences=["STOP"],
                                messages=[{"role": "user", "content": "count"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "the answer "
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP"
    force("a b c d e f g h")
    r = client.messages.create(model=model(server), max_tokens=3, messages=[{"role": "user", "content": "count"}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_a_prefill_is_continued(client, server, force):
    """A conversation that ends with the assistant's text: the reply goes on from it (no end of
    turn, no new assistant turn between), and returns only what it added; trailing whitespace is a
    400, as on Anthropic's API."""
    force(" one two")
    history = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "Sure:"}]
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": model(server), "max_tokens": 20, "messages": history}).json()
    assert r["content"] == [{"type": "text", "text": " one two"}] and r["stop_reason"] == "end_turn", r
    fed = server.services.tokenizer.decode(list(server.services.store.get(r["localheap"]["session_id"]).fed))
    assert fed.endswith("Sure: one two") and fed.count("<|assistant|>") == 1, fed
    counted = client.messages.count_tokens(model=model(server), messages=history).input_tokens
    assert counted == r["usage"]["input_tokens"] + r["usage"]["cache_read_input_tokens"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model(server), max_tokens=5, messages=[history[0], {**history[1], "content": "Sure: "}])
    assert "trailing whitespace" in e.value.message
    # a named session sent only the new messages: they follow its last reply's end once
    sid = r["localheap"]["session_id"]
    force(" three")
    more = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY, "X-Session-Id": sid},
                      json={"model": model(server), "max_tokens": 20, "messages": [
                          {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Then:"}]}).json()
    assert more["content"] == [{"type": "text", "text": " three"}], more
    fed = server.services.tokenizer.decode(list(server.services.store.get(sid).fed))
    assert fed.endswith("Then: three") and "<|end|><|end|>" not in fed and fed.count("Again") == 1, fed


def test_count_tokens_matches_the_prompt(client, server, force):
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    n = client.messages.count_tokens(model=model(server), messages=msgs, tools=TOOLS).input_tokens
    force("ok")
    r = client.messages.create(model=model(server), max_tokens=5, tools=TOOLS, messages=msgs)
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens > 0


def test_errors_in_anthropic_shape_and_keys(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model(server), max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in e.value.message and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": model(server), "max_tokens": 5, "frobnicate": 1,
                                                      "messages": [{"role": "user", "content": "x"}]},
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error" and "frobnicate" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=model(server), max_tokens=5, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    # the same key works as a bearer key on the OpenAI routes
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert oa.models.list().data[0].id == model(server)
    # a right x-api-key beside another Authorization header (a client's own proxy's) is taken; two wrong ones are not
    body = {"model": model(server), "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for headers, status in (({"x-api-key": KEY, "authorization": "Bearer other"}, 200),
                            ({"x-api-key": "wrong", "authorization": f"Bearer {KEY}"}, 200),
                            ({"x-api-key": "wrong", "authorization": "Bearer other"}, 401)):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers).status_code == status, headers
    with pytest.raises(anthropic.BadRequestError) as e:   # two tools of one name: which would a call be?
        client.messages.create(model=model(server), max_tokens=5, messages=[{"role": "user", "content": "x"}],
                               tools=TOOLS + TOOLS)
    assert "two tools are named 'get_weather'" in e.value.message


def test_claude_codes_request_shape_is_taken(server, force):
    """What Claude Code sends besides the basics (each a 400 on a strict server, per its users'
    reports and a run of Claude Code 2.1.197 against this server): context_management, tools with
    defer_loading / input_examples / strict / cache_control, cache_control on system, text and
    thinking blocks, a system message among the messages (rendered where it stands),
    metadata.user_id, thinking enabled. The reply is as without them; no context edit is applied."""
    force("Done.")
    tools = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}, "defer_loading": False, "strict": True,
              "input_examples": [{"city": "Paris"}], "eager_input_streaming": True}]
    body = {"model": model(server), "max_tokens": 40, "stream": False, "metadata": {"user_id": "user_abc"},
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "tools": tools, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919",
                                              "trigger": {"type": "input_tokens", "value": 100000}}]},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "say hello", "signature": "",
                              "cache_control": {"type": "ephemeral"}},
                             {"type": "text", "text": "Hello."}]},
                         {"role": "system", "content": "Available agent types: claude."},   # (Claude Code 2.1.197)
                         {"role": "user", "content": "again"}]}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["content"][-1]["text"] == "Done."
    from localheap.server.anthropic import MessagesRequest

    roles = [m.role for m in MessagesRequest.model_validate(body).chat_messages()]
    assert roles == ["system", "user", "assistant", "system", "user"]
    force("Done.")
    count = httpx.post(server.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=60,
                       json={k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")})
    assert count.status_code == 200 and count.json()["input_tokens"] > 0


def test_both_apis_share_sessions(client, server, force):
    """A conversation begun on the OpenAI route continues on the Anthropic one: same session."""
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    force("First answer.")
    first = oa.chat.completions.create(model=model(server), max_tokens=20,
                                       messages=[{"role": "user", "content": "Shared history here."}])
    force("Second answer.")
    r = client.messages.create(model=model(server), max_tokens=20, messages=[
        {"role": "user", "content": "Shared history here."}, {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "and now?"}])
    assert r.model_extra["localheap"]["session_id"] == first.localheap["session_id"]
    assert r.usage.cache_read_input_tokens >= first.usage.prompt_tokens


def test_a_forced_tool_choice_is_enforced(client, server):
    """No forced tokens: tool_choice {"type": "tool"} holds the random model to a valid call."""
    tools = [{"name": "pick", "input_schema": {"type": "object", "additionalProperties": False, "required": ["n"],
                                               "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}}}]
    r = client.messages.create(model=model(server), max_tokens=60, tools=tools,
                               tool_choice={"type": "tool", "name": "pick"}, messages=[{"role": "user", "content": "?"}])
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "pick" and 1 <= use.input["n"] <= 9 and r.stop_reason == "tool_use"


def test_output_config_json_schema_is_enforced(client, server):
    jsonschema = pytest.importorskip("jsonschema")
    import json

    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    r = client.messages.create(model=model(server), max_tokens=60, messages=[{"role": "user", "content": "?"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_text_documents_and_search_results_are_read_as_text(client, server):
    """A plain-text document (a `text` or `content` source) and a search result reach the prompt as
    their title, context or source, then their text, set off by a blank line; a PDF document and
    Anthropic's own tool types are refused by name."""
    def count(content):
        return client.messages.count_tokens(model=model(server), messages=[{"role": "user", "content": content}]).input_tokens

    doc = {"type": "document", "title": "Notes", "context": "from the desk",
           "source": {"type": "text", "media_type": "text/plain", "data": "The code is 4417."}}
    ask = {"type": "text", "text": "What is the code?"}
    as_text = count("Notes\nfrom the desk\nThe code is 4417.\n\nWhat is the code?")
    assert count([doc, ask]) == as_text
    parts = {**doc, "source": {"type": "content", "content": [{"type": "text", "text": "The code "},
                                                              {"type": "text", "text": "is 4417."}]}}
    assert count([parts, ask]) == as_text
    found = {"type": "search_result", "source": "https://example.com/a", "title": "A page",
             "content": [{"type": "text", "text": "The code is 4417."}]}
    assert count([found, ask]) == count("A page\nhttps://example.com/a\nThe code is 4417.\n\nWhat is the code?")
    assert count([doc, ask]) != count([ask])
    # inside a tool's result too (where search results are mostly sent), as there; an image by name

    def result(content):
        return [{"role": "user", "content": "?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}]

    def counted(messages):
        return client.messages.count_tokens(model=model(server), tools=TOOLS, messages=messages).input_tokens

    assert counted(result([found, ask])) == counted(result("A page\nhttps://example.com/a\nThe code is 4417.\n\n"
                                                             "What is the code?"))
    assert counted(result([doc])) == counted(result("Notes\nfrom the desk\nThe code is 4417."))
    with pytest.raises(anthropic.BadRequestError) as e:
        counted(result([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]))
    assert "image content blocks are not supported" in e.value.message and "messages.2.content.0.content" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        count([{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AAAA"}}])
    assert "'base64' source" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model(server), max_tokens=5, messages=[{"role": "user", "content": "x"}],
                               tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}])
    assert "'web_search_20250305'" in e.value.message and "custom tools" in e.value.message
