"""Health, Prometheus metrics, and the live heap event stream for the web UI."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, PlainTextResponse
from sse_starlette import EventSourceResponse

from ..services import Services, services
from ..telemetry import heap_snapshot, prometheus

router = APIRouter()


@router.get("/health")
async def health(svc: Services = Depends(services)):
    """200 while the engine serves; 503 once it cannot (the process is exiting for a restart)."""
    body = {"status": "ok", "model": svc.model_id, "backend": svc.backend.name,
            "sessions": len(svc.store), "in_flight": svc.engine.in_flight}
    if not svc.engine.healthy:
        body["status"] = "failed"
        return JSONResponse(body, status_code=503)
    return body


@router.get("/metrics")
async def metrics(svc: Services = Depends(services)) -> PlainTextResponse:
    return PlainTextResponse(prometheus(svc), media_type="text/plain; version=0.0.4")


@router.get("/v1/heap/events")
async def heap_events(interval: float = Query(None, gt=0.0, le=60.0), svc: Services = Depends(services)):
    """SSE: event "heap" with every session's occupancy, memory and throughput; the first
    message also carries the history (sparklines, throughput samples) for a page just loaded."""
    period = interval or svc.settings.heap_events_interval

    async def events():
        first = True
        while True:
            yield {"event": "heap", "data": json.dumps(heap_snapshot(svc, with_history=first))}
            first = False
            await asyncio.sleep(period)

    return EventSourceResponse(events(), sep="\n")
