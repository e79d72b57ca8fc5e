"""gpt-oss's harmony format: replies read by channel (analysis -> reasoning, final -> content, a
message to functions.NAME -> a tool call), its grammars, and the whole loop through the server on
a tiny gpt_oss model carrying a template written from harmony's documented syntax."""

from __future__ import annotations

import json

import pytest

from family_templates import harmony_model
from localheap.server.harmony import HarmonyParser
from localheap.server.toolcalls import CallArgs, CallStart, Text
from localheap.server.toolformats import Harmony, ToolCall

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from localheap.grammar import ForcedTokens  # noqa: E402
from localheap.heap import HeapConfig  # noqa: E402
from tool_server import CITY, serve  # noqa: E402

THINK = "<|channel|>analysis<|message|>The user wants Nice's weather.<|end|>"
CALL_AFTER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
CALL_BEFORE = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
ARGS = '{"city": "Nice"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 20C in Nice."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


def parse(text: str, step: int = 0, **kw) -> list:
    """The pieces of `text`, fed whole (step 0) or `step` characters at a time, merged."""
    p = HarmonyParser(**kw)
    chunks = [text] if not step else [text[i:i + step] for i in range(0, len(text), step)]
    out = [x for c in chunks for x in p.feed(c)] + p.finish()
    merged = []
    for x in out:
        if merged and isinstance(x, Text) and isinstance(merged[-1], Text) and merged[-1].kind == x.kind:
            merged[-1] = Text(x.kind, merged[-1].text + x.text)
        elif merged and isinstance(x, CallArgs) and isinstance(merged[-1], CallArgs):
            merged[-1] = CallArgs(merged[-1].text + x.text)
        else:
            merged.append(x)
    return merged


@pytest.mark.parametrize("step", [0, 1, 3])
def test_reasoning_and_answer_by_channel(step):
    assert parse(THINK + FINAL, step) == [Text("reasoning", "The user wants Nice's weather."),
                                          Text("content", "It is 20C in Nice.")]


@pytest.mark.parametrize("step", [0, 1, 5])
@pytest.mark.parametrize("header", [CALL_AFTER, CALL_BEFORE])
def test_a_call_addressed_to_a_function_before_or_after_its_channel(step, header):
    out = parse(THINK + header + ARGS, step)
    assert out[0] == Text("reasoning", "The user wants Nice's weather.")
    start, args, call = out[1:]
    assert isinstance(start, CallStart) and start.name == "get_weather"
    assert args == CallArgs(ARGS)
    assert isinstance(call, ToolCall) and (call.id, call.name, call.arguments, call.error) == \
        (start.id, "get_weather", ARGS, None) and call.streamed


def test_arguments_that_are_not_json_come_back_flagged():
    (_, _, call) = parse(CALL_AFTER + '{"city": Nice}<|call|>')
    assert call.arguments == '{"city": Nice}' and "not valid JSON" in call.error


def test_a_preamble_on_commentary_is_content_and_calls_without_tools_are_too():
    out = parse("<|channel|>commentary<|message|>Checking.<|end|>" + CALL_AFTER + ARGS)
    assert out[0] == Text("content", "Checking.") and isinstance(out[-1], ToolCall)
    assert parse(CALL_AFTER + ARGS, tools=False) == [Text("content", ARGS)]


def test_the_format_parses_a_call_from_its_opener_on_as_the_other_formats_do():
    (call,) = Harmony().parse("get_weather <|constrain|>json<|message|>" + ARGS)
    assert (call.name, call.arguments, call.error) == ("get_weather", ARGS, None)
    assert Harmony().parse("nothing") is None


def test_a_builtin_tool_no_client_offers_is_read_by_its_channel():
    out = parse("<|channel|>analysis to=python code<|message|>print(1)<|end|>" + FINAL)
    assert out == [Text("reasoning", "print(1)"), Text("content", "It is 20C in Nice.")]


def test_text_that_is_no_message_is_content_without_markup():
    assert parse("Hello there") == [Text("content", "Hello there")]
    assert parse("<|start|>assistant") == [Text("content", "assistant")]
    long = "word " * 80   # no <|message|> in sight: not a header
    assert parse(long, 7) == [Text("content", long)]


def test_forced_replies_drop_text_outside_messages():
    out = parse("junk" + CALL_AFTER + ARGS, forced=True)
    assert [type(x) for x in out] == [CallStart, CallArgs, ToolCall]


