"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ...engine import Delta, Finished, Job, Started
from ...generation import LogprobRecorder, SamplingParams
from ...sessions import Prompt
from ..bridge import JobEvents, collect, follow
from ..chat import ChatPlan, start
from ..errors import BadRequest, Unsupported, to_response
from ..formats import Reply, add_call_errors, extension, finish_reason, saved_headers, tool_call_dict
from ..prompts import chat_prompt, completion_prompt, tokenize
from ..schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from ..services import Services, services
from ..toolcalls import CallArgs, CallStart, OutputParser, Piece
from ..toolformats import ToolCall

router = APIRouter()
SESSION_HEADER = "X-Session-Id"


@router.get("/v1/models")
async def list_models(svc: Services = Depends(services)) -> dict:
    return {"object": "list", "data": [_model_card(svc)]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, svc: Services = Depends(services)) -> dict:
    svc.check_model(model)
    return _model_card(svc)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, svc: Services = Depends(services),
                           x_session_id: Optional[str] = Header(None)):
    _check(body, svc)
    plan = _plan(body)
    opts = plan.options(svc)
    prompt = await tokenize(chat_prompt, svc.tokenizer, body.messages, limit=svc.settings.max_prompt_tokens,
                            opts=opts)
    first_user = next((m.text() for m in body.messages if m.role == "user"), None)
    default = min(svc.settings.default_max_tokens, svc.settings.max_tokens_limit)
    params = _params(body, svc, body.limit(default), plan.constraint(svc, opts),
                     top_logprobs=body.top_logprobs or 0 if body.logprobs else None)
    reply = Reply("chat", svc.model_id, token_text=svc.token_text if body.logprobs else None)
    return await _respond(reply, body, prompt, params, request, svc, x_session_id, first_user,
                          plan.parser(opts, prompt))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, svc: Services = Depends(services),
                      x_session_id: Optional[str] = Header(None)):
    _check(body, svc)
    prompt = await tokenize(completion_prompt, svc.tokenizer, body, limit=svc.settings.max_prompt_tokens)
    text = body.prompt if isinstance(body.prompt, str) else None
    reply = Reply("text", svc.model_id, token_text=svc.token_text if body.logprobs is not None else None)
    params = _params(body, svc, body.max_tokens, top_logprobs=body.logprobs)
    return await _respond(reply, body, prompt, params, request, svc, x_session_id, text)


def _check(body, svc: Services) -> None:
    svc.check_model(body.model)
    bad = body.unsupported()
    if bad is not None:
        raise Unsupported(bad[1], bad[0])


def _plan(body: ChatCompletionRequest) -> ChatPlan:
    choice = body.tool_choice
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        choice = choice.function.name
    fmt = body.response_format
    schema = None
    if fmt is not None and fmt.type == "json_object":
        schema = {}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ or {}
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    return ChatPlan(tools, choice, body.parallel_tool_calls is not False, schema, body.chat_template_kwargs)


