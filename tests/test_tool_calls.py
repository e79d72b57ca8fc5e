"""Tool calls and reasoning, below the server: each family's format recognised from its template,
tools and past calls rendered through it, and replies parsed from real tokenizer output
(the tiny models' byte-level BPE, detokenized as the engine does) streamed in pieces of every size."""

from __future__ import annotations

import json

import pytest

from family_templates import TEMPLATES, glm4_model, phi4_mini_model, with_template
from localheap.engine.detok import TextStream
from localheap.grammar import IfLast
from localheap.server.errors import BadRequest
from localheap.server.formats import InputStream
from localheap.server.prompts import ChatOptions, chat_prompt
from localheap.server.prompts import _messages as template_messages
from localheap.server.schemas import ChatMessage
from localheap.server.toolcalls import CallArgs, CallStart, OutputParser, Text
from localheap.server.toolformats import (GLM, GLM4, Hermes, Llama, Mistral, Phi4Mini, Prompted, QwenXML, ToolCall,
                                          tool_format)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tokenizers(model_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    base = model_dirs("llama")
    root = tmp_path_factory.mktemp("families")
    toks = {name: AutoTokenizer.from_pretrained(with_template(base, root / name, t)) for name, t in TEMPLATES.items()}
    toks["plain"] = AutoTokenizer.from_pretrained(base)
    toks["phi4-mini"] = AutoTokenizer.from_pretrained(phi4_mini_model(model_dirs, root / "phi4-mini"))
    toks["glm-4"] = AutoTokenizer.from_pretrained(glm4_model(model_dirs, root / "glm-4"))
    return toks


FORMATS = {"qwen": Hermes, "qwen3-coder": QwenXML, "glm-4.5": GLM, "mistral": Mistral, "llama3.1": Llama,
           "phi4-mini": Phi4Mini, "glm-4": GLM4, "plain": Prompted}
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
GLM_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
PHI_CALL = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>'


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_the_format_is_recognised_from_the_template(tokenizers, family):
    assert type(tool_format(tokenizers[family])) is FORMATS[family]
    assert type(tool_format(tokenizers[family], "mistral")) is Mistral   # serve --tool-format


def _history(call_id: str) -> list[ChatMessage]:
    return [ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="Weather in Paris?"),
            ChatMessage(role="assistant", content=None, tool_calls=[
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
            ChatMessage(role="tool", tool_call_id=call_id, content="18C, sunny"),
            ChatMessage(role="user", content="And tomorrow?")]


@pytest.mark.parametrize("family,call_text,result_text", [
    ("qwen", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "<tool_response>\n18C, sunny\n</tool_response>"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]',
     '[TOOL_RESULTS]{"content": "18C, sunny", "call_id": "abcDEF123"}[/TOOL_RESULTS]'),
    ("llama3.1", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|ipython|>\n18C, sunny"),
    ("qwen3-coder", XML_CALL, "<tool_response>\n18C, sunny\n</tool_response>"),
    ("glm-4.5", GLM_CALL, "<|observation|>\n<tool_response>\n18C, sunny\n</tool_response>"),
    ("plain", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "<tool_response>\n18C, sunny\n</tool_response>"),
    ("phi4-mini", "<|assistant|>" + PHI_CALL + "<|end|>", "<|tool|>18C, sunny<|end|><|user|>And tomorrow?"),
    ("glm-4", '<|user|>\nWeather in Paris?<|assistant|>get_weather \n{"city": "Paris"}<|observation|>',
     "<|observation|>\n18C, sunny<|user|>\nAnd tomorrow?<|assistant|>"),
])
def test_tools_calls_and_results_go_through_the_template(tokenizers, family, call_text, result_text):
    tok = tokenizers[family]
    opts = ChatOptions(TOOLS, tool_format(tok))
    prompt = chat_prompt(tok, _history("abcDEF123"), opts=opts)
    assert call_text in prompt.text and result_text in prompt.text
    assert "Weather in a city" in prompt.text   # the tools are described
    assert tok.decode(prompt.tokens, skip_special_tokens=False).endswith(prompt.text[-20:])


def test_a_mistral_template_refuses_other_ids_and_template_kwargs_are_checked(tokenizers):
    with pytest.raises(BadRequest, match="length 9"):
        chat_prompt(tokenizers["mistral"], _history("call_0123456789"), opts=ChatOptions(TOOLS, Mistral()))
    with pytest.raises(BadRequest, match="chat_template_kwargs"):
        ChatOptions(template_kwargs={"tokenize": True})


def test_enable_thinking_and_past_reasoning_reach_the_template(tokenizers):
    tok = tokenizers["qwen"]
    msgs = [ChatMessage(role="user", content="hi"),
            ChatMessage(role="assistant", content="hello", reasoning_content="they greet me"),
            ChatMessage(role="user", content="again")]
    on = chat_prompt(tok, msgs, opts=ChatOptions())
    off = chat_prompt(tok, msgs, opts=ChatOptions(template_kwargs={"enable_thinking": False}))
    assert off.text == on.text + "<think>\n\n</think>\n\n"
    assert "they greet me" not in on.text   # the template drops reasoning before the last question
    last = chat_prompt(tok, msgs[:2], add_generation_prompt=False, opts=ChatOptions())
    assert "<think>\nthey greet me\n</think>" in last.text


def _deltas(tok, text: str) -> list[str]:
    """`text` as the engine streams it: tokenized by the real tokenizer, detokenized id by id."""
    stream, out = TextStream(lambda ids: tok.decode(ids, skip_special_tokens=False), []), []
    for t in tok.encode(text, add_special_tokens=False):
        out.append(stream.add(t)[0])
    out.append(stream.flush()[0])
    assert "".join(out) == text
    return out


def _parse_in_pieces(fmt, text: str, size: int, **kw) -> list:
    parser, pieces = OutputParser(fmt, **kw), []
    for i in range(0, len(text), size):
        pieces += parser.feed(text[i:i + size])
    pieces += parser.finish()
    merged: list = []
    started = None
    for p in pieces:   # a stream may split a text run in several deltas: the same reply either way
        if isinstance(p, CallStart):   # a call streamed as it is written: the same call in the end
            assert started is None
            started = [p, ""]
        elif isinstance(p, CallArgs):
            started[1] += p.text
        elif isinstance(p, ToolCall) and p.streamed:
            assert (started[0].id, started[0].name, started[1]) == (p.id, p.name, p.arguments)
            started = None
        if isinstance(p, (CallStart, CallArgs)):
            continue
        if isinstance(p, Text) and merged and isinstance(merged[-1], Text) and merged[-1].kind == p.kind:
            merged[-1] = Text(p.kind, merged[-1].text + p.text)
        else:
            merged.append(p)
    return [(p.kind, p.text) if isinstance(p, Text) else (p.name, json.loads(p.arguments) if not p.error else
                                                          p.arguments, bool(p.error)) for p in merged]


REPLIES = {
    "qwen": ('<think>\nThe user wants weather.\n</think>\n\nLet me check. <tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Lyon"}}\n</tool_call>',
             [("reasoning", "\nThe user wants weather.\n"), ("content", "Let me check. "),
              ("get_weather", {"city": "Paris"}, False), ("get_weather", {"city": "Lyon"}, False)]),
    "qwen3-coder": ("Let me check.\n" + XML_CALL + "\n" + XML_CALL.replace("Paris", "Lyon\nand Nice"),
                    [("content", "Let me check.\n"), ("get_weather", {"city": "Paris"}, False),
                     ("get_weather", {"city": "Lyon\nand Nice"}, False)]),
    "glm-4.5": ("\n<think>weather needs a call</think>\nLet me check.\n" + GLM_CALL + "\n"
                + GLM_CALL.replace("Paris", "Lyon\nand Nice"),
                [("reasoning", "weather needs a call"), ("content", "Let me check.\n"),
                 ("get_weather", {"city": "Paris"}, False), ("get_weather", {"city": "Lyon\nand Nice"}, False)]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", '
                '"arguments": {"city": "Lyon"}}]',
                [("get_weather", {"city": "Paris"}, False), ("get_weather", {"city": "Lyon"}, False)]),
    "llama3.1": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                 '{"name": "get_weather", "parameters": {"city": "Lyon"}}',
                 [("get_weather", {"city": "Paris"}, False), ("get_weather", {"city": "Lyon"}, False)]),
    "plain": ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
              [("content", "Sure.\n"), ("get_weather", "{\"city\": Paris}", True)]),
    "phi4-mini": ('Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                  '{"name": "get_weather", "arguments": {"city": "Lyon"}}]',   # no <|/tool_call|>: often so
                  [("content", "Let me check."), ("get_weather", {"city": "Paris"}, False),
                   ("get_weather", {"city": "Lyon"}, False)]),
}


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_replies_parse_the_same_in_pieces_of_every_size(tokenizers, family):
    tok = tokenizers[family]
    text, want = REPLIES[family]
    deltas = _deltas(tok, text)
    fmt = tool_format(tok)
    parser, streamed = OutputParser(fmt), []
    for d in deltas:   # as the engine's deltas arrive
        streamed += parser.feed(d)
    streamed += parser.finish()
    assert [p.name for p in streamed if isinstance(p, ToolCall)] == [w[0] for w in want if len(w) == 3]
    for size in range(1, len(text) + 1):
        assert _parse_in_pieces(fmt, text, size) == want, size


