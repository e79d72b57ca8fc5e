"""Each model family's tool-call syntax, recognised from the served model's chat template (the
same text the model was trained to answer), and how a call in that syntax is read:

- Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3), or
  `[TOOL_CALLS]name[ARGS]{...}` (newer tokenizers), to the end of the reply.
- Llama 3.1+: the reply is a JSON object `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`; several separated by `;`).
- Qwen3-Coder (XML): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>`,
  each value as raw text, typed by the tool's schema.
- gpt-oss (harmony): a message addressed `to=functions.NAME` on the commentary channel, its body
  the JSON arguments, ended by <|call|>; read with the reply's channels by harmony.HarmonyParser.
- Phi-4-mini: the tools as JSON in the system message's `tools` field (its template writes them
  between <|tool|> and <|/tool|>), a call `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>`
  (the closing token often left out), results as the template's `tool` turns.
- GLM-4-0414: a reply that begins with a tool's name on its first line and its JSON arguments on the
  next; past calls as assistant turns with `metadata`, results as `observation` turns.
- A template that does not render `tools` (Llama 3.0, Gemma 3, the tiny test models): the tools
  are described in a system message and the model is asked for Hermes-style blocks.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .ids import choice, hex_id


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str                 # JSON text; as the model wrote it when `error` is set
    error: Optional[str] = None    # why the arguments are not JSON (the call is still returned)
    streamed: bool = False         # its CallStart and CallArgs pieces came before it


def openai_call_id() -> str:
    return "call_" + hex_id(12)


def mistral_call_id() -> str:
    """Mistral's templates refuse any id but 9 letters and digits."""
    return "".join(choice(string.ascii_letters + string.digits) for _ in range(9))

_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(.*?)\s*\}?\s*$', re.S)


def _call(obj: Any, make_id: Callable[[], str]) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            json.loads(args)
        except ValueError as e:
            return ToolCall(make_id(), obj["name"], args, f"the arguments are not valid JSON: {e}")
        return ToolCall(make_id(), obj["name"], args)
    return ToolCall(make_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _loose_call(body: str, make_id: Callable[[], str]) -> Optional[ToolCall]:
    """A call whose JSON does not parse: its name and its arguments as written, flagged."""
    name = _NAME.search(body)
    if name is None:
        return None
    args = _ARGS.search(body, name.end()) or _ARGS.search(body)
    raw = args.group(1) if args else ""
    try:
        json.loads(raw)
        error = "the call is not valid JSON"
    except ValueError as e:
        error = f"the arguments are not valid JSON: {e}"
    return ToolCall(make_id(), name.group(1), raw, error)


def _json_values(text: str) -> Optional[list]:
    """JSON values one after another, separated by whitespace or ';'; None if anything else."""
    dec, at, out = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return out
        try:
            value, at = dec.raw_decode(text, at)
        except ValueError:
            return None
        out.append(value)


def _list_calls(text: str, make_id: Callable[[], str]) -> Optional[list[ToolCall]]:
    """The calls of a JSON list of them (or of objects one after another without its brackets),
    each object read alone: a list cut short gives its whole calls, then the one it cut (its name
    and arguments as written, flagged) where its name was written. None: not calls after all."""
    dec, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at] in " \t\r\n,[]":
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = dec.raw_decode(text, at)
        except ValueError:
            cut = _loose_call(text[at:], make_id)
            return calls + [cut] if cut is not None else calls or None
        for obj in value if isinstance(value, list) else [value]:
            call = _call(obj, make_id)
            if call is None:
                return None
            calls.append(call)


