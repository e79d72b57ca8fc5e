"""What the OpenAI and Anthropic chat routes share: a request's tools, template arguments and
constraint; starting its job on a session; reading its reply as content, reasoning and tool calls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fastapi import Request

from ..engine import Generate, Job, Started
from ..engine.slots import InvalidSlot
from ..generation import SamplingParams
from ..grammar import (AfterReasoning, Grammar, GrammarError, LazyGrammar, LeadingTokens, Trigger, grammar_error, has_local_refs,
                       json_grammar, json_rule, rebased)
from ..larkformat import LarkInput, lark_rules
from ..sessions import Prompt
from .bridge import JobEvents, submit
from .errors import BadRequest
from .logonce import warn_once
from .prompts import ChatOptions
from .services import Services, owner
from .toolcalls import THINK, OutputParser
from .harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START, HarmonyParser
from .toolformats import GLM, GLM4, Harmony, Hermes, Llama, Mistral, Phi4Mini, QwenXML, ToolFormat, tool_format


@dataclass
class ChatPlan:
    """A chat request in the terms both APIs share. tools: OpenAI's shape. choice: "auto",
    "none", "required" or a function's name. json_schema: {} for any JSON object. arguments: a
    tool's name -> the schema its arguments are held to where that is not its `parameters` (a
    Responses custom tool's format). allowed: the names the model may call (tool_choice
    allowed_tools; None: any of `tools`), held by the grammar; every tool is still in the prompt."""
    tools: Optional[list[dict]] = None
    choice: str = "auto"
    parallel: bool = True
    json_schema: Optional[dict] = None
    template_kwargs: Optional[dict] = None
    arguments: Optional[dict] = None
    allowed: Optional[list[str]] = None
    schema_param: str = "response_format"   # where the request gave json_schema (a 400's param)

    @property
    def callable(self) -> list[dict]:
        """The tools the model may call."""
        return [t for t in self.tools or [] if self.allowed is None or t["function"]["name"] in self.allowed]

    def options(self, svc: Services) -> ChatOptions:
        """The format is known even without tools: a history may hold calls and results to render."""
        fmt = tool_format(svc.tokenizer, svc.settings.tool_format)
        if isinstance(fmt, (QwenXML, GLM4)):   # its values are typed by the tools' schemas (GLM's too);
            fmt.bind(self.tools)               # GLM-4's calls open with their names
        return ChatOptions(self.tools or None, fmt, dict(self.template_kwargs or {}))

    def parser(self, opts: ChatOptions, prompt: Prompt) -> OutputParser:
        """Tool calls are looked for when there are tools and tool_choice is not none; reasoning
        always (only a reply that opens with <think>, or a prompt that ends inside one, has any;
        a harmony reply's analysis channel). A forced choice (the grammar's calls) has no content."""
        if isinstance(opts.fmt, Harmony):
            return HarmonyParser(tools=bool(self.tools) and self.choice != "none", forced=self.forced)
        fmt = opts.fmt if self.tools and self.choice != "none" else None
        return OutputParser(fmt, reasoning=True, in_think=_in_think(prompt), forced=self.forced,
                            lead=opts.fmt.text_lead if opts.fmt is not None else "")

    @property
    def forced(self) -> bool:
        """Whether the reply is held to tool calls by the grammar (tool_choice required or a name)."""
        return bool(self.tools) and self.choice not in ("auto", "none")

    def constraint(self, svc: Services, opts: ChatOptions, prompt: Prompt) -> Any:
        """The request's grammar: the JSON it must answer with, or the call it must make; with tools
        and tool_choice auto, the calls the reply opens (serve --no-tool-grammar: none). A test's
        forced tokens where the server has that hook."""
        if svc.force_tokens is not None:
            return svc.force_tokens()
        if self.json_schema is not None:
            try:
                grammar = json_grammar(self.json_schema or None)   # checked: a schema it cannot take is a 400
            except GrammarError as e:
                raise BadRequest(str(e), self.schema_param) from e
            if isinstance(opts.fmt, Harmony):   # the JSON is the final message's body
                grammar = harmony_final(self.json_schema or {"type": "object"}, svc.tokenizer)
        elif self.forced:
            grammar = call_grammar(opts.fmt, self.callable, self.choice, self.parallel, svc.tokenizer, self.arguments)
        elif self.tools and self.choice == "auto" and svc.settings.tool_grammar:
            return _leading(svc, self.lazy(svc, opts, prompt))
        else:
            return _leading(svc, None)
        param = self.schema_param if self.json_schema is not None else "tool_choice"
        try:
            if _in_think(prompt) and not isinstance(opts.fmt, Harmony):   # (a template that opens <think>)
                return _leading(svc, AfterReasoning(svc.tokenizer, svc.backend.eos_token_ids, grammar))
            return _leading(svc, Grammar(svc.tokenizer, svc.backend.eos_token_ids, grammar))
        except GrammarError as e:
            raise BadRequest(str(e), param) from e

    def lazy(self, svc: Services, opts: ChatOptions, prompt: Prompt) -> Optional[LazyGrammar]:
        """The calls a free reply opens, held to the tools' schemas; None where llguidance cannot
        enforce a tool's schema (tool_choice auto never refused a schema: the calls go free, logged)."""
        if not self.callable:   # allowed_tools that name only hosted tools: nothing to hold a call to
            return None
        triggers = call_triggers(opts.fmt, self.callable, svc.tokenizer, self.arguments, self.parallel)
        for t in triggers:
            error = grammar_error(t.grammar)
            if error:
                warn_once("tool calls sampled freely: llguidance cannot enforce the tools' schemas (%s)",
                          [error.splitlines()[0][:200]])
                return None
        return LazyGrammar(svc.tokenizer, svc.backend.eos_token_ids, triggers, in_think=_in_think(prompt),
                           once=not self.parallel or opts.fmt.leading_name)   # (GLM-4: a call is the reply)


