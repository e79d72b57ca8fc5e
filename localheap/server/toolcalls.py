"""What a chat model wrote, split into content, reasoning and tool calls, as it streams.

Each family writes tool calls its own way; the format is recognised from the served model's
chat template (the same text the model was trained to answer):

- Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3), or
  `[TOOL_CALLS]name[ARGS]{...}` (newer tokenizers), to the end of the reply.
- Llama 3.1+: the reply is a JSON object `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`; several separated by `;`).
- A template that does not render `tools` (Llama 3.0, Gemma 3, the tiny test models): the tools
  are described in a system message and the model is asked for Hermes-style blocks.

Reasoning: `<think>...</think>` at the start of a reply (or a prompt that ends inside `<think>`)
goes to `reasoning`, not `content`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

THINK, END_THINK = "<think>", "</think>"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str                 # JSON text; as the model wrote it when `error` is set
    error: Optional[str] = None    # why the arguments are not JSON (the call is still returned)
    streamed: bool = False         # its CallStart and CallArgs pieces came before it


@dataclass
class CallStart:
    """A call whose name is known while its arguments are still being written (Hermes blocks)."""
    id: str
    name: str


@dataclass
class CallArgs:
    """More of the arguments of the call last started, as written."""
    text: str


@dataclass
class Text:
    kind: str                      # "content" | "reasoning"
    text: str


Piece = Union[Text, ToolCall, CallStart, CallArgs]


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Mistral's templates refuse any id but 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\S)')   # then its arguments
_TAIL = re.compile(r'\s*\}?\s*$')   # what may close the call object rather than belong to the arguments
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


class ToolFormat:
    """One family's tool-call syntax. `starts`: markers that open calls in a reply; `end`: what
    closes one call (None: the calls run to the end of the reply)."""
    name = ""
    starts: tuple[str, ...] = ()
    end: Optional[str] = None
    leading_json = False           # a reply that starts with '{' is a call (Llama)
    make_id: Callable[[], str] = staticmethod(openai_call_id)
    in_template = True             # the template renders `tools` itself

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        """The calls in `body` (markers stripped), or None: not calls after all."""
        raise NotImplementedError


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


class Mistral(ToolFormat):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    make_id = staticmethod(mistral_call_id)

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
            values = _json_values(part)
            if values is None:
                call = _loose_call(part, self.make_id)
                if call is None:
                    return None
                calls.append(call)
                continue
            for v in values:
                for obj in v if isinstance(v, list) else [v]:
                    call = _call(obj, self.make_id)
                    if call is None:
                        return None
                    calls.append(call)
        return calls or None


class Llama(ToolFormat):
    name = "llama3_json"
    starts = ("<|python_tag|>",)
    leading_json = True

    def parse(self, body: str) -> Optional[list[ToolCall]]:
        values = _json_values(body)
        if not values:
            call = _loose_call(body, self.make_id) if body.lstrip().startswith("{") else None
            return None if call is None else [call]
        calls = [_call(v, self.make_id) for v in values]
        if any(c is None for c in calls) or not all("parameters" in v or "arguments" in v for v in values):
            return None
        return calls


def template_source(tokenizer: Any) -> str:
    for t in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        src = getattr(t, "chat_template", None)
        if isinstance(src, str):
            return src
        if isinstance(src, dict):   # named templates: the default one, and a tool_use one if any
            return "\n".join(v for v in src.values() if isinstance(v, str))
    return ""


def tool_format(tokenizer: Any) -> ToolFormat:
    """The family's format, recognised from its chat template."""
    src = template_source(tokenizer)
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


