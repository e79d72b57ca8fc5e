"""OpenAI response bodies and stream chunks, as dicts. Each carries a `localheap` extension
field (session id and heap stats) that OpenAI SDKs keep as an extra attribute and ignore."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from ..engine import Finished, Usage
from ..generation import LogprobRecorder
from .logprobs import TokenText, chat_logprobs, completion_logprobs, echo_logprobs, joined
from .toolcalls import Piece, Text
from .toolformats import ToolCall


@dataclass
class Reply:
    """One response being built: chat ("chat.completion") or text ("text_completion"). With
    `token_text` the request asked for logprobs: the reply and its chunks carry them."""
    kind: str                 # "chat" | "text"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: Optional[TokenText] = None
    sent_chars: dict = field(default_factory=dict)   # choice -> a text stream's characters so far
    # choice -> where its next logprobs entry's token begins in its text (text_offset): the characters sent
    # before its first entry (an echo's prompt), then its entries' tokens' (text held back by a stop
    # string's match is not sent yet, though its tokens' entries are)
    token_chars: dict = field(default_factory=dict)
    post: bool = False        # post_sampling_probs: chat entries as llama-server writes them (prob, top_probs)
    custom: frozenset = frozenset()   # the names of the request's custom tools (their calls: {"custom": ...})
    forced: bool = False      # held to tool calls (tool_choice required or a name): content is null, never ""

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def _choice(self, text: Optional[str], finish: Optional[str], stream: bool, first: bool = False,
                index: int = 0) -> dict:
        if self.kind == "text":
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        if stream:
            delta = {"role": "assistant", "content": None if self.forced else text or ""} if first else \
                ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None, "finish_reason": finish}

    def logprobs(self, entries: Optional[list], index: int = 0) -> Optional[dict]:
        """A choice's `logprobs` for these entries (None where the request asked for none)."""
        if self.token_text is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.token_text, entries or [], self.post)
        at = self.token_chars.setdefault(index, self.sent_chars.get(index, 0))
        self.token_chars[index] = at + sum(len(self.token_text(e.token)[0]) for e in entries or [])
        return completion_logprobs(self.token_text, entries or [], at)

    def chunk(self, text: Optional[str], finish: Optional[str] = None, first: bool = False,
              extension: Optional[dict] = None, with_usage_field: bool = False, delta: Optional[dict] = None,
              logprobs: Optional[list] = None, index: int = 0) -> dict:
        """A stream chunk of choice `index`: `text` as content, or (chat) a `delta` of its own;
        `logprobs`: the TokenLogprob entries it carries."""
        body = self._head(self.chunk_object)
        choice = self._choice(text, finish, stream=True, first=first, index=index)
        if delta is not None:
            choice["delta"] = delta
        if logprobs:
            choice["logprobs"] = self.logprobs(logprobs, index)
        if self.kind == "text":
            self.sent_chars[index] = self.sent_chars.get(index, 0) + len(text or "")
        body["choices"] = [choice]
        if with_usage_field:
            body["usage"] = None
        if extension is not None:
            body["localheap"] = extension
        return body

    def echo_chunk(self, echo: "Echo", extension: Optional[dict] = None, with_usage_field: bool = False,
                   index: int = 0) -> dict:
        """A text stream's first chunk of choice `index` with `echo`: the prompt (and its logprobs)."""
        body = self.chunk(echo.text, extension=extension, with_usage_field=with_usage_field, index=index)
        body["choices"][0]["logprobs"] = self.echo_logprobs(echo)
        return body

    def echo_logprobs(self, echo: "Echo") -> Optional[dict]:
        if self.token_text is None:
            return None
        return echo_logprobs(self.token_text, echo.tokens, echo.entries(), echo.hidden)

    def usage_chunk(self, usage: Usage, extension: dict) -> dict:
        body = self._head(self.chunk_object)
        body.update(choices=[], usage=usage_dict(usage), localheap=extension)
        return body

    def full(self, outs: list["Out"], n: Optional[int] = None) -> dict:
        """The whole reply, a choice per Out (the first one's session in `localheap`; usage: each
        prompt once, `n` choices of each, every choice's completion tokens)."""
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        ext = extension(outs[0].done)
        choices = []
        for i, out in enumerate(outs):
            calls = [p for p in out.pieces or [] if isinstance(p, ToolCall)]
            choice = self._choice(out.text, finish_reason(out.done, bool(calls)), stream=False, index=i)
            choice["stop_reason"] = stop_reason(out.done)
            choice["logprobs"] = self.logprobs(out.logprobs, i)
            if out.echo is not None:   # (completions) the prompt first
                choice["text"] = out.echo.text + out.text
                if self.token_text is not None:
                    choice["logprobs"] = joined([self.echo_logprobs(out.echo),
                                                 completion_logprobs(self.token_text, out.logprobs or [],
                                                                     len(out.echo.text))])
            if out.pieces is not None:
                message = choice["message"]
                content = "".join(p.text for p in out.pieces if isinstance(p, Text) and p.kind == "content")
                message["content"] = content or (None if calls or self.forced else "")
                reasoning = "".join(p.text for p in out.pieces if isinstance(p, Text) and p.kind == "reasoning")
                if reasoning:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [tool_call_dict(c, custom=self.custom) for c in calls]
                    add_call_errors(ext, calls, custom=self.custom)
            choices.append(choice)
        body.update(choices=choices, usage=usage_dict(total_usage([out.done for out in outs], n)), localheap=ext)
        return body