def _in_think(prompt: Prompt) -> bool:
    """Whether the prompt ends inside a think block (the reply begins in reasoning)."""
    return prompt.text is not None and prompt.text.rstrip().endswith(THINK)


def _leading(svc: Services, constraint: Any) -> Any:
    """Tests only (svc.lead_tokens): the reply begins with those ids, then `constraint` holds it."""
    if svc.lead_tokens is None:
        return constraint
    return LeadingTokens(svc.lead_tokens, svc.backend.eos_token_ids, constraint)


def _call_rule(fmt: ToolFormat, tools: list[dict], arguments: Optional[dict] = None) -> str:
    """The `%json` rule of one call of any of `tools`, in the family's keys; `arguments`: a tool's
    schema to enforce where it is not its `parameters` (a custom tool's format)."""
    args_key = "parameters" if isinstance(fmt, Llama) else "arguments"
    held = [_arguments(t, arguments) for t in tools]
    if not any(isinstance(h, LarkInput) for h in held):
        # a tool's schema inside the call's: its references into itself ("#/$defs/A") rebased onto
        # a copy of it in the call schema's $defs
        defs = {f"args_{i}": rebased(h, f"/$defs/args_{i}") for i, h in enumerate(held) if has_local_refs(h)}
        schemas = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
                    "properties": {"name": {"const": t["function"]["name"]}, args_key: defs.get(f"args_{i}", h)}}
                   for i, (t, h) in enumerate(zip(tools, held))]
        root = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return json_rule({**root, "$defs": defs} if defs else root)
    # a call per tool, its JSON written out around its arguments as %json writes them (every one:
    # beside a literal that began as it did, llguidance did not take a %json call)
    rules = []
    for i, (t, args) in enumerate(zip(tools, held)):
        head = json.dumps(f'{{"name": {json.dumps(t["function"]["name"])}, "{args_key}": ')
        rules.append(f'call_{i}: {head} call_{i}_args "}}"\ncall_{i}_args: {_args_rule(args, f"call_{i}_args")}')
    return " | ".join(f"call_{i}" for i in range(len(tools))) + "\n" + "\n".join(rules)


