"""Run the app under uvicorn with a shutdown that always ends.

SIGTERM or Ctrl-C: the server stops accepting connections and running requests get the grace
period; then the engine stops each run that is left at its next step, its session keeping (and
saving) what it read and wrote, and each stream ends with its final event saying so (the
`interrupted` and `kept` fields; a whole response likewise). uvicorn waits FINAL_S more for those
responses to go out, the lifespan saves sessions, and the process exits with status 0. A deadline
(grace + FINAL_S + SAVE_S) ends the process even when that shutdown is stuck. A dead engine makes
the server exit with status 1 within FATAL_GRACE_S + SAVE_S, so a supervisor can restart it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Callable, Iterator, Optional

import uvicorn
from fastapi import FastAPI
from sse_starlette.sse import AppStatus
from uvicorn.server import HANDLED_SIGNALS

from .settings import ServerSettings

SAVE_S = 20.0        # after the grace period: cancel runs and save sessions, at most this long
FINAL_S = 5.0        # after the grace period: the stopped runs' final events go out (their turns saved)
FATAL_GRACE_S = 2.0  # a dead engine has failed every open request: little left to wait for


class DeadlineServer(uvicorn.Server):
    """uvicorn whose shutdown has a deadline, armed by the first exit signal, and which stops the
    engine's runs at the end of the grace period so that each response ends with its final event."""
    deadline: Optional[threading.Timer] = None
    interrupt: Optional[threading.Timer] = None
    on_signal: Optional[Callable[[], None]] = None
    on_grace_end: Optional[Callable[[], None]] = None
    on_listening: Optional[Callable[[], None]] = None

    async def startup(self, sockets: Optional[list[socket.socket]] = None) -> None:
        """uvicorn's, then on_listening once the app has started and its sockets listen (a line that
        says where it serves comes when a client can connect there)."""
        await super().startup(sockets=sockets)
        if self.started and self.on_listening is not None:
            self.on_listening()

    def arm_deadline(self) -> None:
        if self.deadline is None:
            self.deadline = _exit_after(self.config.timeout_graceful_shutdown + SAVE_S)

    def handle_exit(self, sig, frame) -> None:
        self.arm_deadline()
        if self.on_signal is not None:
            self.on_signal()
        if self.interrupt is None and self.on_grace_end is not None:
            grace = max(0.0, self.config.timeout_graceful_shutdown - FINAL_S)
            self.interrupt = threading.Timer(grace, self.on_grace_end)
            self.interrupt.daemon = True
            self.interrupt.start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without raising the captured signal again once the shutdown is done: a
        clean shutdown exits with status 0, not killed by its own SIGTERM."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _exit_after(seconds: float) -> threading.Timer:
    def expire() -> None:
        print(f"localheap: shutdown still running after {seconds:.0f} s; exiting now", file=sys.stderr)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def serve_app(app: FastAPI, settings: ServerSettings, log_level: str = "info",
              sock: Optional[socket.socket] = None, on_listening: Optional[Callable[[], None]] = None) -> int:
    """Serve until a signal (0) or until the engine dies (1); on `sock` where given (bound: serve's
    --port 0), else on settings' host and port; on_listening is called once it listens."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=settings.shutdown_grace_s + FINAL_S)
    server = DeadlineServer(config)
    server.on_listening = on_listening
    svc = app.state.services
    engine = svc.engine
    # streams end with their final event (below), not when sse-starlette sees the signal
    AppStatus.disable_automatic_graceful_drain()

    def stopping() -> None:   # the signal handler
        svc.draining = True   # endless streams (the heap view) end now; requests run on for the grace period

    server.on_signal = stopping
    server.on_grace_end = lambda: engine.interrupt("shutdown")   # a timer thread

    def engine_failed(error: BaseException) -> None:   # on the engine thread
        config.timeout_graceful_shutdown = min(settings.shutdown_grace_s, FATAL_GRACE_S)
        server.arm_deadline()
        server.should_exit = True

    engine.on_fatal = engine_failed
    try:
        server.run(sockets=[sock] if sock is not None else None)
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it captured once shutdown is done: the shutdown was graceful
        pass
    finally:
        for timer in (server.deadline, server.interrupt):
            if timer is not None:   # the shutdown ended in time
                timer.cancel()
    if engine.failure is not None:
        print("localheap: the engine failed (see the log above); exiting with status 1", file=sys.stderr)
        return 1
    return 0