CUT = {   # a reply held to calls (tool_choice "required"), cut by max_tokens: (text, the pieces it gives)
    "qwen": [('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_',
              [("get_weather", {"city": "Paris"}, False)]),   # a second call's marker, not yet whole
             ('<tool_call>\n{"na', []),                        # a call before its name
             ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
              [("get_weather", '{"city": "Pa', True)])],       # its name known: the call as written, flagged
    "mistral": [('[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', [("get_weather", '{"ci', True)]),
                ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"na',   # the whole call kept
                 [("get_weather", {"city": "Paris"}, False)]),
                ('[TOOL_CALLS][{"na', []), ('[TOOL_CA', [])],
    "glm-4.5": [("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa",   # a string: as far as written
                 [("get_weather", '{"city": "Pa"}', True)]),
                ("<tool_call>get_wea", [])],
    "qwen3-coder": [("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa",
                     [("get_weather", '{"city": "Pa"}', True)]),
                    ("<tool_call>\n<func", [])],
    "phi4-mini": [('<|tool_call|>[{"name": "get_weather", "arguments": {"ci', [("get_weather", '{"ci', True)]),
                  ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", '
                   '"arguments": {"ci', [("get_weather", {"city": "Paris"}, False), ("get_weather", '{"ci', True)]),
                  ('<|tool_call|>[{"na', []), ("<|tool_", [])],
    "llama3.1": [('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"na',   # the whole call kept
                  [("get_weather", {"city": "Paris"}, False)]),
                 ('{"name": "get_weather", "parameters": {"ci', [("get_weather", '{"ci', True)]),
                 ('{"na', [])],
}


@pytest.mark.parametrize("family", sorted(CUT))
def test_a_forced_reply_cut_short_gives_no_markup_as_content(tokenizers, family):
    fmt = tool_format(tokenizers[family])
    for text, want in CUT[family]:
        for size in range(1, len(text) + 1):
            assert _parse_in_pieces(fmt, text, size, forced=True) == want, (text, size)
        unforced = _parse_in_pieces(fmt, text, len(text))   # with tool_choice auto the text stays the model's
        assert any(p[0] == "content" for p in unforced) or any(len(p) == 3 for p in unforced), unforced


