"""What a chat model wrote, split into content, reasoning and tool calls, as it streams. The
calls' syntax is the family's (toolformats.py). Reasoning: `<think>...</think>` at the start of
a reply (or a prompt that ends inside `<think>`) goes to `reasoning`, not `content`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from .toolformats import ToolCall, ToolFormat, _list_calls, _loose_call, raw_string, typed_value

THINK, END_THINK = "<think>", "</think>"


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

_NAME_START = re.compile(r"[A-Za-z_][\w.\-]* ?")   # what may begin a GLM-4 call's first line
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\S)')   # then its arguments


def streamed_call(call_id: str, name: str, args: str) -> ToolCall:
    """A call whose CallStart and CallArgs went before it: its arguments as passed on, flagged where
    they are not JSON."""
    try:
        json.loads(args)
        error = None
    except ValueError as e:
        error = f"the arguments are not valid JSON: {e}"
    return ToolCall(call_id, name, args, error, streamed=True)


class StepParser:
    """Text deltas in, pieces out, through `_step(out, final)`: one transition at a time, False
    when nothing more can be decided from the text so far (`pending`)."""
    pending = ""

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        return self._drain(final=False)

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self._step(out, final):
            pass
        return out

    def _step(self, out: list[Piece], final: bool) -> bool:
        raise NotImplementedError


class OutputParser(StepParser):
    """Feed text deltas; get back pieces of content, reasoning and whole tool calls, in order.

    Text that could be the start of a marker is held back until it is known not to be one; a
    reply is therefore split the same way whatever the sizes of the pieces it arrives in.

    `forced`: the reply is held to tool calls (tool_choice "required" or a named function: the
    grammar allows calls and their separators, nothing else), so it has no content. A reply that
    max_tokens cut inside a call's markup (a marker not yet whole, or a call before its name)
    then returns no call for it rather than its markup as content."""

    def __init__(self, fmt: Optional[ToolFormat], reasoning: bool = True, in_think: bool = False,
                 forced: bool = False, lead: str = ""):
        self.fmt = fmt
        self.lead = lead            # what the template writes before a reply's text (GLM-4's newline): dropped
        self.forced = forced
        self.reasoning = reasoning
        self.mode = "think" if in_think else "text"     # text | think | call | rest
        self.pending = ""
        self.at_start = True        # nothing but whitespace seen in this reply (or since </think>)
        self.body = ""              # the call being read ("call"), or the reply's rest ("rest")
        self.raw_start = ""         # the marker that opened it (put back if it is not a call)
        self.calls = 0
        self.strip = False          # drop the whitespace after </think> or a call
        self.reader: Optional[CallReader] = None   # the family's reader of the block of calls being read
        self.named = not (fmt is not None and fmt.leading_name)   # (GLM-4) the reply's first line is read

    def _starts(self) -> list[str]:
        starts = list(self.fmt.starts) if self.fmt else []
        if self.reasoning and self.at_start:
            starts.append(THINK)
        if self.fmt is not None and self.fmt.leading_json and self.at_start:
            starts.append("{")
        return starts

    def finish(self) -> list[Piece]:
        out = self._drain(final=True)
        if self.mode == "think" and self.pending:
            out.append(Text("reasoning", self.pending))
        elif self.mode == "text" and self.pending and not self.forced:
            out.append(Text("content", self.pending))
        elif self.mode in ("call", "rest"):
            self._close_call(self.body + self.pending, out)
        self.pending = ""
        return [p for p in out if not isinstance(p, Text) or p.text]

    def _step(self, out: list[Piece], final: bool) -> bool:
        """One transition; False when nothing more can be decided from the text so far."""
        if self.mode == "text":
            if not self.named:
                opened = self._leading_name(final)
                if opened is None:
                    return False
                if opened:
                    return True
            if self.lead:
                if not final and len(self.pending) < len(self.lead) and self.lead.startswith(self.pending):
                    return False
                if self.pending.startswith(self.lead):
                    self.pending = self.pending[len(self.lead):]
                self.lead = ""
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
            if self.at_start and not final and not self.pending[:len(self.pending) - keep].strip():
                return False   # whitespace, then what may begin a marker (a GLM reply's "\n<think>")
            self._emit("content", self.pending[:len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        if self.mode == "think":
            i = self.pending.find(END_THINK)
            if i >= 0:
                self._emit("reasoning", self.pending[:i], out)
                self.pending = self.pending[i + len(END_THINK):]
                self.mode, self.at_start, self.strip = "text", True, True
                self.named = not (self.fmt is not None and self.fmt.leading_name)   # a call may follow
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
        self.body += self.pending   # "rest": the reply's calls to its end, read as they come where the family has a reader
        self.pending = ""
        if self._reader() is not None:
            out.extend(self.reader.feed(self.body))
        return False

    def _reader(self) -> Optional[CallReader]:
        if self.reader is None:
            self.reader = call_reader(self.fmt, self.mode)
        return self.reader

    def _leading_name(self, final: bool) -> Optional[bool]:
        """(GLM-4) Whether the reply opens with a call, a tool's name on its first line then its JSON
        arguments (True: the reply is the call, read when it ends), not (False: text), or None: not
        known yet."""
        text = self.pending
        if not text:
            return None if not final else False
        line, nl, rest = text.partition("\n")
        if not nl and not final and len(line) <= 128 and (not line or line[0] not in " \t\r<") and \
                _NAME_START.fullmatch(line):
            return None   # the first line may still be a tool's name
        rest = rest.lstrip()
        if nl and self.fmt.opens_call(line) and not rest and not final:
            return None   # a name: its arguments may follow
        self.named = True
        if nl and self.fmt.opens_call(line) and rest.startswith("{"):
            self.mode, self.raw_start, self.body, self.pending = "rest", "", text, ""
            return True
        return False

    def _emit(self, kind: str, text: str, out: list[Piece]) -> None:
        if kind == "content" and self.forced:   # the calls' separators, or the markup of a call cut short
            return
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
        """The calls of a block in progress (its text so far) as far as they are known."""
        out.extend(self._reader().feed(text))

    def _close_call(self, body: str, out: list[Piece], end: str = "") -> None:
        """A block of calls that ended (`end`: at its closing marker; else the reply ended): the
        pieces its reader has left (the one that read it as it came, or a new one: a block that came
        whole is read the same way, but HeadStream's), or, where the reader started no call, the
        family's parse of the whole."""
        reader, self.reader = self.reader or call_reader(self.fmt, self.mode), None
        pieces = reader.close(body, bool(end)) if reader is not None else None
        if pieces is not None:   # the calls are what was passed on, and the rest
            self.mode, self.body = "text", ""
            self.at_start, self.strip = False, True
            for p in pieces:
                if isinstance(p, Text):
                    self._emit(p.kind, p.text, out)
                else:
                    self.calls += isinstance(p, ToolCall)
                    out.append(p)
            return
        calls = self.fmt.parse_block(body, closed=bool(end))
        self.mode, self.body = "text", ""
        if calls is None:   # not a call after all: the text as the model wrote it
            raw = (body if self.raw_start == "{" else self.raw_start + body) + end
            self._emit("content", raw, out)
            return
        self.at_start, self.strip = False, True
        self.calls += len(calls)
        out.extend(calls)


class CallReader(Protocol):
    """A family's reader of a block of calls as it is written: `feed(text)` (the block's text so far)
    gives the pieces it adds; `close(text, closed)` (the whole block; `closed`: it ended at its
    closing marker, not cut) the pieces left, or None where it started no call (the family's parse
    then reads the block)."""

    def feed(self, text: str) -> list[Piece]: ...

    def close(self, text: str, closed: bool = True) -> Optional[list[Piece]]: ...


def call_reader(fmt: Optional[ToolFormat], mode: str) -> Optional[CallReader]:
    """The reader of a block of calls of `fmt` ("call": between its markers; "rest": the reply's
    rest, the family having no closing marker); None where the block is read whole at its end."""
    if fmt is None:
        return None
    if fmt.tags is not None:
        return TaggedStream(fmt)
    if mode == "call":
        return ListedStream(fmt) if fmt.listed_calls else HeadStream(fmt)
    if fmt.leading_name:
        return LeadingStream(fmt)
    if fmt.marked_calls:   # (Mistral: its v0.3 list where the first call is not marked)
        return FirstOf(MarkedStream(fmt), ListedStream(fmt)) if fmt.listed_calls else MarkedStream(fmt)
    return ListedStream(fmt) if fmt.listed_calls else None


class HeadStream:
    """One call written as a JSON object that opens with its name and then its arguments (Hermes's
    `{"name": ..., "arguments": ...}`): started once its arguments begin (CallStart), they are passed
    on as they come (CallArgs), all but what may be the object's own closing brace. A call that did
    not start so before its block ended is the family's parse's (`close` gives None)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.call: Optional[list] = None   # id, name, where its arguments begin, where what was passed on ends

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.call is None:
            head = _HEAD.match(text)
            if head is None:
                return out
            self.call = [self.fmt.make_id(), head.group(1), head.end(), head.end()]
            out.append(CallStart(self.call[0], head.group(1)))
        upto = max(self.call[3], _before_tail(text))
        if upto > self.call[3]:
            out.append(CallArgs(text[self.call[3]:upto]))
            self.call[3] = upto
        return out

    def close(self, text: str, closed: bool = True) -> Optional[list[Piece]]:
        if self.call is None:
            return None
        out = self.feed(text)
        call_id, name, start, sent = self.call
        out.append(streamed_call(call_id, name, text[start:sent]))
        return out


class FirstOf:
    """The first reader while it may read the block, then the second (which reads the same text)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def feed(self, text: str) -> list[Piece]:
        out = self.first.feed(text)
        return out + self.second.feed(text) if self.first.off else out

    def close(self, text: str, closed: bool = True) -> Optional[list[Piece]]:
        pieces = self.first.close(text, closed)
        return pieces if pieces is not None else self.second.close(text, closed)


class TaggedStream:
    """A call of a family that tags each argument (Qwen3-Coder, GLM-4.5: ToolFormat.tags) read as it
    is written: its name once whole (CallStart), then its arguments (CallArgs) as the JSON text they
    are read as, each typed by the tool's schema: a string value's characters as they come (escaped
    as json.dumps escapes them, a character at a time, so the parts join to that text; a newline or
    the start of the closing tag at its end held back until it is known to be the value's), any
    other value once its tag closes. Its parts join to the call's arguments, which are the family's
    `parse` (an argument given twice stays twice in the text; a string whose tag never closed,
    the call cut short, ends as far as it was passed on)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.tags = fmt, fmt.tags
        self.id = ""
        self.name: Optional[str] = None
        self.scan = 0              # where the next argument is looked for in the call's text
        self.looked = 0            # where a value's end was last looked for
        self.escaped = (-1, 0, "")   # the open string's start, its characters escaped so far, their JSON
        self.whole = "{"           # the JSON of the whole arguments read so far (without the closing brace)
        self.sent = ""             # the arguments' JSON text passed on

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.name is None:
            head = self.tags.head.match(text)
            name = head.group(1).strip() if head is not None else ""
            if not name or name.startswith("{"):   # (GLM-4.5: JSON is another family's call, not this one's)
                return out
            self.id, self.name, self.scan = self.fmt.make_id(), name, head.end()
            out.append(CallStart(self.id, name))
        if text.find(self.tags.value_end, max(self.scan, self.looked)) >= 0:   # (an argument ends only so)
            while (pair := self.tags.pair.search(text, self.scan)) is not None:
                self.whole += (", " if self.whole != "{" else "") + self._entry(pair.group(1), pair.group(2))
                self.scan = pair.end()
        self.looked = len(text) - len(self.tags.value_end) + 1
        self._send(self.whole + self._open_string(text), out)
        return out

    def close(self, body: str, closed: bool = True) -> Optional[list[Piece]]:
        """The rest of the arguments and the call (its error the family's parse says); None where
        the call's name was never read (not a call of this family: the family's parse decides)."""
        out = self.feed(body)
        if self.name is None:
            return None
        args = self.whole + "}"
        if not args.startswith(self.sent):   # a string passed on in part whose tag never closed: as far as passed on
            args = self.sent + '"}'
        self._send(args, out)
        calls = self.fmt.parse_block(body, closed)
        error = calls[0].error if calls else "the call does not read as the family writes one"
        out.append(ToolCall(self.id, self.name, args, error, streamed=True))
        return out

    def _send(self, text: str, out: list[Piece]) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            out.append(CallArgs(text[len(self.sent):]))
            self.sent = text

    def _entry(self, key: str, raw: str) -> str:
        value = typed_value(raw, self.fmt.schema(self.name, key))
        return json.dumps(key.strip(), ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)

    def _open_string(self, text: str) -> str:
        """The JSON of the argument being written, as far as it is known: a string's opening and its
        characters so far; nothing for any other value (nor before its key is whole)."""
        at = text.find(self.tags.key_open, self.scan)
        key = self.tags.key.match(text, at) if at >= 0 else None
        if key is None or not raw_string(self.fmt.schema(self.name, key.group(1))):
            return ""
        start = key.end()
        if self.tags.trim:
            if start == len(text):
                return ""   # (a newline that opens the value is the markup's)
            start += text.startswith("\n", start)
        end = len(text) - _partial(text[-len(self.tags.value_end):], [self.tags.value_end])
        if self.tags.trim and end > start and text[end - 1] == "\n":
            end -= 1
        at, n, escaped = self.escaped if self.escaped[0] == start else (start, 0, "")
        if end - start < n:
            n, escaped = 0, ""
        escaped += json.dumps(text[start + n:end], ensure_ascii=False)[1:-1]   # (a character at a time)
        self.escaped = (start, max(end - start, 0), escaped)
        return (", " if self.whole != "{" else "") + json.dumps(key.group(1).strip(), ensure_ascii=False) + ': "' + \
            escaped


class MarkedStream:
    """Mistral's calls as they are written, each `[TOOL_CALLS]name[ARGS]{...}` (the marker a token,
    the calls running to the reply's end): a call's name once its [ARGS] has come (CallStart), then
    its arguments as written (CallArgs), whitespace at their end held back until more follows; the
    call (its arguments stripped, as the family's parse reads them) once the next marker or the
    reply's end has come. A reply whose first call is written otherwise (the v0.3 list) is read whole
    at its end, as before (`close` gives None); a later part written otherwise is read alone then."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.at = 0                  # where the part being written begins in the body
        self.call: Optional[list] = None   # the call being written: id, name, where its arguments begin, sent
        self.started = False         # a call was passed on
        self.off = False             # the first call is not written so: nothing is passed on
        self.rest: list[str] = []    # parts after a call that are written otherwise

    def feed(self, body: str, final: bool = False) -> list[Piece]:
        out: list[Piece] = []
        while not self.off:
            j = body.find(self.MARKER, self.at)
            if j < 0:
                break
            self._part(body, self.at, j, True, out)
            self.at = j + len(self.MARKER)
        if not self.off:
            self._part(body, self.at, len(body) - (0 if final else _partial(body, [self.MARKER])), final, out)
        return out

    def close(self, body: str, closed: bool = True) -> Optional[list[Piece]]:
        out = self.feed(body, final=True)
        if not self.started:
            return None
        for part in self.rest:
            calls = self.fmt.parse(part)
            out.extend(calls if calls is not None else [Text("content", part)])
        return out

    def _part(self, body: str, start: int, end: int, whole: bool, out: list[Piece]) -> None:
        """The part body[start:end] (`whole`: nothing more will be added to it)."""
        if self.call is None:
            i = body.find("[ARGS]", start, end)
            if i < 0:
                part = body[start:end]
                if not self.started and (whole and part.strip() or part.lstrip()[:1] in ("[", "{")):
                    self.off = True   # not written so: the reply is read whole at its end
                elif self.started and whole and part.strip():
                    self.rest.append(part)
                return
            self.call = [self.fmt.make_id(), body[start:i].strip(), i + len("[ARGS]"), ""]
            self.started = True
            out.append(CallStart(self.call[0], self.call[1]))
        call_id, name, begin, sent = self.call
        args = body[begin:end].strip()
        if len(args) > len(sent):
            out.append(CallArgs(args[len(sent):]))
            self.call[3] = args
        if whole:
            out.append(streamed_call(call_id, name, args))
            self.call = None


class LeadingStream:
    """GLM-4-0414's call (the reply: a tool's name on its first line, its JSON arguments after it) as
    it is written: started once its arguments begin, they are passed on as written (whitespace at
    their end held back), the call (its arguments stripped, as the family's parse reads them) once
    the reply ends."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.call: Optional[list] = None   # id, name, where its arguments begin, how much was passed on

    def feed(self, body: str) -> list[Piece]:
        out: list[Piece] = []
        if self.call is None:
            line, sep, args = body.partition("\n")
            if not sep or not self.fmt.opens_call(line) or not args.lstrip().startswith("{"):
                return out
            self.call = [self.fmt.make_id(), line.strip(), len(body) - len(args.lstrip()), 0]
            out.append(CallStart(self.call[0], self.call[1]))
        args = body[self.call[2]:].rstrip()
        if len(args) > self.call[3]:
            out.append(CallArgs(args[self.call[3]:]))
            self.call[3] = len(args)
        return out

    def close(self, body: str, closed: bool = True) -> Optional[list[Piece]]:
        out = self.feed(body)
        if self.call is None:
            return None
        out.append(streamed_call(self.call[0], self.call[1], body[self.call[2]:].rstrip()))
        return out


_OBJECT_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


class ListedStream:
    """Calls written as JSON objects in a row (Llama 3.1's `{"name", "parameters"}` separated by ';';
    the lists of `{"name", "arguments"}` of Mistral's v0.3 and Phi-4-mini) read as they are written:
    an object that opens with its name and then its object of arguments is started once its
    arguments begin (CallStart), they are passed on as written (CallArgs), and the call comes once
    they close (its arguments as written); the rest of the object is skipped. An object written
    otherwise (keys in another order, arguments as a string) is read whole once it closes. A reply
    whose first object is not a call this way, or that is not JSON objects in a row, is read whole
    at its end as before (`close` gives None); after a call, text that is not is read alone then."""

    SEPARATORS = " \t\r\n,;[]"

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.state = "between"       # between | head | args | tail | stopped
        self.pos = 0                 # where the next object may begin (between), or the stopped text
        self.obj = 0                 # where the object being read begins
        self.scan, self.depth, self.in_string, self.escaped = 0, 0, False, False   # JSON read so far
        self.call: Optional[list] = None   # id, name, where its arguments begin, how much was passed on
        self.started = False
        self.off = False

    def feed(self, body: str) -> list[Piece]:
        out: list[Piece] = []
        while not self.off and self.state != "stopped":
            if self.state == "between":
                i = self.pos
                while i < len(body) and body[i] in self.SEPARATORS:
                    i += 1
                self.pos = i
                if i == len(body):
                    break
                if body[i] != "{":
                    self._stop()
                    break
                self.state, self.obj = "head", i
                self.scan, self.depth, self.in_string, self.escaped = i, 0, False, False
            if self.state == "head":
                head = _OBJECT_HEAD.match(body, self.obj)
                if head is None:
                    if not self._read(body, 0):
                        break
                    self._whole(body[self.obj:self.scan], out)   # closed, and not a call this reader takes
                    continue
                self.call = [self.fmt.make_id(), head.group(1), head.end(), 0]
                self.started = True
                out.append(CallStart(self.call[0], self.call[1]))
                self.state, self.scan, self.depth, self.in_string, self.escaped = "args", head.end(), 1, False, False
            if self.state == "args":
                closed = self._read(body, 1)
                self._pass_on(body, self.scan if closed else len(body), out)
                if not closed:
                    break
                self._call(body[self.call[2]:self.scan], out)
                self.state = "tail"
            if self.state == "tail":
                if not self._read(body, 0):
                    break
                self.pos, self.state = self.scan, "between"
        return out

    def close(self, body: str, closed: bool = True) -> Optional[list[Piece]]:
        """The calls and text left once the reply (or the calls' block) ended; None where none was
        started (the family's parse reads the whole)."""
        out = self.feed(body)
        if not self.started:
            return None
        if self.state == "args":   # cut short: its arguments as written, flagged
            self._call(body[self.call[2]:], out)
        elif self.state == "head":   # cut short before its arguments: a call only where its name was written
            cut = _loose_call(body[self.obj:], self.fmt.make_id)
            out.extend([cut] if cut is not None else [])
        elif self.state == "stopped":
            self._whole(body[self.pos:], out)
        return out

    def _stop(self) -> None:
        if self.started:
            self.state = "stopped"   # read alone at the end
        else:
            self.off = True

    def _whole(self, text: str, out: list[Piece]) -> None:
        """An object (or the text left) that is not a call this reader streams: its calls whole, or
        (after a call) the text as written; before any call the reply is read whole at its end."""
        if not self.started:
            self.off = True
            return
        calls = _list_calls(text, self.fmt.make_id)
        out.extend(calls if calls is not None else [Text("content", text)])
        self.pos, self.state = self.obj + len(text), "between"

    def _pass_on(self, body: str, upto: int, out: list[Piece]) -> None:
        start, sent = self.call[2], self.call[3]
        if upto - start > sent:
            out.append(CallArgs(body[start + sent:upto]))
            self.call[3] = upto - start

    def _call(self, args: str, out: list[Piece]) -> None:
        out.append(streamed_call(self.call[0], self.call[1], args))
        self.call = None

    def _read(self, body: str, until: int) -> bool:
        """Read JSON on from `scan`: True once a bracket brings the depth back to `until` (`scan`
        just past it), False at the text's end."""
        i, depth, in_string, escaped = self.scan, self.depth, self.in_string, self.escaped
        while True:
            if escaped:
                if i >= len(body):
                    break
                i, escaped = i + 1, False
                continue
            hit = (_IN_STRING if in_string else _OUTSIDE).search(body, i)
            if hit is None:
                i = len(body)
                break
            c, i = hit.group(0), hit.end()
            if in_string:
                in_string, escaped = c != '"', c == "\\"
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == until:
                    self.scan, self.depth, self.in_string, self.escaped = i, depth, False, False
                    return True
        self.scan, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        return False


def _before_tail(text: str) -> int:
    """Where what may close the call object rather than belong to the arguments (whitespace, a '}',
    whitespace) begins at the end of `text` (found from the end: a search from the start costs the
    whole text at every delta)."""
    end = len(text.rstrip())
    return len(text[:end - 1].rstrip()) if end and text[end - 1] == "}" else end


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