def _params(body: SamplingFields, svc: Services, max_tokens: int, constraint=None,
            top_logprobs: Optional[int] = None) -> SamplingParams:
    """The request's sampling; `top_logprobs` not None: each token's logprobs recorded, with that
    many alternatives."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    vocab = svc.backend.vocab_size
    if vocab is not None and bias and max(bias) >= vocab:
        raise BadRequest(f"logit_bias names token id {max(bias)}; this model's ids are 0..{vocab - 1}", "logit_bias")
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, seed=body.seed, stop=list(body.stop or []), constraint=constraint,
                          min_p=body.min_p, presence_penalty=body.presence_penalty or 0.0,
                          frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias,
                          logprobs=None if top_logprobs is None else LogprobRecorder(top_logprobs))


async def _respond(reply: Reply, body: SamplingFields, prompt: Prompt, params: SamplingParams, request: Request,
                   svc: Services, session_id: Optional[str], title: Optional[str],
                   parser: Optional[OutputParser] = None):
    ephemeral = body.store is False   # absent: kept, so the next turn reuses this one (see README)
    job, events, started = await start(svc, request, prompt, params, session_id, title, ephemeral)
    headers = {SESSION_HEADER: started.session_id}
    if not body.stream:
        text, done, logprobs = await collect(request, job, events)
        pieces = parser.feed(text) + parser.finish() if parser is not None else None
        return JSONResponse(reply.full(text, done, pieces, logprobs), headers={**headers, **saved_headers(done)})
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventSourceResponse(_stream(reply, job, events, started, usage, parser), headers=headers, sep="\n")


async def _stream(reply: Reply, job: Job, events: JobEvents, started: Started, usage: bool,
                  parser: Optional[OutputParser]) -> AsyncIterator[dict]:
    first_ext = {"session_id": started.session_id}
    first_token_at: Optional[float] = None
    calls = 0
    logprobs: list = []   # chat: entries whose tokens' text the parser holds back still
    try:
        if reply.kind == "chat":
            yield _data(reply.chunk("", first=True, extension=first_ext, with_usage_field=usage))
            first_ext = None
        async for event in follow(job, events):
            if isinstance(event, Delta):
                first_token_at = first_token_at or time.monotonic()
                if parser is None:
                    yield _data(reply.chunk(event.text, extension=first_ext, with_usage_field=usage,
                                            logprobs=event.logprobs))
                    first_ext = None
                    continue
                logprobs += event.logprobs or []
            if parser is not None and isinstance(event, (Delta, Finished)):   # chat: the reply in its parts
                for piece in parser.feed(event.text) if isinstance(event, Delta) else parser.finish():
                    chunk = _piece_chunk(reply, piece, calls, usage, logprobs)
                    if chunk is not None:
                        yield chunk
                        logprobs = []   # they went with it
                    calls += isinstance(piece, ToolCall)
            if isinstance(event, Finished):
                decode_s = time.monotonic() - first_token_at if first_token_at is not None else None
                ext = extension(event, decode_s)
                yield _data(reply.chunk(None, finish_reason(event, calls > 0), extension=ext, with_usage_field=usage,
                                        logprobs=logprobs))
                if usage:
                    yield _data(reply.usage_chunk(event.usage, ext))
    except Exception as e:   # headers are gone: report in the stream, as OpenAI does
        yield {"data": to_response(e).body.decode()}
    yield {"data": "[DONE]"}


def _piece_chunk(reply: Reply, piece: Piece, index: int, usage: bool, logprobs: list) -> Optional[dict]:
    """A reply piece as a chunk: content, reasoning_content, or a tool call (index: its place in the
    reply), whole or as it is written (its id and name, then its arguments in parts); it carries
    `logprobs` (the entries of the tokens read since the last chunk) unless it is None."""
    errors = _call_errors(piece, index)
    if isinstance(piece, ToolCall) and piece.streamed:
        if not errors:
            return None
        return _data(reply.chunk(None, delta={}, with_usage_field=usage, extension=errors, logprobs=logprobs))
    if isinstance(piece, ToolCall):
        delta = {"tool_calls": [tool_call_dict(piece, index)]}
    elif isinstance(piece, CallStart):
        delta = {"tool_calls": [{"index": index, "id": piece.id, "type": "function",
                                 "function": {"name": piece.name, "arguments": ""}}]}
    elif isinstance(piece, CallArgs):
        delta = {"tool_calls": [{"index": index, "function": {"arguments": piece.text}}]}
    else:
        delta = {"content" if piece.kind == "content" else "reasoning_content": piece.text}
    return _data(reply.chunk(None, delta=delta, with_usage_field=usage, extension=errors, logprobs=logprobs))


def _call_errors(piece: Piece, index: int) -> Optional[dict]:
    if not isinstance(piece, ToolCall) or piece.error is None:
        return None
    ext: dict = {}
    add_call_errors(ext, [piece], index)
    return ext


def _data(body: dict) -> dict:
    return {"data": json.dumps(body, separators=(",", ":"))}


def _model_card(svc: Services) -> dict:
    b = svc.backend
    return {"id": svc.model_id, "object": "model", "created": int(svc.started), "owned_by": "localheap",
            "localheap": {"backend": b.name, "weights_bytes": b.weights_bytes,
                          "heap": svc.settings.heap.to_dict(),
                          "heap_bytes_per_session": b.heap_bytes(svc.settings.heap)}}
