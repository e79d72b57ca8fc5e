"""Session routes: list, inspect, create, delete, spill/restore, and document upload with
SSE prefill progress (a document longer than the heap streams through it in chunks)."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Optional

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ...engine import Feed, Finished, Job, Progress
from ..bridge import JobEvents, follow, submit
from ..errors import to_response
from ..formats import save_fields, saved_headers
from ...sessions.session import short_title
from ..prompts import document_prompt, tokenize
from ..schemas import DocumentRequest, SessionFields
from ..services import Services, owner, services
from . import api_router

router = api_router(prefix="/v1/sessions")
PROGRESS_INTERVAL_S = 0.1
CLIENT_HEADER = "X-Localheap-Client"   # "web": the web UI's own conversations; anything else is an API session


# A session is visible only to the API key that created it: another key's session answers
# 404 exactly like a missing one (with no keys configured, every session is everyone's).

@router.get("")
async def list_sessions(who: Optional[str] = Depends(owner), svc: Services = Depends(services)) -> dict:
    return {"object": "list", "data": sorted(svc.store.infos_of(who), key=lambda s: s["created"])}


@router.post("", status_code=201)
async def create_session(body: Optional[SessionFields] = None, who: Optional[str] = Depends(owner),
                         svc: Services = Depends(services), x_localheap_client: Optional[str] = Header(None)) -> dict:
    origin = "web" if x_localheap_client == "web" else "api"
    title = short_title(body.title or "") if body is not None else None
    session = await asyncio.wrap_future(
        svc.engine.call(lambda: svc.store.create(origin=origin, title=title, owner=who, strict=True)))
    return session.snapshot


@router.get("/{session_id}")
async def get_session(session_id: str, who: Optional[str] = Depends(owner), svc: Services = Depends(services)) -> dict:
    return svc.store.info(session_id, who)


@router.patch("/{session_id}")
async def update_session(session_id: str, body: SessionFields, who: Optional[str] = Depends(owner),
                         svc: Services = Depends(services)) -> dict:
    """Rename a session (title null: untitled again, named by its next message)."""
    svc.store.info(session_id, who)
    title = short_title(body.title or "")
    await asyncio.wrap_future(svc.engine.call(lambda: svc.store.set_title(session_id, title)))
    return svc.store.info(session_id, who)


@router.delete("/{session_id}")
async def delete_session(session_id: str, who: Optional[str] = Depends(owner),
                         svc: Services = Depends(services)) -> dict:
    svc.store.info(session_id, who)
    await asyncio.wrap_future(svc.engine.call(lambda: svc.engine.delete_session(session_id)))
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/stop")
async def stop_session(session_id: str, who: Optional[str] = Depends(owner),
                       svc: Services = Depends(services)) -> dict:
    """End the reply running on the session at its next token, its stream still read to its end
    ("interrupted": "stopped"), so the client has every token the session keeps (a client that just
    leaves misses those decoded before the server notices). "stopped": 0 where none was running."""
    svc.store.info(session_id, who)

    def stop() -> dict:   # (answered from here: a stopped session that keeps nothing is gone after its run)
        stopped = svc.engine.stop_session(session_id)
        return {**svc.store.info(session_id, who), "stopped": stopped}

    return await asyncio.wrap_future(svc.engine.call(stop))


@router.post("/{session_id}/spill")
async def spill_session(session_id: str, who: Optional[str] = Depends(owner),
                        svc: Services = Depends(services)) -> dict:
    """Save the session's heap to disk and free its memory (it comes back on next use)."""
    svc.store.info(session_id, who)
    await asyncio.wrap_future(svc.engine.call(lambda: svc.store.spill(session_id)))
    return svc.store.info(session_id, who)


@router.post("/{session_id}/restore")
async def restore_session(session_id: str, who: Optional[str] = Depends(owner),
                          svc: Services = Depends(services)) -> dict:
    svc.store.info(session_id, who)
    await asyncio.wrap_future(svc.engine.call(lambda: svc.store.restore(session_id)))
    return svc.store.info(session_id, who)


@router.post("/{session_id}/documents")
async def add_document(session_id: str, body: DocumentRequest, request: Request,
                       who: Optional[str] = Depends(owner), svc: Services = Depends(services)):
    svc.store.info(session_id, who)   # 404 before tokenizing a large document
    prompt = await tokenize(document_prompt, svc.tokenizer, body.text, body.role, body.raw,
                            limit=svc.settings.max_prompt_tokens)
    job, events, started = await submit(svc.engine, lambda emit: Feed(prompt, emit, session_id, who))
    await svc.name_session(started.session_id, body.name or body.text.strip().split("\n", 1)[0])
    if not body.stream:
        done = await _until_done(job, events)
        return JSONResponse(_done_body(done), headers=saved_headers(done))
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
    """tokens_added: what the session holds of the document (all of it, unless the run was stopped);
    tokens_total: the document's tokens."""
    return {"session_id": done.session_id, "tokens_added": done.prompt_read,
            "tokens_total": done.usage.prompt_tokens - done.usage.cached_tokens,
            "finish_reason": done.finish_reason, **save_fields(done), "session": done.session}