def test_the_template_is_recognised_as_harmony(model_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    from localheap.server.toolformats import tool_format

    path = harmony_model(model_dirs, tmp_path_factory.mktemp("harmony") / "m")
    assert isinstance(tool_format(AutoTokenizer.from_pretrained(path)), Harmony)


def test_a_custom_tools_recursive_lark_format_holds_a_harmony_call(model_dirs, tmp_path_factory):
    """A custom tool held to a Lark grammar with recursion (LarkInput): a forced harmony call's
    `{"input": ...}` takes what the grammar takes, JSON-escaped, and nothing else."""
    pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    from localheap.grammar import Grammar
    from localheap.larkformat import LarkInput
    from localheap.server.chat import call_grammar
    from localheap.server.responses import CUSTOM_PARAMETERS

    tok = AutoTokenizer.from_pretrained(harmony_model(model_dirs, tmp_path_factory.mktemp("harmony-lark") / "m"))
    tools = [{"type": "function", "function": {"name": "calc", "parameters": CUSTOM_PARAMETERS}}]
    held = {"calc": LarkInput(CUSTOM_PARAMETERS, 'start: "(" start ")" | "\\"x\\"" | LF start\n%import common.LF')}
    grammar = call_grammar(Harmony(), tools, "required", False, tok, held)

    def takes(text: str) -> bool:
        g = Grammar(tok, {tok.eos_token_id}, grammar)
        call = ('<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{"input": %s}<|call|>'
                % json.dumps(text))
        for t in tok.encode(call, add_special_tokens=False):
            if not g.allowed()[t]:
                return False
            g.advance(t)
        return g.matcher.is_accepting()

    assert takes('(("x"))') and takes('(\n"x")')
    assert not takes('(("x")') and not takes("((x))")


# --- through the server -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory, torch_one_thread):
    with serve(harmony_model(model_dirs, tmp_path_factory.mktemp("harmony-srv") / "m"),
               HeapConfig(budget=1024)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, messages, **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, **kw)


def forced(server, text):
    svc = server.services
    ids = svc.tokenizer.encode(text, add_special_tokens=False)
    svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)


@pytest.fixture
def reset(server):
    yield
    svc = server.services
    svc.force_tokens = svc.lead_tokens = None
    svc.settings.tool_grammar = True


def test_reasoning_and_content_whole_and_streamed(server, client, reset):
    forced(server, THINK + FINAL)
    msg = ask(client, [{"role": "user", "content": "Nice?"}]).choices[0].message
    assert msg.content == "It is 20C in Nice." and msg.reasoning_content == "The user wants Nice's weather."
    parts = {"content": "", "reasoning_content": ""}
    for chunk in ask(client, [{"role": "user", "content": "Nice?"}], stream=True):
        for key in parts:
            parts[key] += getattr(chunk.choices[0].delta, key, None) or "" if chunk.choices else ""
    assert parts == {"content": "It is 20C in Nice.", "reasoning_content": "The user wants Nice's weather."}


def test_a_call_and_its_result_round_trip_on_one_session(server, client, reset):
    forced(server, THINK + CALL_AFTER + ARGS)
    history = [{"role": "user", "content": "Weather in Nice?"}]
    first = ask(client, history, tools=TOOLS)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Nice"}
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "The user wants Nice's weather."
    assert "<|message|>" not in (choice.message.reasoning_content or "")
    forced(server, FINAL.replace("<|start|>assistant", ""))
    history += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "20C"}]
    second = ask(client, history, tools=TOOLS)
    assert second.choices[0].message.content == "It is 20C in Nice."
    assert second.localheap["session_id"] == first.localheap["session_id"]
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def _calls(client, **kw):
    r = ask(client, [{"role": "user", "content": "any city"}], tools=TOOLS, temperature=1.0, max_tokens=60, **kw)
    return r.choices[0].message.tool_calls or [], (getattr(r, "localheap", None) or {}).get("tool_call_errors", [])


def _valid(call) -> bool:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, CITY)
        return True
    return call.function.name == "get_time" and args == {}