@dataclass
class Echo:
    """A completion's echoed prompt: its text (as sent; ids sent: decoded), its tokens and, where
    logprobs were asked, the recorder of every token's but the first's (SamplingParams.prompt_logprobs)."""
    text: str
    tokens: list[int]
    scored: Optional[LogprobRecorder] = None
    hidden: int = 0   # leading tokens not in `text` (a BOS the server added to a text prompt)

    def entries(self) -> list:
        return [] if self.scored is None else [self.scored.get(i) for i in range(len(self.scored))]


@dataclass
class Out:
    """One choice's reply: its text, how it ended, its pieces (chat), logprobs (if asked) and echo
    (completions with echo)."""
    text: str
    done: Finished
    pieces: Optional[list[Piece]] = None
    logprobs: Optional[list] = None
    echo: Optional[Echo] = None


def total_usage(dones: list[Finished], n: Optional[int] = None) -> Usage:
    """n choices of each prompt (default: all of one prompt), in order: each prompt (and its reuse)
    counted once, every choice's tokens."""
    firsts = [d.usage for d in dones[::n or len(dones)]]
    return Usage(sum(u.prompt_tokens for u in firsts), sum(d.usage.completion_tokens for d in dones),
                 sum(u.cached_tokens for u in firsts))


def tool_call_dict(call: ToolCall, index: Optional[int] = None, custom: frozenset = frozenset()) -> dict:
    """A call as Chat Completions writes it: a function's, or (its name in `custom`) a custom tool's."""
    if call.name in custom:
        d = {"id": call.id, "type": "custom", "custom": {"name": call.name, "input": custom_input(call)[0]}}
    else:
        d = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


def custom_input(call: ToolCall) -> tuple[str, Optional[str]]:
    """A custom tool call's input from the arguments the model wrote ({"input": "..."}); arguments
    that do not read so come back whole, with the error, but for arguments that end inside the
    string (a call cut short): what was written of it."""
    try:
        if call.error is not None:
            raise ValueError(call.error)
        value = json.loads(call.arguments)
    except ValueError as e:
        read = InputStream()
        written = read.feed(call.arguments)
        return (written if read.at is not None and not read.ended else call.arguments), str(e)
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"], None
    return call.arguments, "a custom tool's arguments are an object with a string 'input'"


_INPUT_HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')


