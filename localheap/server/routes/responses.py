"""OpenAI's Responses API: POST /v1/responses, whole or streamed with its typed events. The same
sessions, heap, recall and prefix reuse as the chat route: the conversation is rendered by the
same chat template into the same prompt."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Callable, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ...engine import Delta, Finished, Job
from ...generation import LogprobRecorder, SamplingParams
from ..bridge import JobEvents, follow, watch_disconnect
from ..chat import start
from ..errors import Unsupported, to_response
from ..formats import extension, saved_headers
from ..prompts import chat_prompt, tokenize
from ..logonce import warn_once
from ..responses import Built, ResponsesRequest
from ..services import Services, owner, services
from ..toolcalls import OutputParser
from .openai import SESSION_HEADER, addressed_session

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, svc: Services = Depends(services),
                          x_session_id: Optional[str] = Depends(addressed_session)):
    svc.check_model(body.model)
    who = owner(request)
    svc.responses.resolve(body, who)
    bad = body.unsupported()
    if bad is not None:
        raise Unsupported(bad[1], bad[0])
    warn_once("hosted tools this server cannot run, left out of the prompt: %s", sorted(body.hosted_tools))
    plan = body.plan()
    opts = plan.options(svc)
    before = svc.responses.conversation(body.previous_response_id, who) if body.previous_response_id else []
    messages = body.chat_messages(before)
    prompt = await tokenize(chat_prompt, svc.tokenizer, messages, limit=svc.settings.max_prompt_tokens, opts=opts)
    default = min(svc.settings.default_max_tokens, svc.settings.max_tokens_limit)
    top = body.logprobs
    params = SamplingParams(max_tokens=body.max_output_tokens or default, temperature=body.temperature,
                            top_p=body.top_p, constraint=plan.constraint(svc, opts, prompt),
                            logprobs=None if top is None else LogprobRecorder(top))
    token_text = svc.token_text if top is not None else None
    title = next((m.text() for m in messages if m.role == "user"), None)
    # `store: false` (Codex sends it on every turn) keeps the session: OpenAI's store is about fetching
    # the response later, which this server never offers; the session is its prompt cache
    job, events, started = await start(svc, request, prompt, params, x_session_id, title)
    built = Built(body, svc.model_id, lambda text: len(svc.tokenizer.encode(text, add_special_tokens=False)))
    parser = plan.parser(opts, prompt)
    headers = {SESSION_HEADER: started.session_id}
    keep = (lambda whole: svc.responses.add(whole, body, who)) if body.store is not False else (lambda whole: None)
    if not body.stream:
        watcher = asyncio.create_task(watch_disconnect(request, job))   # the client gone: the job stops
        try:
            async for event in follow(job, events):
                if isinstance(event, Delta):
                    built.read(parser, event.text, event.logprobs, token_text)
                elif isinstance(event, Finished):
                    built.read(parser, None, None, token_text)
                    whole, _ = built.finish(event, extension(event))
                    keep(whole)
                    return JSONResponse(whole, headers={**headers, **saved_headers(event)})
        finally:
            watcher.cancel()
        raise RuntimeError("job ended without a Finished event")
    return EventSourceResponse(_stream(built, parser, job, events, started.session_id, keep, token_text),
                               headers=headers, sep="\n")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, svc: Services = Depends(services)) -> dict:
    return svc.responses.get(response_id, owner(request)).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, svc: Services = Depends(services)) -> dict:
    """Forget a kept response (its conversation's session stays: DELETE /v1/sessions/{id} for that)."""
    svc.responses.delete(response_id, owner(request))
    return {"id": response_id, "object": "response", "deleted": True}


async def _stream(built: Built, parser: OutputParser, job: Job, events: JobEvents, session_id: str,
                  keep: Callable[[dict], None], token_text=None) -> AsyncIterator[dict]:
    """response.created and .in_progress; per output item: added, its content part, its text or
    arguments in deltas, done; then response.completed (or .incomplete: max_output_tokens)."""
    yield _sse(built.event("response.created", response={**built.response("in_progress"),
                                                         "localheap": {"session_id": session_id}}))
    yield _sse(built.event("response.in_progress", response=built.response("in_progress")))
    first_token_at: Optional[float] = None
    try:
        async for event in follow(job, events):
            if isinstance(event, Delta):
                first_token_at = first_token_at or time.monotonic()
                for e in built.read(parser, event.text, event.logprobs, token_text):
                    yield _sse(e)
            elif isinstance(event, Finished):
                for e in built.read(parser, None, None, token_text):
                    yield _sse(e)
                decode_s = time.monotonic() - first_token_at if first_token_at is not None else None
                whole, ending = built.finish(event, extension(event, decode_s))
                keep(whole)
                for e in ending:
                    yield _sse(e)
    except Exception as e:   # headers are gone: an error event, as OpenAI sends one
        err = json.loads(to_response(e).body)["error"]
        yield _sse(built.event("error", code=err["code"], message=err["message"], param=err["param"]))


def _sse(event: dict) -> dict:
    return {"event": event["type"], "data": json.dumps(event, separators=(",", ":"))}

