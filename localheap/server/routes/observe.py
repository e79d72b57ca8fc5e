"""Health, Prometheus metrics, and the live heap event stream for the web UI."""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from fastapi import Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse

from ..errors import TooManyObservers
from ..services import Services, owner, services
from ..telemetry import heap_snapshot, prometheus
from . import api_router

router = api_router()
MIN_INTERVAL_S = 0.1   # below this a stream costs real CPU and slows decode for everyone


@router.get("/health")
async def health(svc: Services = Depends(services)):
    """200 while the engine serves ("degraded" with the reasons when something is lost, e.g. a
    session's page-out fails); 503 once it cannot (the process is exiting for a restart)."""
    body = {"status": "ok", "model": svc.model_id, "backend": svc.backend.name,
            "sessions": len(svc.store), "in_flight": svc.engine.in_flight}
    degraded = sorted(svc.store.degraded.values())
    if degraded:
        body["status"], body["degraded"] = "degraded", degraded
    ranks = getattr(svc.backend, "ranks", None)   # --distributed: the ranks, and a lost one
    if ranks is not None:
        body["ranks"] = {"size": ranks.size, "mode": svc.backend.mode, "lost": getattr(svc.backend, "lost", None),
                         "failed_calls": getattr(svc.backend, "failures", 0),   # RankFailed: the ranks went on
                         "last_failure": getattr(svc.backend, "last_failure", None)}
    if not svc.engine.healthy or (ranks is not None and body["ranks"]["lost"]):
        body["status"] = "failed"
        return JSONResponse(body, status_code=503)
    return body


@router.get("/metrics")
async def metrics(svc: Services = Depends(services)) -> Response:
    return Response(prometheus(svc.metrics), media_type=CONTENT_TYPE_LATEST)


class ObserverStream(EventSourceResponse):
    """An SSE response that gives its observer slot back however the stream ends."""

    def __init__(self, svc: Services, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.svc = svc

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.svc.observers -= 1


@router.get("/v1/heap/events")
async def heap_events(request: Request, svc: Services = Depends(services),
                      interval: Optional[float] = Query(None, ge=MIN_INTERVAL_S, le=60.0)):
    """SSE: event "heap" with the caller's sessions' occupancy, memory and throughput; the
    first message also carries the history (sparklines, throughput samples) for a page just loaded."""
    period = interval or svc.settings.heap_events_interval
    if svc.observers >= svc.settings.max_observers:
        raise TooManyObservers(f"{svc.observers} heap event streams are open (limit {svc.settings.max_observers}); "
                               f"close one or retry later")
    who = owner(request)
    svc.observers += 1   # event loop only: no lock needed

    async def events():
        first = True
        while not svc.draining:
            yield {"event": "heap", "data": json.dumps(heap_snapshot(svc, who, with_history=first))}
            first = False
            slept = 0.0
            while slept < period and not svc.draining:   # a shutdown ends the stream within MIN_INTERVAL_S
                await asyncio.sleep(min(MIN_INTERVAL_S, period - slept))
                slept += MIN_INTERVAL_S

    return ObserverStream(svc, events(), sep="\n")