class ToolFormat:
    """One family's tool-call syntax. `starts`: markers that open calls in a reply; `end`: what
    closes one call (None: the calls run to the end of the reply)."""
    name = ""
    starts: tuple[str, ...] = ()
    end: Optional[str] = None
    leading_json = False           # a reply that starts with '{' is a call (Llama)
    make_id: Callable[[], str] = staticmethod(openai_call_id)
    in_template = True             # the template renders `tools` itself
    results_as_user = False        # (not in_template) results written into a user turn: no tool role
    leading_name = False           # a call is a reply that begins with a tool's name on its own line (GLM-4)
    metadata_calls = False         # past calls as turns of their own (call_turns), results as `observation`
    text_lead = ""                 # what a text reply begins with that its template writes (not the model's text)
    tags: Optional["TagSyntax"] = None   # each argument in tags (Qwen3-Coder, GLM-4.5): read as it is written
    marked_calls = False           # each call after a marker of its own, to the reply's end (Mistral's name[ARGS])
    listed_calls = False           # calls as JSON objects in a row (Llama 3.1, Mistral's v0.3 list, Phi-4-mini)

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        """The calls in `body` (markers stripped), or None: not calls after all."""
        raise NotImplementedError

    def written_calls(self, content: str, calls: list[tuple[str, str]]) -> str:
        """(not in_template) An assistant's text with its earlier calls (name, arguments as sent)
        written into it, as the model writes them: the template cannot render `tool_calls`."""
        raise NotImplementedError

    def with_tools(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """(not in_template) The messages with the tools (OpenAI's shape) where this family reads them."""
        raise NotImplementedError

    def listing(self, tools: list[dict]) -> str:
        """(not in_template) The text with_tools writes the tools as (a session that holds it has them)."""
        raise NotImplementedError

    def parse_block(self, body: str, closed: bool) -> Optional[list[ToolCall]]:
        """`parse` of a block that ended with `end` (`closed`), or with the reply (cut short)."""
        return self.parse(body)


class Hermes(ToolFormat):
    name = "hermes"
    starts = ("<tool_call>",)
    end = "</tool_call>"

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        values = _json_values(body)
        if values is not None and len(values) == 1:
            call = _call(values[0], self.make_id)
            if call is not None:
                return [call]
        call = _loose_call(body, self.make_id)
        return None if call is None else [call]


class Prompted(Hermes):
    """A template without tools: they are described in a system message, calls are Hermes blocks."""
    name = "prompted"
    in_template = False
    results_as_user = True

    def written_calls(self, content: str, calls: list[tuple[str, str]]) -> str:
        return "\n".join([content] * bool(content) + [prompted_call(n, a) for n, a in calls])

    def listing(self, tools: list[dict]) -> str:
        return prompted_tools(tools)

    def with_tools(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        text = self.listing(tools)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": text + "\n\n" + messages[0]["content"]}] + messages[1:]
        return [{"role": "system", "content": text}] + messages


class Phi4Mini(ToolFormat):
    """Phi-4-mini: its template writes a system message's `tools` field (JSON text) between <|tool|>
    and <|/tool|>, and every message as `<|role|>content<|end|>`, so a result is a `tool` turn; the
    model writes a list of calls between <|tool_call|> and <|/tool_call|> (often without the latter:
    the list then runs to the end of the reply). Past calls are written back into the assistant's
    text the same way."""
    name = "phi4_mini"
    starts = ("<|tool_call|>",)
    end = "<|/tool_call|>"
    listed_calls = True
    in_template = False
    SYSTEM = "You are a helpful assistant with some tools."   # Microsoft's example, where a request has none

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        return _list_calls(body, self.make_id)

    def written_calls(self, content: str, calls: list[tuple[str, str]]) -> str:
        body = ", ".join(f'{{"name": {json.dumps(n, ensure_ascii=False)}, "arguments": {a or "{}"}}}' for n, a in calls)
        return f"{content}{self.starts[0]}[{body}]{self.end}"

    def listing(self, tools: list[dict]) -> str:
        return json.dumps([t["function"] for t in tools], ensure_ascii=False)

    def with_tools(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        listed = self.listing(tools)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "tools": listed}] + messages[1:]
        return [{"role": "system", "content": self.SYSTEM, "tools": listed}] + messages


class Mistral(ToolFormat):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    make_id = staticmethod(mistral_call_id)
    marked_calls = True
    listed_calls = True

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        calls: list[ToolCall] = []
        for part in body.split("[TOOL_CALLS]"):
            if not part.strip():
                continue
            if "[ARGS]" in part:            # name[ARGS]{...}
                name, _, args = part.partition("[ARGS]")
                call = _call({"name": name.strip(), "arguments": args.strip()}, self.make_id)
                calls.append(call)
                continue
            listed = _list_calls(part, self.make_id)
            if listed is None:
                return None
            calls += listed
        return calls or None


class Llama(ToolFormat):
    name = "llama3_json"
    starts = ("<|python_tag|>",)
    leading_json = True
    listed_calls = True

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        values = _json_values(body)
        if not values:
            call = _loose_call(body, self.make_id) if body.lstrip().startswith("{") else None
            return None if call is None else [call]
        calls = [_call(v, self.make_id) for v in values]
        if any(c is None for c in calls) or not all("parameters" in v or "arguments" in v for v in values):
            return None
        return calls


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(</function>\s*)?$", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _kind(schema: Optional[dict]) -> Optional[str]:
    kind = (schema or {}).get("type")
    return next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind


def raw_string(schema: Optional[dict]) -> bool:
    """Whether an XML call's parameter of this schema is a string as written (typed_value)."""
    return _kind(schema) in (None, "string")


def typed_value(raw: str, schema: Optional[dict]) -> Any:
    """An XML call's parameter as the tool's schema types it: a string as written; a number, boolean,
    null, object or array read as JSON (as written where it does not read)."""
    kind = _kind(schema)
    if kind in (None, "string"):
        return raw
    try:
        value = json.loads(raw.strip())
    except ValueError:
        lowered = raw.strip().lower()
        return {"true": True, "false": False}.get(lowered, raw) if kind == "boolean" else raw
    return value


@dataclass(frozen=True)
class TagSyntax:
    """How a family that tags each argument writes a call, for reading it as it is written
    (toolcalls.TaggedStream): `head` matches the call's text up to its name, whole (group 1);
    `pair` one whole argument, key and raw value (what `parse` reads); `key` an argument's opening,
    its key whole (group 1), up to where its value begins; `key_open` the literal that begins one;
    `value_end` what closes a value; `trim`: one newline at a value's start and one at its end are
    the markup's, not the value's."""
    head: re.Pattern
    pair: re.Pattern
    key: re.Pattern
    key_open: str
    value_end: str
    trim: bool


class QwenXML(ToolFormat):
    """Qwen3-Coder's calls: a function's name and each parameter in tags, values as raw text (a
    string needs no JSON escaping). `bind` gives it the request's tools, whose schemas type them."""
    name = "qwen3_xml"
    starts = ("<tool_call>",)
    end = "</tool_call>"
    tags = TagSyntax(re.compile(r"\s*<function=([^>\n]+)>"), _PARAM, re.compile(r"<parameter=([^>\n]+)>"),
                     "<parameter=", "</parameter>", trim=True)

    def __init__(self) -> None:
        self.schemas: dict[str, dict] = {}

    def bind(self, tools: Optional[list[dict]]) -> "QwenXML":
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
        return self

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        left = _PARAM.sub("", inner).strip()
        error = None if m.group(3) and not left else \
            "the call is cut short before </function>" if not m.group(3) else f"text outside its parameters: {left[:80]!r}"
        return [ToolCall(self.make_id(), name, self.typed_arguments(name, _PARAM.findall(inner)), error)]

    def typed_arguments(self, name: str, pairs: list[tuple[str, str]]) -> str:
        """(key, raw value) pairs of a call of `name` as JSON arguments, typed by its tool's schema."""
        return json.dumps({k.strip(): typed_value(v, self.schema(name, k)) for k, v in pairs}, ensure_ascii=False)

    def schema(self, name: str, key: str) -> Optional[dict]:
        """The schema of argument `key` of tool `name` (None: not known)."""
        return ((self.schemas.get(name) or {}).get("properties") or {}).get(key.strip())


_GLM_HEAD = re.compile(r"\s*([^<\n]*)")
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GLM(QwenXML):
    """GLM-4.5's calls (GLM-4.6, 4.7): the function's name after <tool_call>, then each argument as
    an <arg_key>/<arg_value> pair, values as raw text (a string as written, the rest as JSON);
    `bind` gives it the request's tools, whose schemas type them."""
    name = "glm45"
    tags = TagSyntax(re.compile(r"\s*([^<\n]*[^<\s][^<\n]*)(?=[<\n])"), _GLM_ARG,
                     re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S), "<arg_key>", "</arg_value>", trim=False)

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        head = _GLM_HEAD.match(body)
        name = head.group(1).strip()
        if not name or name.startswith("{"):   # JSON (another family's call): not this one's
            return None
        inner = body[head.end():]
        left = _GLM_ARG.sub("", inner).strip()
        error = f"text outside its arguments: {left[:80]!r}" if left else None
        return [ToolCall(self.make_id(), name, self.typed_arguments(name, _GLM_ARG.findall(inner)), error)]

    def parse_block(self, body: str, closed: bool) -> Optional[list[ToolCall]]:
        """Only </tool_call> says a call is whole: cut short, one whose name is not yet ended is no
        call, and one with a name is flagged."""
        if closed:
            return self.parse(body)
        head = _GLM_HEAD.match(body)
        if head.end() == len(body):   # the name may go on
            return None
        calls = self.parse(body)
        for c in calls or []:
            c.error = c.error or f"the call is cut short before {self.end}"
        return calls