@pytest.mark.parametrize("text,want", [
    ("Just text, with <b> and {braces}.", [("content", "Just text, with <b> and {braces}.")]),
    ("<tool_call>not json</tool_call> then", [("content", "<tool_call>not json</tool_call> then")]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', [("f", '{"a": 1', True)]),   # cut off by max_tokens
    ("<think>cut off", [("reasoning", "cut off")]),
    ("a <think> later is content", [("content", "a <think> later is content")]),
])
def test_text_that_is_not_a_call_stays_content(text, want):
    for size in range(1, len(text) + 1):
        assert _parse_in_pieces(Hermes(), text, size) == want


def test_llama_json_that_is_not_a_call_is_content_and_a_prompt_inside_think_is_reasoning():
    for size in (1, 3, 100):
        assert _parse_in_pieces(Llama(), '{"city": "Paris"}', size) == [("content", '{"city": "Paris"}')]
        assert _parse_in_pieces(None, "hmm</think>\n\nyes", size, in_think=True) == \
            [("reasoning", "hmm"), ("content", "yes")]
        assert _parse_in_pieces(Mistral(), "[TOOL_CALLS]f[ARGS]{\"x\": 1}", size) == [("f", {"x": 1}, False)]


WEATHER_CALLS = {
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "llama3.1": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "plain": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3-coder": XML_CALL,
    "glm-4.5": GLM_CALL,
    "phi4-mini": PHI_CALL,
    "glm-4": 'get_weather \n{"city": "Paris"}',
}


@pytest.mark.parametrize("family,text", sorted(WEATHER_CALLS.items()))
def test_a_forced_call_grammar_takes_the_family_syntax_and_nothing_else(tokenizers, family, text):
    pytest.importorskip("llguidance")
    from localheap.grammar import Grammar
    from localheap.server.chat import call_grammar

    tok = tokenizers[family]
    eos = {tok.eos_token_id}
    grammar = call_grammar(tool_format(tok), TOOLS, "get_weather", False, tok)

    def takes(text: str) -> Grammar:
        g = Grammar(tok, eos, grammar)
        for t in tok.encode(text, add_special_tokens=False):
            if not g.allowed()[t]:
                return None
            g.advance(t)
        return g

    g = takes(text)
    assert g is not None and g.error is None and set(g.allowed().nonzero()[0]) == eos   # complete: only the end
    assert takes(text.replace("get_weather", "get_time")) is None
    assert takes("Sure") is None


def _lazy(tok, family_fmt=None, tools=TOOLS, arguments=None):
    from localheap.grammar import LazyGrammar
    from localheap.server.chat import call_triggers

    return LazyGrammar(tok, {tok.eos_token_id}, call_triggers(family_fmt or tool_format(tok), tools, tok, arguments))


def _feed(g, tok, text: str) -> list:
    """Feed `text`'s tokens; per token whether it was free (no mask) or held; None where refused."""
    seen = []
    for t in tok.encode(text, add_special_tokens=False):
        mask = g.allowed()
        if mask is not None and not mask[t]:
            seen.append(None)
            return seen
        seen.append("free" if mask is None else "held")
        g.advance(t)
    return seen


@pytest.mark.parametrize("family,before,call,after", [
    ("qwen", "Let me look. ", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "\nDone."),
    ("plain", "", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "\n<tool_"),
    ("mistral", "", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
    ("llama3.1", "  ", '{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
    ("qwen3-coder", "Let me look. ", XML_CALL, "\nDone."),
    ("glm-4.5", "Let me look. ", GLM_CALL, "\nDone."),
    ("phi4-mini", "Let me look. ", PHI_CALL, "\nDone."),
])
def test_a_lazy_grammar_holds_only_the_call_the_reply_opens(tokenizers, family, before, call, after):
    """tool_choice auto: free text, then the call the reply opens is held (its trigger's tokens and
    what comes before are free, the call's body is masked), then free again; a call of a tool
    not offered, or arguments its schema refuses, are refused where they diverge."""
    pytest.importorskip("llguidance")
    tok = tokenizers[family]
    g = _lazy(tok)
    seen = _feed(g, tok, before + call + after)
    assert None not in seen and g.broken is None and g.held == 1, seen
    n_before = len(tok.encode(before, add_special_tokens=False)) if before else 0
    assert set(seen[:n_before]) <= {"free"}
    assert "held" in seen
    assert g.active is None and g.allowed() is None   # the call is complete: free again
    if after:
        assert seen[-1] == "free"
    for wrong in (call.replace("get_weather", "get_time"), call.replace("city", "town")):
        seen = _feed(_lazy(tok), tok, before + wrong)
        assert seen[-1] is None, (wrong, seen)


def test_a_lazy_grammar_takes_a_trigger_across_and_inside_tokens_and_not_in_reasoning(tokenizers):
    """The opener found in the reply's bytes: split over many tokens, or ending inside one (what that
    token says past it goes to the grammar); inside <think> it opens nothing."""
    pytest.importorskip("llguidance")
    from localheap.grammar import LazyGrammar, Trigger
    from localheap.server.chat import call_triggers

    tok = tokenizers["qwen"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    g = _lazy(tok)
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) > 1   # spans tokens here
    assert None not in _feed(g, tok, "<think>\nmaybe " + call + "\n</think>\n\n") and g.held == 0
    assert None not in _feed(g, tok, call) and g.held == 1 and g.broken is None
    # the trigger ends inside a token: "<tool_ca" ends in the token "all"; the grammar takes its "ll"
    pieces = [tok.decode([t]) for t in tok.encode(call, add_special_tokens=False)]
    assert "all" in pieces
    body = call_triggers(Hermes(), TOOLS, tok)[0].grammar.replace('start: "', 'start: "ll>', 1)
    g = LazyGrammar(tok, {tok.eos_token_id}, [Trigger("<tool_ca", body)])
    seen = _feed(g, tok, call)
    assert None not in seen and g.held == 1 and g.broken is None and g.active is None
    assert seen[pieces.index("all") + 1] == "held"   # '>' already held: "ll" was fed to the grammar
    bad = LazyGrammar(tok, {tok.eos_token_id}, [Trigger("<tool_ca", body.replace('"ll>', '"xx>', 1))])
    _feed(bad, tok, call)
    assert bad.held == 1 and bad.broken and bad.active is None   # what the token said is refused: the call goes free


def test_a_lazy_grammar_for_newer_mistral_takes_name_args_json(tokenizers, tmp_path):
    """Tokenizers with an [ARGS] token write [TOOL_CALLS]name[ARGS]{...}: that is the grammar, forced or lazy."""
    pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    from localheap.grammar import Grammar
    from localheap.server.chat import call_grammar

    tokenizers["mistral"].save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    g = _lazy(tok, Mistral())
    assert None not in _feed(g, tok, "ok " + text) and g.held == 1 and g.broken is None and g.active is None
    assert _feed(_lazy(tok, Mistral()), tok, '[TOOL_CALLS][{"name"')[-1] is None
    forced = Grammar(tok, {tok.eos_token_id}, call_grammar(Mistral(), TOOLS, "required", True, tok))
    assert None not in _feed(forced, tok, text + text) and set(forced.allowed().nonzero()[0]) >= {tok.eos_token_id}


@pytest.mark.parametrize("body,want", [
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', [("get_weather", {"city": "Paris"})]),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"x": 1}}', [("f", {}), ("g", {"x": 1})]),
    ('\n[{"name": "f", "arguments": "{\\"x\\": 2}"}]\n', [("f", {"x": 2})]),
])
def test_phi4_mini_calls_read_as_its_model_writes_them(body, want):
    """A list of calls, one object alone, objects without the list's brackets, arguments as a JSON
    string; what is not a call after all (no name) is not one."""
    calls = Phi4Mini().parse(body)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want and not any(c.error for c in calls)
    assert Phi4Mini().parse('["Paris"]') is None and Phi4Mini().parse("not json") is None


def test_phi4_mini_tools_go_in_the_system_message_and_a_request_without_one_gets_one(tokenizers):
    """Its template writes only a system message's `tools` field: the tools go there (in OpenAI's
    function objects, as JSON); without a system message one is added; without tools nothing is."""
    tok = tokenizers["phi4-mini"]
    msgs = _history("c1")[1:]   # no system message
    with_tools = chat_prompt(tok, msgs, opts=ChatOptions(TOOLS, tool_format(tok))).text
    head = "<|system|>" + Phi4Mini.SYSTEM + "<|tool|>"
    assert with_tools.startswith(head) and "<|/tool|><|end|><|user|>Weather in Paris?" in with_tools
    listed = with_tools[len(head):with_tools.index("<|/tool|>")]
    assert json.loads(listed) == [TOOLS[0]["function"]]
    without = chat_prompt(tok, msgs, opts=ChatOptions(None, tool_format(tok))).text
    assert without.startswith("<|user|>Weather in Paris?") and PHI_CALL in without   # a past call still written
    assert tok.encode(PHI_CALL, add_special_tokens=False)[0] == tok.convert_tokens_to_ids("<|tool_call|>")


@pytest.mark.parametrize("text,want", [
    ('get_weather \n{"city": "Paris"}', [("get_weather", {"city": "Paris"}, False)]),
    ('get_weather\n{"city": "Paris"}', [("get_weather", {"city": "Paris"}, False)]),
    ("\nIt is sunny.\nget_weather\n{}", [("content", "It is sunny.\nget_weather\n{}")]),   # the newline: its template's
    ("get_weather is a tool I have.", [("content", "get_weather is a tool I have.")]),
    ('get_time\n{"city": "Paris"}', [("content", 'get_time\n{"city": "Paris"}')]),   # not an offered tool
    ("get_weather\nsunny", [("content", "get_weather\nsunny")]),
    ("get_weather", [("content", "get_weather")]),
    ("<think>a call</think>get_weather \n{}", [("reasoning", "a call"), ("get_weather", {}, False)]),
])
def test_glm4_a_reply_that_begins_with_a_tools_name_and_json_is_a_call(text, want):
    """GLM-4-0414: a call is the whole reply, the tool's name on its first line, then its JSON
    arguments (streamed as written); any other reply is text (its first newline, which its template
    writes, dropped)."""
    for size in range(1, len(text) + 1):
        assert _parse_in_pieces(GLM4().bind(TOOLS), text, size, lead="\n") == want, size
    cut = 'get_weather \n{"city": "Pa'   # held to calls and cut by max_tokens: flagged; before its name: nothing
    assert _parse_in_pieces(GLM4().bind(TOOLS), cut, 3, forced=True, lead="\n") == [("get_weather", '{"city": "Pa', True)]
    assert _parse_in_pieces(GLM4().bind(TOOLS), "get_wea", 2, forced=True, lead="\n") == []
    parser, long_call = OutputParser(GLM4().bind(TOOLS), lead="\n"), 'get_weather\n{"city": "' + "P" * 100 + '"}\n'
    seen = [p for i in range(0, len(long_call), 4) for p in parser.feed(long_call[i:i + 4])]
    assert isinstance(seen[0], CallStart) and sum(isinstance(p, CallArgs) for p in seen) > 20, "streamed as written"
    for size in (1, 2, 40):   # without tools (no format to parse calls with) the newline goes too
        assert _parse_in_pieces(None, "\nHi.\n", size, lead="\n") == [("content", "Hi.\n")]
        assert _parse_in_pieces(None, "Hi.", size, lead="\n") == [("content", "Hi.")]


def test_glm4_a_call_the_reply_opens_with_is_held(tokenizers):
    """tool_choice auto: a reply that begins with an offered tool's name is held to its call; its
    arguments to the schema; a reply that begins otherwise is free."""
    pytest.importorskip("llguidance")
    tok = tokenizers["glm-4"]
    call = 'get_weather \n{"city": "Paris"}'
    g = _lazy(tok)
    seen = _feed(g, tok, call)
    assert None not in seen and g.held == 1 and g.broken is None and "held" in seen and g.active is None
    assert _feed(_lazy(tok), tok, call.replace("city", "town"))[-1] is None
    g = _lazy(tok)
    assert set(_feed(g, tok, "\nget_weather \n{}")) == {"free"} and g.held == 0


def test_a_template_without_tools_gets_calls_and_results_as_alternating_text(tokenizers):
    """History with calls but no tools in this request, and a question right after the results:
    user and assistant turns still alternate (Gemma's template refuses anything else)."""
    tok = tokenizers["plain"]
    msgs = _history("c1")[1:]   # no system message
    rendered = template_messages(msgs, ChatOptions(None, tool_format(tok)))
    assert [m["role"] for m in rendered] == ["user", "assistant", "user"]
    assert rendered[2]["content"] == "<tool_response>\n18C, sunny\n</tool_response>\n\nAnd tomorrow?"
    assert rendered[1]["content"].startswith("<tool_call>") and "tool_calls" not in rendered[1]


@pytest.mark.parametrize("lark,yes,no", [
    ('start: "a.b" ("+" | "*")? NUM\nNUM: /[0-9]+/', ["a.b12", "a.b*7"], ["axb1", "a.b", "a.b+-1"]),
    ('start: WORD ":" [" "] item~2..3  // a list\nitem: "x".."z" -> one\n%import common.WORD',
     ["ab:xy", "ab: zzz"], ["ab:x", "ab:xyzx", "1:xy"]),
    ('start: head\n    | "-" head\nhead: "Q"i LF\n%import common.LF', ["q\n", "-Q\n"], ["--q\n", "q"]),
    ('start: "a"{2,3} "b"{,1} # llguidance\'s repeat', ["aa", "aaab"], ["a", "aabb"]),
])
def test_a_lark_grammar_without_recursion_is_one_regex(lark, yes, no):
    import re

    from localheap.larkformat import lark_regex

    rx = re.compile(lark_regex(lark))
    assert all(rx.fullmatch(s) for s in yes), (lark_regex(lark), yes)
    assert not any(rx.fullmatch(s) for s in no), (lark_regex(lark), no)


@pytest.mark.parametrize("lark,why", [
    ('start: "(" start ")" | "x"', "recurses"),
    ('start: a\na: "b" a?', "recurses"),
    ('start: "x"\n%ignore " "', "%ignore"),
    ('start: thing', "does not define"),
    ('begin: "x"', "no `start`"),
    ('start: "x"\n%import common.UNHEARD', "UNHEARD"),
])
def test_what_a_lark_grammar_cannot_spell_out_is_refused(lark, why):
    from localheap.grammar import GrammarError
    from localheap.larkformat import lark_regex

    with pytest.raises(GrammarError, match=why):
        lark_regex(lark)


CALC = r"""
// a sum of products, a bracket holding a sum, strings between quotes; spaces and newlines between
start: sum
?sum: product (("+" | "-") product)*
?product: atom ("*" atom)*
atom: NUMBER | "(" sum ")" | STRING | "'" /[a-z]+/i | "#"{1,2} NUMBER
STRING: /"[^"\n]*"/
%import common.NUMBER
%import common.WS
%ignore WS
"""
CALC_YES = ["1+2", '(1 + "a b") * 2', " ( ( 4 ) )\n", '"x"\t+(3)', "'Ab * 2.5", '"\\"', "## 3+#1"]
CALC_NO = ["(1+2", "1 2", '"a\nb"', "2*", "'1", '"\\"\\"', "###3"]


def _json_calc_grammar(json_string: bool) -> str:
    from localheap.larkformat import lark_rules

    quote = '"\\""' if json_string else ""
    return f"start: {quote} g {quote}\n" + lark_rules(CALC, "g", json_string)


@pytest.mark.parametrize("json_string", [True, False])
def test_a_lark_grammar_with_recursion_holds_its_strings_as_json_writes_them(tokenizers, json_string):
    """Any Lark grammar (recursion, %ignore, regexes with classes and flags) as rules: inside a JSON
    string its strings are taken only as json.dumps writes them (a quote, a backslash, a newline or a
    tab escaped), and what the grammar refuses is refused; as they are, the same strings raw."""
    pytest.importorskip("llguidance")
    from localheap.grammar import Grammar

    tok = tokenizers["plain"]
    grammar = _json_calc_grammar(json_string)

    def takes(text: str, written: bool = False) -> bool:
        g = Grammar(tok, {tok.eos_token_id}, grammar)
        for t in tok.encode(json.dumps(text) if json_string and not written else text, add_special_tokens=False):
            if not g.allowed()[t]:
                return False
            g.advance(t)
        return bool(g.allowed()[tok.eos_token_id])

    assert all(takes(s) for s in CALC_YES), [s for s in CALC_YES if not takes(s)]
    assert not any(takes(s) for s in CALC_NO), [s for s in CALC_NO if takes(s)]
    if json_string:   # an escape json.dumps does not write, or a raw newline, is refused
        assert takes('"1 + 2"', written=True) and not takes('"1 +\\u0020 2"', written=True)
        assert not takes('"1 +\n2"', written=True)


def test_inside_a_json_string_a_lark_grammar_takes_what_it_takes_raw(tokenizers):
    """Random CALC sums (quotes, tabs, newlines, backslashes), some with a character put in, dropped
    or changed: the rules rewritten for a JSON string take a string's json.dumps exactly where the
    grammar as it is (llguidance's own lexer over the original terminals) takes the string."""
    pytest.importorskip("llguidance")
    import random

    from localheap.grammar import Grammar

    tok = tokenizers["plain"]
    escaped, raw = _json_calc_grammar(True), _json_calc_grammar(False)

    def takes(grammar: str, text: str) -> bool:
        g = Grammar(tok, {tok.eos_token_id}, grammar)
        ids, m = g.ll.tokenize_bytes(text.encode()), g.matcher
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    rnd = random.Random(0)

    def sum_(depth: int = 0) -> str:
        r = rnd.random()
        if depth > 3 or r < 0.3:
            return rnd.choice(["1", "2.5", '"a b"', '"\\"', "'Ab", "#7", '"\t"'])
        if r < 0.5:
            return "(" + sum_(depth + 1) + ")"
        return sum_(depth + 1) + rnd.choice([" + ", "*", "-", "\n*\n", "\t+ "]) + sum_(depth + 1)

    taken = 0
    for _ in range(300):
        text = sum_()
        for _ in range(rnd.choice([0, 0, 1, 2])):
            at, c = rnd.randrange(len(text) + 1), rnd.choice('1+()"a \n\t\\\'#*-.')
            text = rnd.choice([text[:at] + c + text[at:], text[:at] + text[at + 1:], text[:at] + c + text[at + 1:]])
        taken += takes(raw, text)
        assert takes(escaped, json.dumps(text)) == takes(raw, text), text
    assert 100 < taken < 300   # (both kinds were seen)


@pytest.mark.parametrize("regex,yes,no", [
    (r"[^a]", ["b", '\\"', "\\n", "\\u0001", "é"], ["a", '"', "\n", "\\u0061"]),
    (r"(?i)q.", ["Qx", "q\\t"], ["q\\n", "qx\\n"]),
    (r"\d{2}|x+?", ["12", "xxx"], ["1", "1x"]),
])
def test_a_regex_is_rewritten_for_the_strings_json_writes(regex, yes, no):
    import re

    from localheap.larkformat import json_regex

    # (Rust's class intersection [[c]&&[^...]] read by Python as a lookahead and the class)
    python = re.compile(json_regex(regex).replace("[[", r'(?!["\\\x00-\x1f])[').replace(r'&&[^"\\\x00-\x1f]]', ""))
    assert all(python.fullmatch(s) for s in yes), (json_regex(regex), yes)
    assert not any(python.fullmatch(s) for s in no), (json_regex(regex), no)


@pytest.mark.parametrize("regex,why", [(r"^a", "anchor"), (r"(?=a)a", "lookaround"), (r"(a)\1", "backreference")])
def test_a_regex_json_cannot_hold_is_refused(regex, why):
    from localheap.grammar import GrammarError
    from localheap.larkformat import json_regex

    with pytest.raises(GrammarError, match=why):
        json_regex(regex)


@pytest.mark.parametrize("lark,why", [
    ('start: a\na: %json {"type": "object"}', "%json"),
    ('start: "x" <|end|>', "cannot be read"),
    ('start: "x"\n%declare A', "%declare"),
    ('start: "(" start ")" | b', "does not define"),
    ('start: "(" start ")" | /(?<=a)x/', "lookaround"),
])
def test_what_lark_rules_cannot_rewrite_is_refused(lark, why):
    from localheap.grammar import GrammarError
    from localheap.larkformat import lark_rules

    with pytest.raises(GrammarError, match=why):
        lark_rules(lark, "g")


def _takes_whole(tok, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text`'s tokens one by one and then allows only the end."""
    from localheap.grammar import Grammar

    g = Grammar(tok, {tok.eos_token_id}, grammar)
    for t in tok.encode(text, add_special_tokens=False):
        if not g.allowed()[t]:
            return False
        g.advance(t)
    return set(g.allowed().nonzero()[0]) == {tok.eos_token_id}


CALC_CALLS = {
    "qwen": '<tool_call>\n{{"name": "calc", "arguments": {{"input": {j}}}}}\n</tool_call>',
    "plain": '<tool_call>\n{{"name": "calc", "arguments": {{"input": {j}}}}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{{"name": "calc", "arguments": {{"input": {j}}}}}]',
    "llama3.1": '{{"name": "calc", "parameters": {{"input": {j}}}}}',
    "phi4-mini": '<|tool_call|>[{{"name": "calc", "arguments": {{"input": {j}}}}}]<|/tool_call|>',
    "glm-4": 'calc \n{{"input": {j}}}',
    "qwen3-coder": "<tool_call>\n<function=calc>\n<parameter=input>\n{raw}\n</parameter>\n</function>\n</tool_call>",
    "glm-4.5": "<tool_call>calc\n<arg_key>input</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>",
}


@pytest.mark.parametrize("family", sorted(CALC_CALLS))
def test_a_custom_tool_held_to_a_recursive_lark_grammar_in_every_family(tokenizers, family):
    """A custom tool whose Lark format recurses (LarkInput): each family's forced call grammar, with a
    function tool beside it, takes the call in its own syntax with an input the format takes (JSON-
    escaped where the family writes JSON, raw where it tags), refuses one it does not, and still
    takes the function's call; the lazy grammar of tool_choice auto holds the call the same."""
    pytest.importorskip("llguidance")
    from localheap.larkformat import LarkInput
    from localheap.server.chat import call_grammar
    from localheap.server.responses import CUSTOM_PARAMETERS

    tok = tokenizers[family]
    tools = TOOLS + [{"type": "function", "function": {"name": "calc", "parameters": CUSTOM_PARAMETERS}}]
    held = {"calc": LarkInput(CUSTOM_PARAMETERS, CALC)}
    grammar = call_grammar(tool_format(tok), tools, "required", False, tok, held)

    def takes(text: str) -> bool:
        return _takes_whole(tok, grammar, text)

    def call(text: str) -> str:
        return CALC_CALLS[family].format(j=json.dumps(text), raw=text)

    for text in ("1 + 2", '("a" + 3)*\n4'):
        assert takes(call(text)), (family, text)
        held_lazily = _feed(_lazy(tok, tools=tools, arguments=held), tok, call(text))
        assert None not in held_lazily and "held" in held_lazily, (family, text, held_lazily)
    assert not takes(call("(1 + 2")) and not takes(call("1 2"))
    assert takes(WEATHER_CALLS[family])


# a tool whose schema refers into itself (pydantic writes a nested model so: openai.pydantic_function_tool)
PLACE = {"type": "object", "properties": {"city": {"type": "string"}, "near": {"$ref": "#/$defs/Place"}},
         "required": ["city"], "additionalProperties": False}
SAVE = {"type": "function", "function": {"name": "save", "parameters": {
    "type": "object", "$defs": {"Place": PLACE}, "additionalProperties": False, "required": ["home"],
    "properties": {"home": {"$ref": "#/$defs/Place"}, "count": {"type": "integer"}}}}}
SAVE_CALLS = {family: call.replace("calc", "save").replace('{{"input": {j}}}', "{j}")
              for family, call in CALC_CALLS.items() if family not in ("qwen3-coder", "glm-4.5")}
SAVE_CALLS["qwen3-coder"] = "<tool_call>\n<function=save>\n<parameter=home>\n{raw}\n</parameter>\n</function>\n</tool_call>"
SAVE_CALLS["glm-4.5"] = "<tool_call>save\n<arg_key>home</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>"


@pytest.mark.parametrize("family", sorted(SAVE_CALLS))
def test_a_forced_call_holds_a_schema_with_references_into_itself(tokenizers, family):
    """$defs and "$ref": "#/$defs/Place" (nested, and a Place inside a Place): placed inside the
    call's schema the references no longer resolved, and the request was a 400 ("Pointer
    '/$defs/Place' does not exist"); they are rebased onto a copy of the tool's schema."""
    pytest.importorskip("llguidance")
    from localheap.server.chat import call_grammar

    tok = tokenizers[family]
    grammar = call_grammar(tool_format(tok), [SAVE] + TOOLS, "required", False, tok)

    def takes(home: dict) -> bool:
        args = json.dumps(home if family in ("qwen3-coder", "glm-4.5") else {"home": home})
        return _takes_whole(tok, grammar, SAVE_CALLS[family].format(j=args, raw=args))

    assert takes({"city": "Paris"}) and takes({"city": "Paris", "near": {"city": "Lyon"}})
    assert not takes({"city": 5}) and not takes({"city": "Paris", "near": {"town": "Lyon"}})
    assert _takes_whole(tok, grammar, WEATHER_CALLS[family])   # the other tool's calls as before


class _OnDevice:
    """A sampled token as a sampler hands it over ([1] array); records when the host reads it."""

    def __init__(self, token: int, reads: list):
        self.token, self.reads = token, reads

    def item(self) -> int:
        self.reads.append(self.token)
        return self.token


def _feed_lagged(g, tok, text: str) -> tuple[list, list]:
    """As a pipelining sampler drives it: allowed() before each draw, see() after; per token 'free',
    'held' or None (refused), and at each step how many tokens the host had read."""
    seen, reads, read_at, last = [], [], [], None
    for t in tok.encode(text, add_special_tokens=False):
        mask = g.allowed()
        read_at.append(len(reads))
        if isinstance(mask, IfLast):   # applied on the device after the token in flight (`last`)
            assert mask.token.token == last
            mask = next((m for i, m in mask.masks if i == last), None)
        last = t
        if mask is not None and not mask[t]:
            seen.append(None)
            break
        seen.append("free" if mask is None else "held")
        g.see(_OnDevice(t, reads))
    return seen, read_at


def test_a_lazy_grammar_reads_free_tokens_a_step_late_and_holds_the_call_the_same(tokenizers, tmp_path):
    """Free text: at each draw the host has read the tokens before the last one only (the sampler's
    pipelining is kept); where the text ends with part of the opener it reads the last one too, so a
    call over several tokens is held exactly as with advance(). An opener that is one token by itself
    is read a step late too, but the mask of the draw after it (an IfLast, applied on the device only
    after that token) holds the call's first token all the same."""
    pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    tok = tokenizers["qwen"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    before = "Fine weather for a walk today. "
    lagged, read_at = _feed_lagged(_lazy(tok), tok, before + call)
    assert lagged == _feed(_lazy(tok), tok, before + call)
    n = len(tok.encode(before, add_special_tokens=False))
    assert read_at[:n] == [max(0, k - 1) for k in range(n)]   # free: all but the token in flight
    tokenizers["qwen"].save_pretrained(tmp_path)
    one = AutoTokenizer.from_pretrained(tmp_path)
    one.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    g = _lazy(one)
    seen, _ = _feed_lagged(g, one, before + call + " ok")
    first = len(one.encode(before + "<tool_call>", add_special_tokens=False))
    end = len(one.encode(before + call, add_special_tokens=False))
    assert set(seen[first:end]) == {"held"} and set(seen[end:]) == {"free"}, seen
    g.allowed()
    assert g.held == 1 and g.broken is None
    seen, _ = _feed_lagged(_lazy(one), one, before + call.replace("<tool_call>\n", "<tool_call> ") + " ok")
    assert seen[-1] is None and len(seen) == first + 1   # the first token after the opener is held too
    g = _lazy(one)   # inside reasoning the opener opens nothing: no mask after it
    seen, _ = _feed_lagged(g, one, "<think>" + before + call.replace("<tool_call>\n", "<tool_call> ") + "</think>")
    assert set(seen) == {"free"} and g.held == 0


def test_the_mask_after_a_one_token_opener_applies_on_the_device_only_after_it():
    """IfLast on each backend's sampler: the grammar's mask where the token in flight is the opener,
    the scores untouched where it is not (no host read either way)."""
    import numpy as np
    import torch

    from localheap.backends.torch.generate import _masked

    keep = np.array([True, False, True, False, False])
    for device in ["cpu"] + ["cuda"] * torch.cuda.is_available():
        scores = torch.zeros(1, 6, device=device)
        c = IfLast(torch.tensor([7], device=device), [(7, keep), (9, ~keep)], {})
        out = _masked(scores, c)
        assert out.device == scores.device and torch.isinf(out[0]).tolist() == [False, True, False, True, True, True]
        c.token = torch.tensor([9], device=device)
        assert torch.isinf(_masked(scores, c)[0]).tolist() == [True, False, True, False, False, True]
        c.token = torch.tensor([3], device=device)
        assert torch.equal(_masked(scores, c), scores)
    mlx_generate = pytest.importorskip("localheap.backends.mlx.generate", exc_type=ImportError)
    import mlx.core as mx

    c = IfLast(mx.array([7]), [(7, keep)], {})
    out = np.array(mlx_generate.masked(mx.zeros((1, 6)), c))
    assert np.isinf(out[0]).tolist() == [False, True, False, True, True, True]
    c.token = mx.array([3])
    assert not np.isinf(np.array(mlx_generate.masked(mx.zeros((1, 6)), c))).any()


def test_qwen3_coder_values_are_typed_by_the_tools_schemas():
    """Raw-text values: a string as written (no JSON escaping, newlines kept); numbers, booleans, objects
    and arrays read as JSON where the schema says so; as written where they do not read."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": ["number", "null"]},
        "b": {"type": "boolean"}, "o": {"type": "object"}, "bad": {"type": "integer"}}}}}]
    body = ("\n<function=f>\n<parameter=s>\n12 \"quoted\"\nline two\n</parameter>\n<parameter=n>\n7\n</parameter>\n"
            "<parameter=x>\n2.5\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1]}\n"
            "</parameter>\n<parameter=bad>\nseven\n</parameter>\n<parameter=extra>\n3\n</parameter>\n</function>\n")
    (call,) = QwenXML().bind(tools).parse(body)
    assert call.error is None and json.loads(call.arguments) == {
        "s": '12 "quoted"\nline two', "n": 7, "x": 2.5, "b": True, "o": {"k": [1]}, "bad": "seven", "extra": "3"}
    (cut,) = QwenXML().parse("\n<function=f>\n<parameter=s>\nok\n</parameter>\n")
    assert json.loads(cut.arguments) == {"s": "ok"} and "cut short" in cut.error
    assert QwenXML().parse("no function here") is None


@pytest.mark.parametrize("family,call,arg", [
    ("qwen3-coder", "<tool_call>\n<function=f>\n{}</function>\n</tool_call>", "<parameter={}>\n{}\n</parameter>\n"),
    ("glm-4.5", "<tool_call>f\n{}</tool_call>", "<arg_key>{}</arg_key>\n<arg_value>{}</arg_value>\n"),
])
def test_a_tagged_call_held_by_the_grammar_takes_each_type(tokenizers, family, call, arg):
    """The grammar of a Qwen3-Coder or GLM-4.5 call: the arguments in the schema's order, a string as
    raw text up to its closing tag (newlines and quotes as they are), an enum's values only, a number
    as a number, an object as JSON; required arguments cannot be left out; parallel calls a line apart."""
    pytest.importorskip("llguidance")
    from localheap.grammar import Grammar
    from localheap.server.chat import call_grammar

    tok = tokenizers[family]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["mode"],
              "properties": {"note": {"type": "string"}, "mode": {"type": "string", "enum": ["a", "b"]},
                             "n": {"type": "integer"}, "o": {"type": "object"}}}}}]
    one = call_grammar(tool_format(tok), tools, "f", False, tok)
    many = call_grammar(tool_format(tok), tools, "required", True, tok)

    def takes(*calls: str, grammar: str = one) -> bool:
        g = Grammar(tok, {tok.eos_token_id}, grammar)
        for t in tok.encode("\n".join(call.format(c) for c in calls), add_special_tokens=False):
            if not g.allowed()[t]:
                return False
            g.advance(t)
        return set(g.allowed().nonzero()[0]) == {tok.eos_token_id} if grammar is one else \
            bool(g.allowed()[tok.eos_token_id])

    p = arg.format
    assert takes(p("note", 'two "lines"\n<b>here</b>') + p("mode", "a") + p("n", "-12") + p("o", '{"k": 1}'))
    assert takes(p("mode", "b"))
    assert takes(p("mode", "b"), p("mode", "a"), grammar=many) and not takes(p("mode", "b"), p("mode", "a"))
    assert not takes(p("mode", "c"))
    assert not takes(p("note", "x"))                    # mode is required
    assert not takes(p("mode", "a") + p("n", "1.5"))
    assert not takes(p("mode", "a") + p("other", "1"))


def test_glm_values_are_typed_by_the_tools_schemas():
    """GLM-4.5's <arg_value>s: a string as written (no JSON escaping, newlines kept), the other types
    read as JSON where the schema says so, as written where they do not read; a name on its own
    line, or run into its first <arg_key> (GLM-4.7); JSON after <tool_call> is not this format's."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "integer"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "bad": {"type": "integer"}}}}}]
    body = ("f\n<arg_key>s</arg_key>\n<arg_value>12 \"quoted\"\nline two</arg_value>\n<arg_key>n</arg_key>\n"
            "<arg_value>7</arg_value>\n<arg_key>b</arg_key>\n<arg_value>true</arg_value>\n<arg_key>o</arg_key>\n"
            "<arg_value>{\"k\": [1]}</arg_value>\n<arg_key>bad</arg_key>\n<arg_value>seven</arg_value>\n"
            "<arg_key>extra</arg_key>\n<arg_value>3</arg_value>\n")
    (call,) = GLM().bind(tools).parse(body)
    assert call.name == "f" and call.error is None and json.loads(call.arguments) == {
        "s": '12 "quoted"\nline two', "n": 7, "b": True, "o": {"k": [1]}, "bad": "seven", "extra": "3"}
    (run_in,) = GLM().bind(tools).parse("f<arg_key>n</arg_key><arg_value>2</arg_value>")
    assert run_in.name == "f" and json.loads(run_in.arguments) == {"n": 2}
    (stray,) = GLM().parse("f\n<arg_key>n</arg_key>\nhalf")
    assert stray.error and "outside its arguments" in stray.error
    assert GLM().parse('\n{"name": "f", "arguments": {}}\n') is None and GLM().parse("\n") is None


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_a_one_token_opener_holds_the_call_with_the_decode_pipelined(model_dirs, tmp_path_factory, backend_name):
    """`bench structured`'s tool paths on Phi-4-mini's template and tokens (<|tool_call|> one token),
    through each backend's real sampler at temperature 1: the lazy grammar handed tokens on the device
    (pipelined, IfLast after a possible opener) draws exactly what it draws reading each token at
    once, and replies made to open a call come back valid when held, not when free."""
    pytest.importorskip("llguidance")
    if backend_name == "mlx":
        pytest.importorskip("mlx_lm")
    from localheap.bench.structured import run_tools
    from localheap.heap import HeapConfig
    from localheap.models import load_backend

    backend = load_backend(str(phi4_mini_model(model_dirs, tmp_path_factory.mktemp("phi4b") / "m")), backend_name)
    rows = {r["path"]: r for r in run_tools(backend, HeapConfig(budget=256), 48, 4, log=lambda _: None)}
    assert rows["auto, grammar read at once"]["valid_calls"] == "same tokens as pipelined", rows
    assert rows["call opened, held"]["valid_calls"] == "4 of 4", rows
    assert rows["call opened, free"]["valid_calls"] == "0 of 4", rows


def test_a_custom_calls_input_streams_as_json_reads_it_however_the_arguments_are_cut():
    """InputStream decodes {"input": "..."} as it is written: the parts given join to what
    json.loads reads, wherever the text is cut (inside an escape, a surrogate pair, the key); an
    escape is given only once whole; arguments that are not {"input": "..."} give nothing."""
    import random

    rng = random.Random(7)
    alphabet = ["a", '"', "\\", "\n", "\t", "é", "😀", "\u2028", "/", "\x01", "\ud83d", "}", " "]
    for _ in range(2000):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        args = json.dumps({"input": value}, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        cuts = sorted(rng.sample(range(len(args) + 1), rng.randint(0, min(8, len(args)))))
        stream, given, at = InputStream(), [], 0
        for cut in cuts + [len(args)]:
            given.append(stream.feed(args[at:cut]))
            at = cut
        assert "".join(given) == value and stream.rest(value) == "", (args, cuts)
    stream = InputStream()
    assert [stream.feed(t) for t in ['{"in', 'put": "ab\\u00', 'e9\\ud83d', '\\ude00"}']] == ["", "ab", "é", "😀"]
    stream = InputStream()
    assert stream.feed('{"patch": "x"}') == "" and stream.rest('{"patch": "x"}') == '{"patch": "x"}'
    stream = InputStream()
    assert stream.feed('{"input": "abc", "more": 1}') == "abc" and stream.rest('{"input"') is None


WRITE = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "n": {"type": "integer"}, "flags": {"type": "array"}, "ok": {"type": ["boolean", "null"]}}}}}]


def _tagged_call(fmt, pairs: list[tuple[str, str]], closed: bool = True) -> str:
    if isinstance(fmt, GLM):
        body = "write\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    else:
        body = "\n<function=write>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in pairs) + "</function>\n"
    return "<tool_call>" + body + ("</tool_call>" if closed else "")


@pytest.mark.parametrize("fmt", [QwenXML, GLM], ids=["qwen3-coder", "glm-4.5"])
def test_a_tagged_call_streams_its_arguments_as_the_json_they_are_read_as(fmt):
    """Qwen3-Coder's and GLM-4.5's calls (each argument in tags, its value raw) stream as they are
    written: the name once whole, then the arguments as JSON in parts, a string's characters before
    its tag closes. Whatever the pieces the text comes in, the parts join to the call's arguments,
    and they read as the family's whole parse reads the call (typed by the schema: the array, the
    integer, the boolean); a value holding what looks like the start of its closing tag, quotes,
    backslashes, tabs, newlines at its ends and non-ASCII text reads back as written."""
    import random

    rng = random.Random(3)
    pieces = ["a", "\n", "\t", '"', "\\", "é", "😀", "</param", "</arg_val", "<", ">", " "]
    f = fmt().bind(WRITE)
    for trial in range(150):
        pairs = [("path", "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))))]
        pairs += rng.sample([("n", "12"), ("flags", "[1, \"x\"]"), ("ok", "true"), ("note", "plain\ntext")], rng.randint(0, 3))
        text = "Writing it.\n" + _tagged_call(f, pairs)
        want = json.loads(f.parse(text.split("<tool_call>", 1)[1][:-len("</tool_call>")])[0].arguments)
        sizes = [1, 2, 3, 5, 8, len(text)] if trial < 20 else [rng.randint(1, 12)]
        for size in sizes:
            got = _parse_in_pieces(f, text, size)   # (asserts the streamed parts join to the call's arguments)
            assert got == [("content", "Writing it.\n"), ("write", want, False)], (text, size)
    parser = OutputParser(fmt().bind(WRITE))
    text = _tagged_call(f, [("path", "a.txt"), ("note", "x" * 40 + "\n" + "y" * 40)])
    seen = [p for i in range(0, len(text), 4) for p in parser.feed(text[i:i + 4])] + parser.finish()
    args = [p.text for p in seen if isinstance(p, CallArgs)]
    assert len(args) > 10 and "".join(args) == '{"path": "a.txt", "note": "' + "x" * 40 + "\\n" + "y" * 40 + '"}'
    assert any("x" in a for a in args[:-3]), "the note's text came before its tag closed"


def test_newer_mistral_calls_stream_their_arguments_and_read_the_same_in_any_pieces():
    """Mistral's newer calls (`[TOOL_CALLS]name[ARGS]{...}`, one marker a call, to the reply's end)
    stream as they are written: the name once [ARGS] has come, then the arguments as written (their
    parts join to the call's arguments: _parse_in_pieces checks it), the call once the next marker or
    the end has come; every chunking gives what the family's whole parse gives, a call cut short is
    flagged, and a reply whose calls are the v0.3 list is read whole at its end as before."""
    fmt = Mistral()
    text = ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}  [TOOL_CALLS]get_time[ARGS]{}\n')
    want = [("content", "Checking."), ("get_weather", {"city": "Paris", "days": [1, 2]}, False), ("get_time", {}, False)]
    for size in range(1, len(text) + 1):
        assert _parse_in_pieces(fmt, text, size) == want, size
    cut = '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'
    for size in range(1, len(cut) + 1):
        assert _parse_in_pieces(fmt, cut, size, forced=True) == [("get_weather", '{"city": "Pa', True)], size
        assert _parse_in_pieces(fmt, "[TOOL_CALLS]get_wea"[:size + 12], size, forced=True) == []
    listed = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    for size in (1, 5, len(listed)):
        assert _parse_in_pieces(fmt, listed, size) == [("get_weather", {"city": "Paris"}, False)]
    mixed = '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]'
    for size in (1, 7, len(mixed)):
        assert _parse_in_pieces(fmt, mixed, size) == [("get_time", {}, False), ("get_weather", {"city": "Nice"}, False)]
    parser = OutputParser(fmt)
    long_call = '[TOOL_CALLS]write[ARGS]' + json.dumps({"path": "a.txt", "content": "x" * 200})
    seen = [p for i in range(0, len(long_call), 5) for p in parser.feed(long_call[i:i + 5])]
    assert isinstance(seen[0], CallStart) and sum(isinstance(p, CallArgs) for p in seen) > 30, "streamed before the end"
    (call,) = [p for p in seen + parser.finish() if isinstance(p, ToolCall)]
    assert call.streamed and json.loads(call.arguments)["content"] == "x" * 200


@pytest.mark.parametrize("fmt,opening,closing,key", [(Phi4Mini, "<|tool_call|>[", "]<|/tool_call|>", "arguments"),
                                                     (Mistral, "[TOOL_CALLS][", "]", "arguments"),
                                                     (Llama, "", "", "parameters")],
                         ids=["phi4-mini", "mistral-v0.3", "llama3.1"])
def test_calls_written_as_json_objects_stream_and_read_as_the_whole_parse(fmt, opening, closing, key):
    """Calls written as JSON objects in a row (Phi-4-mini's and Mistral v0.3's lists, Llama 3.1's
    objects separated by ';') stream as they are written: the name once the arguments' object opens,
    the arguments as written (strings holding braces, brackets, escaped quotes; nested objects), the
    call once they close. In pieces of any size the parts join to each call's arguments, and the calls
    read as the family's whole parse reads them; an object whose keys come in another order, or whose
    arguments are a JSON string, is read whole."""
    import random

    rng = random.Random(5)
    f = fmt()
    values = ["x", "}{", '"q"', "a\\\\b", "[1, {2}]", "é", "😀", "\n"]
    for trial in range(60):
        objects = []
        for _ in range(rng.randint(1, 3)):
            args = {"s": rng.choice(values) * rng.randint(0, 3), "n": {"deep": [rng.randint(0, 9), {"k": rng.choice(values)}]}}
            if rng.random() < 0.2:
                objects.append(json.dumps({key: args, "name": "late"}))   # keys the other way round: read whole
            elif rng.random() < 0.1:
                objects.append(json.dumps({"name": "stringy", key: json.dumps(args)}))   # arguments as a string
            else:
                objects.append(json.dumps({"name": "f", key: args}, ensure_ascii=rng.random() < 0.5))
        text = opening + (", " if opening else "; ").join(objects) + closing
        whole = f.parse(text[len(f.starts[0]):] if opening else text) or []
        want = [(c.name, json.loads(c.arguments), False) for c in whole]
        sizes = [1, 2, 3, 7, len(text)] if trial < 10 else [rng.randint(1, 20)]
        for size in sizes:
            assert _parse_in_pieces(f, text, size) == want, (text, size)
    parser = OutputParser(f)
    text = opening + json.dumps({"name": "write", key: {"content": "y" * 300}}) + closing
    seen = [p for i in range(0, len(text), 6) for p in parser.feed(text[i:i + 6])]
    assert isinstance(seen[0], CallStart) and sum(isinstance(p, CallArgs) for p in seen) > 40, "streamed as written"
