"""Session routes: list, inspect, create, delete, spill/restore, and document upload with
SSE prefill progress (a document longer than the heap streams through it in chunks)."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from ...engine import Feed, Finished, Job, Progress
from ..bridge import JobEvents, follow, submit
from ..errors import to_response
from ..prompts import document_prompt
from ..schemas import DocumentRequest, SessionFields
from ..services import Services, services
from ...sessions.session import short_title

router = APIRouter(prefix="/v1/sessions")
PROGRESS_INTERVAL_S = 0.1
CLIENT_HEADER = "X-Localheap-Client"   # "web": the web UI's own conversations; anything else is an API session


@router.get("")
async def list_sessions(svc: Services = Depends(services)) -> dict:
    return {"object": "list", "data": sorted(svc.store.infos(), key=lambda s: s["created"])}


@router.post("", status_code=201)
async def create_session(body: Optional[SessionFields] = None, svc: Services = Depends(services),
                         x_localheap_client: Optional[str] = Header(None)) -> dict:
    origin = "web" if x_localheap_client == "web" else "api"
    title = short_title(body.title or "") if body is not None else None
    session = await asyncio.wrap_future(svc.engine.call(lambda: svc.store.create(origin=origin, title=title)))
    return session.snapshot


@router.get("/{session_id}")
async def get_session(session_id: str, svc: Services = Depends(services)) -> dict:
    return svc.store.info(session_id)


@router.patch("/{session_id}")
async def update_session(session_id: str, body: SessionFields, svc: Services = Depends(services)) -> dict:
    """Rename a session (title null: untitled again, named by its next message)."""
    title = short_title(body.title or "")
    await asyncio.wrap_future(svc.engine.call(lambda: svc.store.set_title(session_id, title)))
    return svc.store.info(session_id)


@router.delete("/{session_id}")
async def delete_session(session_id: str, svc: Services = Depends(services)) -> dict:
    await asyncio.wrap_future(svc.engine.call(lambda: svc.engine.delete_session(session_id)))
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/spill")
async def spill_session(session_id: str, svc: Services = Depends(services)) -> dict:
    """Save the session's heap to disk and free its memory (it comes back on next use)."""
    await asyncio.wrap_future(svc.engine.call(lambda: svc.store.spill(session_id)))
    return svc.store.info(session_id)


@router.post("/{session_id}/restore")
async def restore_session(session_id: str, svc: Services = Depends(services)) -> dict:
    await asyncio.wrap_future(svc.engine.call(lambda: svc.store.restore(session_id)))
    return svc.store.info(session_id)


@router.post("/{session_id}/documents")
async def add_document(session_id: str, body: DocumentRequest, request: Request, svc: Services = Depends(services)):
    svc.store.info(session_id)   # 404 before tokenizing a large document
    prompt = await run_in_threadpool(document_prompt, svc.tokenizer, body.text, body.role, body.raw)
    job, events, started = await submit(svc.engine, lambda emit: Feed(prompt, emit, session_id))
    await svc.name_session(started.session_id, body.name or body.text.strip().split("\n", 1)[0])
    if not body.stream:
        done = await _until_done(job, events)
        return JSONResponse(_done_body(done))
    return EventSourceResponse(_progress_stream(job, events), sep="\n")


async def _until_done(job: Job, events: JobEvents) -> Finished:
    async for event in follow(job, events):
        if isinstance(event, Finished):
            return event
    raise RuntimeError("job ended without a Finished event")


async def _progress_stream(job: Job, events: JobEvents) -> AsyncIterator[dict]:
    """event: progress {done, total} at most every PROGRESS_INTERVAL_S, then event: done."""
    loop = asyncio.get_running_loop()
    sent_at = 0.0
    try:
        async for event in follow(job, events):
            if isinstance(event, Progress):
                now = loop.time()
                if now - sent_at >= PROGRESS_INTERVAL_S or event.done == event.total:
                    sent_at = now
                    yield {"event": "progress", "data": json.dumps({"done": event.done, "total": event.total})}
            elif isinstance(event, Finished):
                yield {"event": "done", "data": json.dumps(_done_body(event))}
    except Exception as e:
        yield {"event": "error", "data": to_response(e).body.decode()}


def _done_body(done: Finished) -> dict:
    return {"session_id": done.session_id, "tokens_added": done.usage.prompt_tokens - done.usage.cached_tokens,
            "finish_reason": done.finish_reason, "session": done.session}