_NAME_LINE = re.compile(r"[A-Za-z_][\w.\-]*")


class GLM4(ToolFormat):
    """GLM-4-0414 (GLM-4-9B/32B-0414): a call is a reply that begins with the tool's name on its first
    line and has its JSON arguments on the next (one call a turn; the model then stops at
    <|observation|>). Its template renders `tools` itself, a past call as an assistant turn whose
    `metadata` is the name and whose content is the arguments, a result as an `observation` turn;
    its text replies begin with the newline the template writes after <|assistant|>.
    `bind` gives it the request's tools: only their names open a call."""
    name = "glm4"
    leading_name = True
    metadata_calls = True
    text_lead = "\n"               # `<|assistant|>\n{{ content }}`: a text reply's first newline

    def __init__(self) -> None:
        self.names: Optional[set] = None

    def bind(self, tools: Optional[list[dict]]) -> "GLM4":
        self.names = {t["function"]["name"] for t in tools or []} or None
        return self

    def opens_call(self, line: str) -> bool:
        """Whether a reply's first line (the name, maybe with the space its template writes) opens a call."""
        name = line.strip()
        return bool(_NAME_LINE.fullmatch(name)) and (self.names is None or name in self.names)

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        line, sep, args = body.partition("\n")
        if not sep or not self.opens_call(line) or not args.strip().startswith("{"):
            return None
        return [_call({"name": line.strip(), "arguments": args.strip()}, self.make_id)]

    def call_turns(self, content: str, calls: list[tuple[str, str]]) -> list[dict]:
        """An assistant's calls as its template renders them: one turn a call, after its text if any."""
        turns = [{"role": "assistant", "content": content}] if content else []
        return turns + [{"role": "assistant", "metadata": n, "content": a} for n, a in calls]