class OutputParser:
    """Feed text deltas; get back pieces of content, reasoning and whole tool calls, in order.

    Text that could be the start of a marker is held back until it is known not to be one; a
    reply is therefore split the same way whatever the sizes of the pieces it arrives in."""

    def __init__(self, fmt: Optional[ToolFormat], reasoning: bool = True, in_think: bool = False):
        self.fmt = fmt
        self.reasoning = reasoning
        self.mode = "think" if in_think else "text"     # text | think | call | rest
        self.pending = ""
        self.at_start = True        # nothing but whitespace seen in this reply (or since </think>)
        self.body = ""              # the call being read ("call"), or the reply's rest ("rest")
        self.raw_start = ""         # the marker that opened it (put back if it is not a call)
        self.calls = 0
        self.strip = False          # drop the whitespace after </think> or a call
        self.streaming: Optional[list] = None   # the call whose arguments are being passed on

    def _starts(self) -> list[str]:
        starts = list(self.fmt.starts) if self.fmt else []
        if self.reasoning and self.at_start:
            starts.append(THINK)
        if self.fmt is not None and self.fmt.leading_json and self.at_start:
            starts.append("{")
        return starts

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        out: list[Piece] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        while self._step(out, final=True):
            pass
        if self.mode == "think" and self.pending:
            out.append(Text("reasoning", self.pending))
        elif self.mode == "text" and self.pending:
            out.append(Text("content", self.pending))
        elif self.mode in ("call", "rest"):
            self._close_call(self.body + self.pending, out)
        self.pending = ""
        return [p for p in out if not isinstance(p, Text) or p.text]

    def _step(self, out: list[Piece], final: bool) -> bool:
        """One transition; False when nothing more can be decided from the text so far."""
        if self.mode == "text":
            if self.at_start and not final and not self.pending.strip():
                return False   # only whitespace so far: a marker may still follow
            hit = _earliest(self.pending, self._starts(), self.at_start)
            if hit is not None:
                i, marker = hit
                if not (self.at_start and not self.pending[:i].strip()):   # no whitespace-only content
                    self._emit("content", self.pending[:i], out)
                self.pending = self.pending[i + len(marker):]
                if marker == THINK:
                    self.mode = "think"
                else:
                    self.mode = "call" if self.fmt.end else "rest"
                    self.raw_start = marker
                    self.body = "{" if marker == "{" else ""
                return True
            keep = 0 if final else _partial(self.pending, self._starts())
            self._emit("content", self.pending[:len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        if self.mode == "think":
            i = self.pending.find(END_THINK)
            if i >= 0:
                self._emit("reasoning", self.pending[:i], out)
                self.pending = self.pending[i + len(END_THINK):]
                self.mode, self.at_start, self.strip = "text", True, True
                return True
            keep = 0 if final else _partial(self.pending, [END_THINK])
            self._emit("reasoning", self.pending[:len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        if self.mode == "call":
            i = self.pending.find(self.fmt.end)
            if i < 0:
                self._stream_call(self.pending[:len(self.pending) - _partial(self.pending, [self.fmt.end])], out)
                return False
            self._close_call(self.body + self.pending[:i], out, self.fmt.end)
            self.pending = self.pending[i + len(self.fmt.end):]
            return True
        self.body += self.pending   # "rest": parsed once the reply is complete
        self.pending = ""
        return False

    def _emit(self, kind: str, text: str, out: list[Piece]) -> None:
        if kind == "content" and self.strip:   # the blank line after </think>
            text = text.lstrip()
        if not text:
            return
        if kind == "content":
            self.at_start = self.strip = False
        if out and isinstance(out[-1], Text) and out[-1].kind == kind:
            out[-1].text += text
        else:
            out.append(Text(kind, text))

    def _stream_call(self, text: str, out: list[Piece]) -> None:
        """The arguments of a call in progress as far as they are known: a call whose text opens
        with its name and then its arguments is started, and its arguments are passed on as they
        come, all but what may be the call's own closing brace."""
        if self.streaming is None:
            head = _HEAD.match(text)
            if head is None:
                return
            self.streaming = [self.fmt.make_id(), head.group(1), head.end(), head.end()]   # id, name, start, sent
            out.append(CallStart(self.streaming[0], head.group(1)))
        upto = max(self.streaming[3], len(text) - len(_TAIL.search(text).group(0)))
        if upto > self.streaming[3]:
            out.append(CallArgs(text[self.streaming[3]:upto]))
            self.streaming[3] = upto

    def _close_call(self, body: str, out: list[Piece], end: str = "") -> None:
        if self.streaming is not None:   # its arguments are what was passed on, and the rest up to the brace
            self._stream_call(body, out)
            call_id, name, start, sent = self.streaming
            self.streaming, self.mode, self.body = None, "text", ""
            args = body[start:sent]
            try:
                json.loads(args)
                error = None
            except ValueError as e:
                error = f"the arguments are not valid JSON: {e}"
            self.at_start, self.strip = False, True
            self.calls += 1
            out.append(ToolCall(call_id, name, args, error, streamed=True))
            return
        calls = self.fmt.parse(body)
        self.mode, self.body = "text", ""
        if calls is None:   # not a call after all: the text as the model wrote it
            raw = (body if self.raw_start == "{" else self.raw_start + body) + end
            self._emit("content", raw, out)
            return
        self.at_start, self.strip = False, True
        self.calls += len(calls)
        out.extend(calls)


def _earliest(text: str, markers: list[str], at_start: bool) -> Optional[tuple[int, str]]:
    """The first marker in `text` (THINK and '{' count only at the reply's start)."""
    best = None
    lead = len(text) - len(text.lstrip())
    for m in markers:
        if m in (THINK, "{"):
            i = lead if at_start and text.startswith(m, lead) else -1
        else:
            i = text.find(m)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


def _partial(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    keep = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                keep = max(keep, k)
                break
    return keep
