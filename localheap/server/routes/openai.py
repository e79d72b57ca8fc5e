"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ...engine import Delta, Finished, Generate, Job, Started
from ...generation import SamplingParams
from ...sessions import Prompt
from ..bridge import JobEvents, collect, follow, submit
from ..errors import BadRequest, Unsupported, to_response
from ..formats import Reply, extension, finish_reason
from ..prompts import chat_prompt, completion_prompt, tokenize
from ..schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from ..services import Services, owner, services

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
    prompt = await tokenize(chat_prompt, svc.tokenizer, body.messages, limit=svc.settings.max_prompt_tokens)
    first_user = next((m.text() for m in body.messages if m.role == "user"), None)
    default = min(svc.settings.default_max_tokens, svc.settings.max_tokens_limit)
    return await _respond(Reply("chat", svc.model_id), body, prompt, body.limit(default),
                          request, svc, x_session_id, first_user)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, svc: Services = Depends(services),
                      x_session_id: Optional[str] = Header(None)):
    _check(body, svc)
    prompt = await tokenize(completion_prompt, svc.tokenizer, body, limit=svc.settings.max_prompt_tokens)
    text = body.prompt if isinstance(body.prompt, str) else None
    return await _respond(Reply("text", svc.model_id), body, prompt, body.max_tokens, request, svc, x_session_id, text)


def _check(body, svc: Services) -> None:
    svc.check_model(body.model)
    bad = body.unsupported()
    if bad is not None:
        raise Unsupported(bad[1], bad[0])


def _params(body: SamplingFields, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, seed=body.seed, stop=list(body.stop or []))


async def _respond(reply: Reply, body: SamplingFields, prompt: Prompt, max_tokens: int, request: Request,
                   svc: Services, session_id: Optional[str], title: Optional[str]):
    who = owner(request)
    ephemeral = body.store is False   # absent: kept, so the next turn reuses this one (see README)
    if session_id is not None:
        if ephemeral:
            raise BadRequest(f"\"store\": false runs in a session of its own that is not kept; it cannot continue "
                             f"session {session_id!r} (drop X-Session-Id or \"store\": false)", "store")
        svc.store.info(session_id, who)   # unknown id, or another key's: 404 before queueing
    if max_tokens > svc.settings.max_tokens_limit:   # one request must not hold the engine forever
        raise BadRequest(f"max_tokens {max_tokens} is over this server's limit of {svc.settings.max_tokens_limit}",
                         "max_tokens", "max_tokens_too_large")
    params = _params(body, max_tokens)
    job, events, started = await submit(svc.engine, lambda emit: Generate(prompt, params, emit, session_id, who,
                                                                               ephemeral=ephemeral))
    headers = {SESSION_HEADER: started.session_id}
    await svc.name_session(started.session_id, title)
    if not body.stream:
        text, done = await collect(request, job, events)
        return JSONResponse(reply.full(text, done), headers=headers)
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventSourceResponse(_stream(reply, job, events, started, usage), headers=headers, sep="\n")


async def _stream(reply: Reply, job: Job, events: JobEvents, started: Started, usage: bool) -> AsyncIterator[dict]:
    first_ext = {"session_id": started.session_id}
    first_token_at: Optional[float] = None
    try:
        if reply.kind == "chat":
            yield _data(reply.chunk("", first=True, extension=first_ext, with_usage_field=usage))
            first_ext = None
        async for event in follow(job, events):
            if isinstance(event, Delta):
                first_token_at = first_token_at or time.monotonic()
                yield _data(reply.chunk(event.text, extension=first_ext, with_usage_field=usage))
                first_ext = None
            elif isinstance(event, Finished):
                decode_s = time.monotonic() - first_token_at if first_token_at is not None else None
                ext = extension(event, decode_s)
                yield _data(reply.chunk(None, finish_reason(event), extension=ext, with_usage_field=usage))
                if usage:
                    yield _data(reply.usage_chunk(event.usage, ext))
    except Exception as e:   # headers are gone: report in the stream, as OpenAI does
        yield {"data": to_response(e).body.decode()}
    yield {"data": "[DONE]"}


def _data(body: dict) -> dict:
    return {"data": json.dumps(body, separators=(",", ":"))}


def _model_card(svc: Services) -> dict:
    b = svc.backend
    return {"id": svc.model_id, "object": "model", "created": int(svc.started), "owned_by": "localheap",
            "localheap": {"backend": b.name, "weights_bytes": b.weights_bytes,
                          "heap": svc.settings.heap.to_dict(),
                          "heap_bytes_per_session": b.heap_bytes(svc.settings.heap)}}