class InputStream:
    """A custom tool call's input as its arguments ({"input": "..."}) are written: `feed` gives the
    input's text decoded since the last feed (an escape is held back until it is whole, a surrogate
    pair's first half until its second could no longer come), nothing before the arguments read as
    {"input": " or after the string's closing quote. `rest(input)`: what the whole input
    (custom_input's) adds to what was given; None where it does not go on from it (arguments that did
    not read as {"input": "..."}: the input is then the arguments)."""

    def __init__(self) -> None:
        self.args = ""
        self.at: Optional[int] = None   # where the string's next character is in `args`
        self.sent = ""
        self.ended = False

    def feed(self, text: str) -> str:
        self.args += text
        if self.ended:
            return ""
        if self.at is None:
            head = _INPUT_HEAD.match(self.args)
            if head is None:
                self.ended = len(self.args) > 64 or not _may_open(self.args)
                return ""
            self.at = head.end()
        end = _WHOLE.match(self.args, self.at).end()
        tail = self.args[end:]
        self.ended = tail.startswith('"') or bool(tail) and not _PART_ESCAPE.match(tail)
        piece = json.loads(f'"{self.args[self.at:end]}"', strict=False)
        if not self.ended and _HIGH_HALF.match(self.args, end - 6, end) and "\ud800" <= piece[-1] <= "\udbff":
            piece, end = piece[:-1], end - 6   # a pair's first half, written \uXXXX
        self.at = end
        self.sent += piece
        return piece

    def rest(self, whole: str) -> Optional[str]:
        return whole[len(self.sent):] if whole.startswith(self.sent) else None


_WHOLE = re.compile(r'(?:[^"\\]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')   # characters and whole escapes
_PART_ESCAPE = re.compile(r'\\(?:u[0-9a-fA-F]{0,3})?\Z')                   # an escape not whole yet
_HIGH_HALF = re.compile(r'\\u[dD][89abAB][0-9a-fA-F]{2}\Z')


def _may_open(text: str) -> bool:
    """Whether `text` may still become {"input": " (whitespace aside)."""
    bare = re.sub(r"\s+", "", text)
    return '{"input":"'.startswith(bare)


def add_call_errors(ext: dict, calls: list[ToolCall], first_index: int = 0, custom: frozenset = frozenset()) -> None:
    """Calls whose arguments are not JSON (a custom tool's: not {"input": "..."}) are returned as
    written, and named here."""
    errors = [{"index": first_index + i, "id": c.id, "error": error} for i, c in enumerate(calls)
              if (error := custom_input(c)[1] if c.name in custom else c.error)]
    if errors:
        ext.setdefault("tool_call_errors", []).extend(errors)


def stop_reason(done: Finished):
    """vLLM's stop_reason: the stop string or stop_token_ids id that ended the reply; None where
    something else did (end of sequence, the limit, a tool call's end)."""
    return done.stop_word if done.stop_word is not None else done.stop_id


def finish_reason(done: Finished, tool_calls: bool = False) -> str:
    if tool_calls and done.finish_reason == "stop":
        return "tool_calls"
    return done.finish_reason if done.finish_reason in ("stop", "length") else "stop"


def usage_dict(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def extension(done: Finished, decode_s: Optional[float] = None) -> dict:
    """decode_s: seconds from the first streamed token to the last, timed on the server (a
    browser may receive a fast reply in one burst, which makes its own timing meaningless)."""
    ext = {"session_id": done.session_id, "session": {k: v for k, v in done.session.items() if k != "heap"},
           "heap": done.session.get("heap")}
    ext.update(save_fields(done))
    n = done.usage.completion_tokens
    if decode_s is not None and decode_s > 0 and n > 1:
        ext["speed"] = {"decode_tokens_per_s": round((n - 1) / decode_s, 1), "decode_seconds": round(decode_s, 3)}
    return ext


SAVED_HEADER = "X-Localheap-Saved"


def save_fields(done: Finished) -> dict:
    """What a reply says about its turn on disk: "saved" (absent where the server keeps nothing on
    disk), "save_error" when it is not saved, and, for a run the server stopped (SIGTERM), what
    was kept of it; a run stopped by its session's DELETE says so, and nothing was kept."""
    out: dict = {}
    if done.saved is not None:
        out["saved"] = done.saved
    if done.save_error is not None:
        out["save_error"] = done.save_error
    if done.interrupted is not None:
        out["interrupted"] = done.interrupted
    if done.interrupted == "shutdown":   # (a DELETE's session is gone: nothing was kept)
        out["kept"] = {"prompt_tokens_read": done.prompt_read,
                       "prompt_tokens": done.usage.prompt_tokens - done.usage.cached_tokens,
                       "completion_tokens": done.usage.completion_tokens,
                       "session_tokens": done.session.get("tokens")}
    return out


def saved_headers(done: Finished) -> dict:
    """X-Localheap-Saved on a whole (non-streamed) response; a stream's headers leave before its
    turn is saved, so a stream says it in its final event only."""
    return {} if done.saved is None else {SAVED_HEADER: "true" if done.saved else "false"}
