"""Run the app under uvicorn with a shutdown that always ends.

SIGTERM or Ctrl-C: requests get the grace period, then uvicorn cancels them, the lifespan
cancels the engine's runs and saves sessions, and the process exits. A deadline (grace +
SAVE_S) ends the process even when that shutdown is stuck. A dead engine makes the server
exit with status 1 within FATAL_GRACE_S + SAVE_S, so a supervisor can restart it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional

import uvicorn
from fastapi import FastAPI

from .settings import ServerSettings

SAVE_S = 20.0        # after the grace period: cancel runs and save sessions, at most this long
FATAL_GRACE_S = 2.0  # a dead engine has failed every open request: little left to wait for


class DeadlineServer(uvicorn.Server):
    """uvicorn whose shutdown has a deadline, armed by the first exit signal."""
    deadline: Optional[threading.Timer] = None

    def arm_deadline(self) -> None:
        if self.deadline is None:
            self.deadline = _exit_after(self.config.timeout_graceful_shutdown + SAVE_S)

    def handle_exit(self, sig, frame) -> None:
        self.arm_deadline()
        super().handle_exit(sig, frame)


def _exit_after(seconds: float) -> threading.Timer:
    def expire() -> None:
        print(f"localheap: shutdown still running after {seconds:.0f} s; exiting now", file=sys.stderr)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def serve_app(app: FastAPI, settings: ServerSettings, log_level: str = "info") -> int:
    """Serve until a signal (0) or until the engine dies (1)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=settings.shutdown_grace_s)
    server = DeadlineServer(config)
    engine = app.state.services.engine

    def engine_failed(error: BaseException) -> None:   # on the engine thread
        config.timeout_graceful_shutdown = min(settings.shutdown_grace_s, FATAL_GRACE_S)
        server.arm_deadline()
        server.should_exit = True

    engine.on_fatal = engine_failed
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it captured once shutdown is done: the shutdown was graceful
        pass
    finally:
        if server.deadline is not None:   # the shutdown ended in time
            server.deadline.cancel()
    if engine.failure is not None:
        print("localheap: the engine failed (see the log above); exiting with status 1", file=sys.stderr)
        return 1
    return 0
