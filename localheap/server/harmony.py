"""gpt-oss's harmony format: a reply is a run of messages, each a header and a body.

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The analysis channel is reasoning; final (and commentary with no recipient: a preamble the user
sees) is content; a message addressed `to=functions.NAME` (in its header, before or after the
channel) is a tool call whose body is its JSON arguments. A message to one of gpt-oss's built-in
tools (`to=python`, `to=browser.search`: none a client offers here) is read by its channel.
<|call|> and <|return|> end the reply (they are the model's stop tokens, so a reply's text rarely
holds them); <|end|> ends a message.
The prompt ends with `<|start|>assistant`, so a reply begins with a header.
"""

from __future__ import annotations

import re
from typing import Optional

from .toolcalls import CallArgs, CallStart, Piece, StepParser, Text, _partial, streamed_call
from .toolformats import openai_call_id

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
# A header longer than this with no <|message|> is not one: the model is writing plain text
MAX_HEADER = 256
_MARKUP = re.compile(r"<\|(?:start|channel|message|end|constrain|call|return)\|>")


class HarmonyParser(StepParser):
    """OutputParser's interface (feed text, finish; pieces in order) for harmony replies.

    `tools`: calls addressed to functions are tool calls (else their bodies are content).
    `forced`: the grammar holds the reply to a call, so text outside messages is dropped."""

    def __init__(self, tools: bool = True, forced: bool = False):
        self.tools = tools
        self.forced = forced
        self.mode = "header"     # header | body
        self.pending = ""
        self.kind = "content"    # the body's: content | reasoning | call
        self.call: Optional[list] = None   # id, name, arguments so far

    def finish(self) -> list[Piece]:
        out = self._drain(final=True)
        if self.mode == "body":
            self._body(self.pending, out)
            self._close(out)
        elif self.pending.strip() and not self.forced:   # text that never became a message
            self._emit("content", _MARKUP.sub("", self.pending), out)
        self.pending = ""
        return [p for p in out if not isinstance(p, Text) or p.text]

    def _step(self, out: list[Piece], final: bool) -> bool:
        if self.mode == "header":
            i = self.pending.find(MESSAGE)
            if i < 0:
                if len(self.pending) > MAX_HEADER and not _partial(self.pending, [MESSAGE]):
                    self._open("", out)   # plain text where a header should be: content, as written
                    return True
                return False
            self._open(self.pending[:i], out)
            self.pending = self.pending[i + len(MESSAGE):]
            return True
        ends = [(self.pending.find(m), m) for m in BODY_ENDS]
        hit = min(((i, m) for i, m in ends if i >= 0), default=None)
        if hit is None:
            keep = 0 if final else _partial(self.pending, list(BODY_ENDS))
            self._body(self.pending[:len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        i, marker = hit
        self._body(self.pending[:i], out)
        self.pending = self.pending[i + len(marker):]
        self._close(out)
        return True

    def _open(self, header: str, out: list[Piece]) -> None:
        """A message begins: what its header says it is."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.mode = "body"
        if recipient is not None and recipient.group(1).startswith("functions.") and self.tools:
            name = recipient.group(1)[len("functions."):]
            self.kind, self.call = "call", [openai_call_id(), name, ""]
            out.append(CallStart(self.call[0], name))
        elif channel is not None and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"
            if channel is None and recipient is None:   # not a header at all: its text is content
                self._emit("content", _MARKUP.sub("", header), out)

    def _body(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.kind == "call":
            self.call[2] += text
            out.append(CallArgs(text))
        else:
            self._emit(self.kind, text, out)

    def _close(self, out: list[Piece]) -> None:
        """A message ends (or the reply does): a call is complete."""
        if self.kind == "call":
            out.append(streamed_call(*self.call))   # its arguments as streamed
        self.mode, self.kind, self.call = "header", "content", None

    def _emit(self, kind: str, text: str, out: list[Piece]) -> None:
        if not text or (self.forced and kind == "content"):
            return
        if out and isinstance(out[-1], Text) and out[-1].kind == kind:
            out[-1].text += text
        else:
            out.append(Text(kind, text))