def call_grammar(fmt: ToolFormat, tools: list[dict], choice: str, parallel: bool, tokenizer: Any,
                 arguments: Optional[dict] = None) -> str:
    """A Lark grammar (llguidance's dialect) for tool calls in the family's own syntax: one call of
    the named function, or one or more (`parallel`) of any of the tools for "required"."""
    chosen = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
    many = parallel and choice == "required"
    if isinstance(fmt, Mistral):
        opener = _token_ref(tokenizer, "[TOOL_CALLS]")
        if _single_token(tokenizer, "[ARGS]"):   # newer tokenizers: [TOOL_CALLS]name[ARGS]{...} a call
            more = f" ({opener} named)*" if many else ""
            return f"start: {opener} named{more}\n" + _named_calls(chosen, arguments, tokenizer, "named")
        more = ' ("," " " call)*' if many else ""
        return f'start: {opener} "[" call{more} "]"\ncall: {_call_rule(fmt, chosen, arguments)}\n'
    if isinstance(fmt, Harmony):   # a call ends the reply (<|call|> is a stop token): one call
        return harmony_call(chosen, arguments, tokenizer)
    if isinstance(fmt, GLM4):   # the reply is one call
        return _glm4_calls(chosen, arguments)
    if isinstance(fmt, GLM):
        more = ' ("\\n" block)*' if many else ""
        return (f'start: block{more}\nblock: "<tool_call>" fn "</tool_call>"\n'
                + _tagged_call(chosen, arguments, "fn", GLM_ARGS))
    if isinstance(fmt, QwenXML):
        more = ' ("\\n" block)*' if many else ""
        return (f'start: block{more}\nblock: "<tool_call>\\n" fn "\\n</tool_call>"\n'
                + _tagged_call(chosen, arguments, "fn", QWEN_XML))
    call = _call_rule(fmt, chosen, arguments)
    if isinstance(fmt, Phi4Mini):
        more = ' ("," " " call)*' if many else ""
        opener, closer = _token_ref(tokenizer, fmt.starts[0]), _token_ref(tokenizer, fmt.end)
        return f'start: {opener} "[" call{more} "]" {closer}\ncall: {call}\n'
    if isinstance(fmt, Llama):
        more = ' ("; " call)*' if many else ""
        return f"start: call{more}\ncall: {call}\n"
    assert isinstance(fmt, Hermes)
    more = ' ("\\n" block)*' if many else ""
    return f'start: block{more}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}\n'


def call_triggers(fmt: ToolFormat, tools: list[dict], tokenizer: Any,
                  arguments: Optional[dict] = None, parallel: bool = True) -> list[Trigger]:
    """Where a free reply opens a call in the family's syntax, and the grammar of what follows: the
    call's body, up to the end of its block (Hermes) or of its list (Mistral), or the one call
    (Llama: a reply that begins `{"name"`, or after `<|python_tag|>`)."""
    if isinstance(fmt, Mistral) and _single_token(tokenizer, "[ARGS]"):   # newer: [TOOL_CALLS]name[ARGS]{...}
        return [Trigger("[TOOL_CALLS]", _named_calls(tools, arguments, tokenizer))]
    if isinstance(fmt, Harmony):   # a header's recipient, after its channel or its role (not in prose)
        named = _harmony_named(tools, arguments, tokenizer)
        return [Trigger("commentary to=functions.", named), Trigger("assistant to=functions.", named),
                Trigger("to=functions.", named, at_start=True)]   # the first header's role is the prompt's
    if isinstance(fmt, GLM):
        return [Trigger("<tool_call>", 'start: fn "</tool_call>"\n' + _tagged_call(tools, arguments, "fn", GLM_ARGS))]
    if isinstance(fmt, GLM4):   # a reply that begins with a tool's name (any: the grammar reads it whole)
        calls = _glm4_calls(tools, arguments)
        return [Trigger(t["function"]["name"], calls, at_start=True, inclusive=True, exact=True) for t in tools]
    if isinstance(fmt, QwenXML):
        return [Trigger("<tool_call>", 'start: "\\n" fn "\\n</tool_call>"\n'
                        + _tagged_call(tools, arguments, "fn", QWEN_XML))]
    call = _call_rule(fmt, tools, arguments)
    more = ' ("," " " call)*' if parallel else ""   # a list of calls: one, with parallel_tool_calls false
    if isinstance(fmt, Mistral):
        return [Trigger("[TOOL_CALLS]", f'start: "[" call{more} "]"\ncall: {call}\n')]
    if isinstance(fmt, Phi4Mini):   # the list, then its closing token (the model may leave it out: held here)
        closer = _token_ref(tokenizer, fmt.end)
        return [Trigger(fmt.starts[0], f'start: "[" call{more} "]" {closer}\ncall: {call}\n')]
    if isinstance(fmt, Llama):
        one = f"start: call\ncall: {call}\n"
        return [Trigger("<|python_tag|>", one), Trigger('{"name"', one, at_start=True, inclusive=True)]
    assert isinstance(fmt, Hermes)
    return [Trigger("<tool_call>", f'start: "\\n" call "\\n</tool_call>"\ncall: {call}\n')]


