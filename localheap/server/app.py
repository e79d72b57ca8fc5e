"""App factory: routes, error mapping, middleware, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import logging
import shutil
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ..engine import Engine, Governor, slotstate
from ..governor import MemoryPlan, default_budget, governor_for, plan_for
from ..governor.budget import request_room
from ..sessions import SessionStore, slotfiles
from . import errors
from .prompts import check_template
from .middleware import BodiesAreJson, CheckHost, CheckOrigin, LimitBody, RequireApiKey, checks_host
from .routes import (anthropic, branches, conversations, embeddings, observe, llamacpp, ollama, openai, responses,
                     sessions, tokenize)
from .services import Services
from .settings import ServerSettings
from .telemetry import ThroughputHistory, metrics_registry
from .webfiles import WebFiles


log = logging.getLogger("localheap.server")


def create_app(backend: Any, settings: Optional[ServerSettings] = None, governor: Optional[Governor] = None,
               on_close: Optional[Callable[[], None]] = None,
               on_start: Optional[Callable[[SessionStore], None]] = None) -> FastAPI:
    """The server for one loaded backend. The engine thread starts and stops with the app;
    `on_start(store)` runs once the saved sessions are read, before the engine starts
    (--distributed: the other ranks prune what no saved session holds); `on_close` runs last
    (the other ranks stop following)."""
    settings = settings or ServerSettings()
    check_template(backend.tokenizer)
    if settings.slot_save_path is not None:
        settings.slot_save_path = slotfiles.prepare_dir(settings.slot_save_path)
    if governor is None:
        plan = plan_for(backend, settings.heap, settings.ram_budget)   # BudgetTooSmall when nothing fits
        governor = governor_for(backend, plan)
    plan = getattr(governor, "plan", None)
    if settings.heap.recall and plan is not None and plan.recall_max_tokens and not settings.heap.recall_ram_tokens:
        # no session's page summaries outgrow what the budget holds with it alone resident
        settings.heap = settings.heap.with_(recall_ram_tokens=plan.recall_max_tokens)
    store = SessionStore(backend, settings.heap, settings.sessions_dir, durable=settings.persist_sessions,
                         max_resident=settings.max_resident_sessions, max_sessions=settings.max_sessions,
                         disk_total=settings.disk_total or 0, cache_reuse=settings.cache_reuse)
    engine = Engine(backend, store, governor, max_active=settings.max_active, max_queued=settings.max_queued,
                    admission_timeout=settings.admission_timeout, max_batch=settings.max_batch,
                    batched=None if settings.batched else False, mixed_chunk=settings.mixed_chunk,
                    lane=settings.prefill_lane if settings.batched else None)
    if settings.max_prompt_tokens is None:
        plan = getattr(governor, "plan", None)
        settings.max_prompt_tokens = (plan or MemoryPlan(0, 0, 0, 0, request_room(default_budget()))).max_prompt_tokens
    svc = Services(settings, backend, engine, store, governor, throughput=ThroughputHistory())
    svc.metrics = metrics_registry(svc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.persist_sessions:
            n = store.load_persisted(backend.model_name)
            store.checkpoints.load_persisted(store.sessions())
            if n:
                log.info("restored %d saved session(s) from %s", n, store.spill_dir)
            if on_start is not None:
                on_start(store)
            svc.responses   # the kept responses read back
            svc.conversations
            store.room_again()   # a directory found full at start: room made by recovery or --disk-total
        shutil.rmtree(store.checkpoints.root / slotstate.STAGING, ignore_errors=True)   # a crash's slot saves
        engine.start()
        sampler = asyncio.create_task(svc.throughput.run(svc))
        # the background responses a stopped server left unfinished run again
        resuming = asyncio.create_task(responses.resume_backgrounds(svc, responses.resumable_backgrounds(svc))) \
            if settings.persist_sessions else None
        try:
            yield
        finally:
            sampler.cancel()
            if resuming is not None:
                resuming.cancel()
            # cancels runs; the backend is this thread's from here on, unless the engine died
            # or is stuck: then the copies each finished turn left on disk are what survives
            if engine.stop() and settings.persist_sessions:
                n = store.persist_all(backend.model_name)
                log.info("saved %d session(s) to %s", n, store.spill_dir)
            store.close()
            if svc._backgrounds is not None and svc._backgrounds.progress is not None:
                svc._backgrounds.progress.close()   # (the files of those it runs on at the restart)
            for kept in (svc._responses, svc._conversations):
                if kept is not None:
                    kept.close()   # its queued writes done
            if on_close is not None:
                on_close()

    app = FastAPI(title="localheap", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.services = svc
    errors.install(app)
    for module in (openai, embeddings, responses, conversations, anthropic, ollama, llamacpp, sessions, branches,
                   tokenize, observe):
        app.include_router(module.router)
    app.add_middleware(LimitBody, max_bytes=settings.max_body_bytes)
    app.add_middleware(BodiesAreJson)
    origins = settings.own_origins + list(settings.cors_origins)   # what a browser page may call it from
    app.add_middleware(CheckOrigin, allowed=origins)
    if settings.keys:
        app.add_middleware(RequireApiKey, api_keys=settings.keys)
    app.add_middleware(CORSMiddleware, allow_origins=origins,
                       allow_methods=["GET", "POST", "PATCH", "DELETE", "OPTIONS"],
                       allow_headers=["Authorization", "Content-Type", "X-Session-Id", "X-Localheap-Client", "X-Api-Key",
                                      "Anthropic-Version", "Anthropic-Beta"],
                       expose_headers=["X-Session-Id", "Retry-After", "X-Localheap-Saved"])
    if checks_host(settings.host):
        app.add_middleware(CheckHost, bound_host=settings.host, extra=settings.allowed_hosts)   # outermost
    _mount_web(app, settings)
    return app


def _mount_web(app: FastAPI, settings: ServerSettings) -> None:
    """The web UI at / when the package ships one (localheap/web/index.html)."""
    if settings.web_dir is not None:
        app.mount("/", WebFiles(directory=settings.web_dir, html=True), name="web")
        return

    @app.get("/", include_in_schema=False)
    async def index() -> dict:
        return {"name": "localheap", "api": "/v1", "docs": "/docs", "heap_events": "/v1/heap/events"}
