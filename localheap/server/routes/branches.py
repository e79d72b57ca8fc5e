"""Checkpoint and fork routes: save a session at its current point, start a new session from
a checkpoint (an edited or regenerated turn resumes there instead of re-reading a document)."""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import Depends
from pydantic import Field

from ..schemas import Strict
from ..services import Services, owner, services
from . import api_router

router = api_router(prefix="/v1/sessions")


class ForkRequest(Strict):
    """tokens: fork at the session's latest checkpoint at or before this many tokens;
    left out: at the session's current state (checkpointed now)."""
    tokens: Optional[int] = Field(default=None, ge=0)


@router.post("/{session_id}/checkpoint", status_code=201)
async def checkpoint_session(session_id: str, who: Optional[str] = Depends(owner),
                             svc: Services = Depends(services)) -> dict:
    svc.store.info(session_id, who)   # another key's session: 404
    c = await asyncio.wrap_future(svc.engine.call(lambda: svc.engine.checkpoint_session(session_id)))
    return {"object": "session.checkpoint", "session_id": session_id, "tokens": c.n,
            "session": svc.store.info(session_id, who)}


@router.post("/{session_id}/fork", status_code=201)
async def fork_session(session_id: str, body: Optional[ForkRequest] = None, who: Optional[str] = Depends(owner),
                       svc: Services = Depends(services)) -> dict:
    svc.store.info(session_id, who)   # another key's session: 404; the fork is the same key's
    tokens = body.tokens if body is not None else None
    s = await asyncio.wrap_future(svc.engine.call(lambda: svc.engine.fork_session(session_id, tokens)))
    return {**s.snapshot, "forked_from": {"session_id": session_id, "tokens": len(s.fed)}}