def _glm4_calls(tools: list[dict], arguments: Optional[dict]) -> str:
    """One GLM-4-0414 call of any of `tools`: its name, the space its template writes (or not), a
    newline, its JSON arguments."""
    rules = [f"start: {' | '.join(f'c{i}' for i in range(len(tools)))}"]
    for i, t in enumerate(tools):
        rules.append(f'c{i}: {json.dumps(t["function"]["name"])} " "? "\\n" c{i}_args')
        rules.append(f"c{i}_args: {_args_rule(_arguments(t, arguments), f'c{i}_args')}")
    return "\n".join(rules) + "\n"


def _harmony_named(tools: list[dict], arguments: Optional[dict], tokenizer: Any, top: str = "start") -> str:
    """What follows `to=functions.` in a harmony header (rule `top`): a tool's name, the rest of
    the header (the channel after the recipient, or the recipient after the channel), the body,
    and <|call|> (a stop token: the reply ends with the call)."""
    ch, msg, con, call = (_token_ref(tokenizer, t) for t in (CHANNEL, MESSAGE, CONSTRAIN, CALL))
    rules = [f"{top}: {' | '.join(f'{top}_{i}' for i in range(len(tools)))}",
             f'{top}_head: " " {con} "json" | {ch} "commentary" (" " {con}? "json")?']
    for i, t in enumerate(tools):
        rules.append(f"{top}_{i}: {json.dumps(t['function']['name'])} {top}_head {msg} {top}_{i}_args {call}")
        rules.append(f"{top}_{i}_args: {_args_rule(_arguments(t, arguments), f'{top}_{i}_args')}")
    return "\n".join(rules) + "\n"


def _harmony_analysis(tokenizer: Any) -> str:
    """A harmony reply's optional reasoning before what the grammar holds: an analysis message."""
    ch, msg, end, start = (_token_ref(tokenizer, t) for t in (CHANNEL, MESSAGE, END, START))
    return f'analysis: {ch} "analysis" {msg} /(.|\\n)*/ {end} {start} "assistant"\n'


def harmony_call(tools: list[dict], arguments: Optional[dict], tokenizer: Any) -> str:
    """A forced harmony reply: reasoning if the model wants it, then one call of one of `tools`."""
    ch = _token_ref(tokenizer, CHANNEL)
    return (f'start: analysis? {ch} "commentary to=functions." named\n' + _harmony_analysis(tokenizer)
            + _harmony_named(tools, arguments, tokenizer, "named"))


def harmony_final(schema: dict, tokenizer: Any) -> str:
    """A JSON answer (response_format) as a harmony reply: reasoning if the model wants it, then a
    final message whose body is JSON that `schema` accepts."""
    ch, msg = _token_ref(tokenizer, CHANNEL), _token_ref(tokenizer, MESSAGE)
    return (f'start: analysis? {ch} "final" {msg} answer\nanswer: {json_rule(schema)}\n'
            + _harmony_analysis(tokenizer))


def _named_calls(tools: list[dict], arguments: Optional[dict], tokenizer: Any, top: str = "start") -> str:
    """Newer Mistral's call (rule `top`): the tool's name, [ARGS], its arguments as JSON."""
    args = _token_ref(tokenizer, "[ARGS]")
    rules = [f"{top}: {' | '.join(f'{top}_{i}' for i in range(len(tools)))}"]
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        schema = _arguments(t, arguments)
        rules += [f"{top}_{i}: {json.dumps(name)} {args} {top}_{i}_args",
                  f"{top}_{i}_args: {_args_rule(schema, f'{top}_{i}_args')}"]
    return "\n".join(rules) + "\n"


