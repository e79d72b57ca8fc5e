"""Run the real server (uvicorn) in a background thread: for tests and notebooks."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI


class ServerThread:
    """`with ServerThread(app) as srv: srv.url` -> "http://127.0.0.1:PORT" (a free port)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.host = host
        self.port: Optional[int] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def services(self) -> Any:
        return self.app.state.services

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
