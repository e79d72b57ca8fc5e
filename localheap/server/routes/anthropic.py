"""Anthropic Messages API: POST /v1/messages (streamed with Anthropic's event types or not) and
POST /v1/messages/count_tokens. Same sessions, heap, recall and prefix reuse as the OpenAI routes:
the conversation is rendered by the same chat template into the same prompt."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ...engine import Delta, Finished, Job
from ...generation import SamplingParams, StopMatcher
from ..anthropic import (CountTokensRequest, MessagesRequest, call_error, content_block, merged, message_id,
                         stop_reason, tool_input, usage)
from ..bridge import JobEvents, follow, watch_disconnect
from ..chat import start
from ..errors import anthropic_body, to_response
from ..formats import save_fields, saved_headers
from ..prompts import chat_prompt, tokenize
from ..services import Services, services
from ..toolcalls import CallArgs, CallStart, OutputParser, Piece, Text
from ..toolformats import ToolCall
from . import api_router
from .openai import SESSION_HEADER, addressed_session

router = api_router()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, svc: Services = Depends(services)) -> dict:
    svc.check_model(body.model)
    plan = body.plan()
    prompt = await tokenize(chat_prompt, svc.tokenizer, body.chat_messages(), limit=svc.settings.max_prompt_tokens,
                            opts=plan.options(svc), continue_final=body.prefilled)
    return {"input_tokens": len(prompt.tokens)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, svc: Services = Depends(services),
                   x_session_id: Optional[str] = Depends(addressed_session)):
    svc.check_model(body.model)
    plan = body.plan()
    opts = plan.options(svc)
    msgs = body.chat_messages()
    prompt = await tokenize(chat_prompt, svc.tokenizer, msgs, limit=svc.settings.max_prompt_tokens, opts=opts,
                            continue_final=body.prefilled)
    # stop sequences are matched here, not in the engine: the reply must say which one stopped it
    params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, constraint=plan.constraint(svc, opts, prompt))
    title = next((m.text() for m in msgs if m.role == "user"), None)
    job, events, started = await start(svc, request, prompt, params, x_session_id, title)
    reader = Reader(job, plan.parser(opts, prompt), body.stop_sequences or [])
    headers = {SESSION_HEADER: started.session_id}
    head = {"id": message_id(), "type": "message", "role": "assistant", "model": svc.model_id}
    if not body.stream:
        body, done = await _whole(request, reader, events, head)
        return JSONResponse(body, headers={**headers, **saved_headers(done)})
    return EventSourceResponse(_stream(reader, events, head, started.session_id, started.prompt_tokens,
                                       started.cached_tokens), headers=headers, sep="\n")


class Reader:
    """A job's text as pieces (text, thinking, tool calls), cut at the first stop sequence in its
    text: the reply's content, not its thinking nor its tool calls' markup (a forced call that a
    stop sequence found in its JSON cut was lost)."""

    def __init__(self, job: Job, parser: OutputParser, stops: list[str]):
        self.job, self.parser = job, parser
        self.matcher = StopMatcher(stops)
        self.stop_sequence: Optional[str] = None

    async def pieces(self, events: JobEvents) -> AsyncIterator[Union[Piece, Finished]]:
        async for event in follow(self.job, events):
            if isinstance(event, Delta):
                if self.stop_sequence is None:
                    for p in self._cut(self.parser.feed(event.text)):
                        yield p
            elif isinstance(event, Finished):
                if self.stop_sequence is None:
                    for p in self._cut(self.parser.finish() + [None]):
                        yield p
                yield event

    def _cut(self, pieces: list[Optional[Piece]]) -> list[Piece]:
        """`pieces` up to a stop sequence in their content (None: the end, what is held back goes)."""
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, Text) and p.kind == "content":
                kept, stopped = self.matcher.feed(p.text)
                if kept:
                    out.append(Text("content", kept))
                if stopped:
                    self.stop_sequence = self.matcher.matched
                    self.job.cancel()   # the engine ends the run at its next step; the session keeps what it fed
                    return out
                continue
            held = self.matcher.flush()   # text held back as a stop's possible start: before what follows it
            if held:
                out.append(Text("content", held))
            if p is not None:
                out.append(p)
        return out


async def _whole(request: Request, reader: Reader, events: JobEvents, head: dict) -> tuple[dict, Finished]:
    watcher = asyncio.create_task(watch_disconnect(request, reader.job))
    pieces: list = []
    try:
        async for p in reader.pieces(events):
            if isinstance(p, Finished):
                done = p
            elif isinstance(p, (Text, ToolCall)):
                pieces.append(p)
    finally:
        watcher.cancel()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    body = {**head, "content": [content_block(p) for p in merged(pieces)],
            "stop_reason": stop_reason(done, bool(calls), reader.stop_sequence),
            "stop_sequence": reader.stop_sequence, "usage": usage(done)}
    errors = [e for i, c in enumerate(calls) if (e := call_error(c, i)) is not None]
    body["localheap"] = {"session_id": done.session_id, "heap": done.session.get("heap"), **save_fields(done),
                         **({"tool_call_errors": errors} if errors else {})}
    return body, done


async def _stream(reader: Reader, events: JobEvents, head: dict, session_id: str, prompt_tokens: int,
                  cached: int) -> AsyncIterator[dict]:
    """Anthropic's event sequence: message_start, then per content block content_block_start,
    its deltas and content_block_stop; message_delta (stop reason, usage); message_stop."""
    start_usage = {"input_tokens": prompt_tokens - cached, "output_tokens": 0, "cache_read_input_tokens": cached,
                   "cache_creation_input_tokens": 0}
    yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": start_usage}, "localheap": {"session_id": session_id}})
    yield _event("ping", {})
    index, open_kind, calls = -1, None, 0
    try:
        async for p in reader.pieces(events):
            if isinstance(p, Finished):
                if open_kind is not None:
                    yield _event("content_block_stop", {"index": index})
                delta = {"stop_reason": stop_reason(p, calls > 0, reader.stop_sequence),
                         "stop_sequence": reader.stop_sequence}
                yield _event("message_delta", {"delta": delta, "usage": {"output_tokens": p.usage.completion_tokens},
                                               "localheap": {"session_id": p.session_id, "heap": p.session.get("heap"),
                                                             **save_fields(p)}})
                yield _event("message_stop", {})
                return
            if isinstance(p, (CallStart, CallArgs)):
                continue   # a call goes out whole: the SDK parses each input_json_delta as it comes
            kind = "tool_use" if isinstance(p, ToolCall) else p.kind
            if kind != open_kind or kind == "tool_use":
                if open_kind is not None:
                    yield _event("content_block_stop", {"index": index})
                index, open_kind = index + 1, kind
                block = content_block(p)
                start = ({**block, "input": {}} if kind == "tool_use"
                         else {**block, "thinking" if kind == "reasoning" else "text": ""})
                extra = {}
                if isinstance(p, ToolCall) and (err := call_error(p, calls)) is not None:
                    extra = {"localheap": {"tool_call_errors": [err]}}
                yield _event("content_block_start", {"index": index, "content_block": start, **extra})
            if isinstance(p, ToolCall):
                calls += 1
                delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input(p))}
            elif isinstance(p, Text) and p.kind == "reasoning":
                delta = {"type": "thinking_delta", "thinking": p.text}
            else:
                delta = {"type": "text_delta", "text": p.text}
            yield _event("content_block_delta", {"index": index, "delta": delta})
    except Exception as e:   # headers are gone: an error event, as Anthropic sends one
        yield _event("error", anthropic_body(to_response(e)))


def _event(name: str, data: dict) -> dict:
    return {"event": name, "data": json.dumps({"type": name, **data}, separators=(",", ":"))}