@dataclass(frozen=True)
class _Tagged:
    """A family whose call names the function and then tags each argument, its value as raw text:
    the rule that reads such text through the value's close (`text`, named `text_name`), what opens
    one named argument, the close after a typed value, and what the call's name and end are."""
    text_name: str
    text: str
    any_argument: str
    opens: Callable[[str], str]
    close: str
    head: Callable[[str], str]
    tail: str


QWEN_XML = _Tagged("xml_text", r"xml_text[lazy]: /(?s:.*)\n<\/parameter>/",
                   ' ("<parameter=" /[^>\\n]+/ ">\\n" xml_text "\\n")*', lambda key: f"<parameter={key}>\n",
                   ' "\\n</parameter>"', lambda name: f"<function={name}>\n", ' "</function>"')
GLM_ARGS = _Tagged("glm_text", r"glm_text[lazy]: /(?s:.*)<\/arg_value>/",
                   ' ("<arg_key>" /[^<\\n]+/ "</arg_key>\\n<arg_value>" glm_text "\\n")*',
                   lambda key: f"<arg_key>{key}</arg_key>\n<arg_value>", ' "</arg_value>"',
                   lambda name: f"{name}\n", "")


def _tagged_call(tools: list[dict], arguments: Optional[dict], top: str, syntax: _Tagged) -> str:
    """A call in a tagged family's syntax (rule `top`): one of the tools by name, its arguments in
    the schema's order (the required ones always), each value as its type is written: a string as
    raw text up to its close (or held to its enum or pattern), a number or boolean as such, anything
    else as JSON. A tool whose schema lists no properties takes any arguments as text (none where
    its additionalProperties is false). Qwen3-Coder: <function=NAME>, <parameter=KEY> lines;
    GLM-4.5: NAME on its line, an <arg_key> and an <arg_value> per argument."""
    rules = [f"{top}: {' | '.join(f'{top}_{i}' for i in range(len(tools)))}", syntax.text]
    for i, t in enumerate(tools):
        schema = _arguments(t, arguments)
        props, required = schema.get("properties") or {}, set(schema.get("required") or [])
        if not props:   # any arguments as text, unless it takes none
            params = "" if schema.get("additionalProperties") is False else syntax.any_argument
        else:
            params = ""
            for j, (key, prop) in enumerate(props.items()):
                value = f"{top}_{i}_{j}"
                if isinstance(schema, LarkInput) and key == "input":   # the raw text, held to the Lark rules
                    rules.append(f"{value}: {value}_in{syntax.close}\n" + lark_rules(schema.lark, f"{value}_in", False))
                else:
                    rules.append(f"{value}: {_xml_value(prop, syntax, schema)}")
                params += f' ({json.dumps(syntax.opens(key))} {value} "\\n")' + ("" if key in required else "?")
        rules.append(f'{top}_{i}: {json.dumps(syntax.head(t["function"]["name"]))}{params}{syntax.tail}')
    return "\n".join(rules) + "\n"