def test_a_call_the_reply_opens_is_held_to_the_tools(server, client, reset):
    """tool_choice auto: once the random model has addressed a message to functions., the grammar
    holds the name, the rest of the header and the arguments; with the grammar off, the same
    openings give no valid call (the test can fail)."""
    svc = server.services
    for seed, opening in enumerate(["<|channel|>commentary to=functions.", " to=functions.",
                                    "<|channel|>analysis<|message|>ok<|end|><|start|>assistant to=functions.",
                                    "<|channel|>commentary to=functions."]):
        svc.lead_tokens = svc.tokenizer.encode(opening, add_special_tokens=False)
        calls, errors = _calls(client, seed=seed)
        assert len(calls) == 1 and not errors and _valid(calls[0]), (opening, calls, errors)
    svc.lead_tokens = svc.tokenizer.encode("<|channel|>commentary to=functions.", add_special_tokens=False)
    svc.settings.tool_grammar = False
    for seed in range(4):
        calls, errors = _calls(client, seed=seed)
        assert not calls or errors or calls[0].function.name not in ("get_weather", "get_time"), calls


def test_a_recipient_named_in_prose_holds_nothing(server, client, reset):
    """`to=functions.` inside the reasoning is not a header: the reply samples exactly as without
    the grammar (the same seeds, the same text)."""
    svc = server.services
    svc.lead_tokens = svc.tokenizer.encode("<|channel|>analysis<|message|>I would send to=functions.get_weather",
                                          add_special_tokens=False)

    def replies():
        out = []
        for seed in range(3):
            r = ask(client, [{"role": "user", "content": "any city"}], tools=TOOLS, temperature=1.0, seed=seed,
                    max_tokens=30)
            out.append((r.choices[0].message.reasoning_content, r.choices[0].message.content))
        return out

    held = replies()
    svc.settings.tool_grammar = False
    assert replies() == held


def test_a_forced_choice_is_one_valid_call_after_any_reasoning(server, client, reset):
    svc = server.services
    svc.lead_tokens = svc.tokenizer.encode("<|channel|>analysis<|message|>Pick one.<|end|><|start|>assistant",
                                          add_special_tokens=False)
    for seed in range(3):
        calls, errors = _calls(client, seed=seed, tool_choice="required")
        assert len(calls) == 1 and not errors and _valid(calls[0]), (calls, errors)
    calls, errors = _calls(client, seed=0, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in calls] == ["get_time"] and not errors


def test_a_json_answer_is_the_final_messages_body(server, client, reset):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    svc = server.services
    svc.lead_tokens = svc.tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)
    for seed in range(2):
        r = ask(client, [{"role": "user", "content": "ok?"}], temperature=1.0, seed=seed, max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_reasoning_effort_reaches_the_template(model_dirs, tmp_path_factory):
    """OpenAI's reasoning_effort (chat), reasoning.effort (Responses) and Ollama's think levels become
    the template's reasoning_effort, which gpt-oss's writes into its system message."""
    from transformers import AutoTokenizer

    from localheap.server.ollama import ChatRequest as OllamaChat
    from localheap.server.prompts import ChatOptions, chat_prompt, with_effort
    from localheap.server.routes.openai import _plan
    from localheap.server.schemas import ChatCompletionRequest, ChatMessage

    tok = AutoTokenizer.from_pretrained(harmony_model(model_dirs, tmp_path_factory.mktemp("harmony-effort") / "m"))
    msgs = [ChatMessage(role="user", content="hi")]

    def rendered(kwargs):
        return chat_prompt(tok, msgs, opts=ChatOptions(template_kwargs=kwargs or {})).text

    assert "Reasoning: medium" in rendered(None)
    plan = _plan(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"))
    assert "Reasoning: high" in rendered(plan.template_kwargs)
    assert "Reasoning: low" in rendered(with_effort(None, "minimal"))
    assert with_effort({"reasoning_effort": "high"}, "low") == {"reasoning_effort": "high"}   # the kwargs win
    assert with_effort(None, "none") is None
    think = OllamaChat(model="m", messages=[{"role": "user", "content": "hi"}], think="low")
    assert "Reasoning: low" in rendered(think.template_kwargs())


def test_the_anthropic_and_responses_routes_read_harmony_too(server, reset):
    import httpx

    forced(server, THINK + CALL_AFTER + ARGS)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
    r = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 80, "tools": tools,
                                                      "messages": [{"role": "user", "content": "Nice?"}]}).json()
    assert [b["type"] for b in r["content"]] == ["thinking", "tool_use"], r
    assert r["content"][1]["input"] == {"city": "Nice"} and r["stop_reason"] == "tool_use"
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", "max_output_tokens": 80, "input": "Nice?",
                                                       "tools": [{"type": "function", **TOOLS[0]["function"]}]}).json()
    kinds = [item["type"] for item in r["output"]]
    assert kinds == ["reasoning", "function_call"], r
    assert json.loads(r["output"][1]["arguments"]) == {"city": "Nice"}