class Harmony(ToolFormat):
    """gpt-oss's channels (harmony.py reads its replies, with or without tools)."""
    name = "harmony"
    starts = ("to=functions.",)

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        """The call whose header began `to=functions.` and went on with `body` (HarmonyParser's reading)."""
        from .harmony import HarmonyParser

        p = HarmonyParser()
        calls = [x for x in p.feed("<|channel|>commentary " + self.starts[0] + body) + p.finish()
                 if isinstance(x, ToolCall)]
        return calls or None


def template_source(tokenizer: Any) -> str:
    for t in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        src = getattr(t, "chat_template", None)
        if isinstance(src, str):
            return src
        if isinstance(src, dict):   # named templates: the default one, and a tool_use one if any
            return "\n".join(v for v in src.values() if isinstance(v, str))
    return ""


FORMATS = {f.name: f for f in (Hermes, QwenXML, GLM, GLM4, Mistral, Llama, Harmony, Phi4Mini, Prompted)}


def tool_format(tokenizer: Any, name: Optional[str] = None) -> ToolFormat:
    """The family's format: `name` (serve --tool-format), else recognised from its chat template."""
    if name is not None:
        return FORMATS[name]()
    src = template_source(tokenizer)
    if "<|channel|>" in src and "<|message|>" in src:
        return Harmony()
    if "<function=" in src and "<parameter=" in src:
        return QwenXML()
    if "<arg_key>" in src and "<arg_value>" in src:
        return GLM()
    if "<|observation|>" in src and "metadata" in src:
        return GLM4()
    if "<|tool|>" in src and "<|/tool|>" in src:
        return Phi4Mini()
    if "<tool_call>" in src:
        return Hermes()
    if "[TOOL_CALLS]" in src:
        return Mistral()
    if "<|python_tag|>" in src or ("ipython" in src and "tools" in src):
        return Llama()
    return Prompted()


def prompted_tools(tools: list[dict]) -> str:
    """The system text that describes tools to a model whose template cannot."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)
    return ("You may call the functions described here (JSON schemas):\n<tools>\n" + lines + "\n</tools>\n"
            "To call one, reply with a block like this for each call, and nothing else:\n"
            '<tool_call>\n{"name": "function name", "arguments": {"argument": "value"}}\n</tool_call>')


def prompted_call(name: str, arguments: str) -> str:
    """An earlier call, written back the way a Prompted model was asked to write it."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'