def _xml_value(prop: dict, syntax: _Tagged, schema: dict) -> str:
    """The grammar of one tagged argument's value (`prop`, a property of the tool's `schema`), through
    its close."""
    close, text = syntax.close, syntax.text_name
    kind = prop.get("type", _pointed(schema, prop.get("$ref")).get("type"))   # ({"$ref": ...}: its target's)
    if isinstance(prop.get("enum"), list) and prop["enum"] and all(isinstance(v, str) for v in prop["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in prop["enum"]) + ")" + close
    if kind == "string" and isinstance(prop.get("pattern"), str):
        body = prop["pattern"]
        body = body[1:] if body.startswith("^") else body
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
        return "/" + body.replace("/", "\\/") + "/" + close
    if kind in (None, "string") or isinstance(kind, list):
        return text
    if kind == "integer":
        return r"/-?[0-9]+/" + close
    if kind == "number":
        return r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/" + close
    if kind == "boolean":
        return '("true" | "false")' + close
    if has_local_refs(prop):   # its references are into the tool's schema: a copy of that in its $defs
        return json_rule({**rebased(prop, "/$defs/args"), "$defs": {"args": rebased(schema, "/$defs/args")}}) + close
    return json_rule(prop) + close


def _pointed(schema: dict, ref: Any) -> dict:
    """What a reference into `schema` ("#/$defs/A") points at; {} where it is none (or not local)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return {}
    at: Any = schema
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        at = at.get(part) if isinstance(at, dict) else at[int(part)] if isinstance(at, list) and part.isdigit() \
            and int(part) < len(at) else None
    return at if isinstance(at, dict) else {}


def _args_rule(schema: dict, name: str) -> str:
    """The rule body of a call's JSON arguments held to `schema` (the rule is `name`): its `%json`, or
    for a custom tool held to Lark rules, `{"input": "..."}` around them, the rules on the lines after."""
    if not isinstance(schema, LarkInput):
        return json_rule(schema)
    return f'"{{\\"input\\": \\"" {name}_in "\\"}}"\n' + lark_rules(schema.lark, f"{name}_in")


def _arguments(tool: dict, arguments: Optional[dict]) -> dict:
    """The schema a tool's arguments are held to: `arguments`' entry for it (a custom tool's format),
    else its parameters (any object where it has none)."""
    return (arguments or {}).get(tool["function"]["name"]) or tool["function"].get("parameters") or {"type": "object"}


def _single_token(tokenizer: Any, text: str) -> bool:
    return len(tokenizer.encode(text, add_special_tokens=False)) == 1


def _token_ref(tokenizer: Any, text: str) -> str:
    """A special token in a grammar: by id where the tokenizer has it as one token, else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


async def start(svc: Services, request: Optional[Request], prompt: Prompt, params: SamplingParams,
                session_id: Optional[str], title: Optional[str],
                ephemeral: bool = False, scratch: bool = False,
                cache_reuse: Optional[int] = None, who: Optional[str] = None,
                slot: Optional[int] = None, reply_begun: int = 0,
                limit_param: str = "max_tokens") -> tuple[Job, JobEvents, Started]:
    """Queue a generation on the session the prompt extends (or `session_id`); returns once admitted.
    `ephemeral`: a session of its own, never matched or saved, deleted when the reply ends.
    `scratch`: an editor's completion (engine.Generate.scratch). `cache_reuse`: the request's
    n_cache_reuse (None: serve --cache-reuse). `slot`: llama-server's id_slot (engine.Generate.slot).
    `reply_begun`: the prompt ends with that many tokens of a reply begun before (engine.Generate).
    `limit_param`: what the route calls the reply limit, for its error (check_start).
    With no `request` (a background response run again after a restart), the sessions matched are
    `who`'s."""
    who = owner(request) if request is not None else who
    check_start(svc, who, params, session_id, ephemeral, limit_param)
    job, events, started = await submit(svc.engine, lambda emit: Generate(prompt, params, emit, session_id, who,
                                                                               ephemeral=ephemeral,
                                                                               scratch=scratch,
                                                                               cache_reuse=cache_reuse,
                                                                               slot=slot,
                                                                               reply_begun=reply_begun))
    await svc.name_session(started.session_id, title)
    return job, events, started


def check_slot(svc: Services, id_slot: Optional[int]) -> Optional[int]:
    """llama-server's id_slot: the engine slot a request runs on (None: any; -1 says so too), or a 400."""
    if id_slot is None or id_slot == -1:
        return None
    try:
        return svc.engine.slots.check(id_slot)
    except InvalidSlot as e:
        raise BadRequest(f"{e}; -1: any", "id_slot") from None


def check_start(svc: Services, who: Optional[str], params: SamplingParams, session_id: Optional[str],
                ephemeral: bool = False, limit_param: str = "max_tokens") -> None:
    """What `start` refuses before it queues anything (a background response checks it before
    it answers). `limit_param`: the reply limit's name in the route's requests (max_output_tokens,
    n_predict, options.num_predict), as its error names it."""
    if session_id is not None:
        if ephemeral:
            raise BadRequest(f"\"store\": false runs in a session of its own that is not kept; it cannot continue "
                             f"session {session_id!r} (drop X-Session-Id or \"store\": false)", "store")
        svc.store.info(session_id, who)   # unknown id, or another key's: 404 before queueing
    if params.max_tokens > svc.settings.max_tokens_limit:   # one request must not hold the engine forever
        raise BadRequest(f"{limit_param.rpartition('.')[2]} {params.max_tokens} is over this server's limit of "
                         f"{svc.settings.max_tokens_limit}", limit_param, "max_tokens_too_large")
