"""The prefill lane: a second thread that reads one prefill chunk at a time while the engine
thread steps the decode batch, so a document read and the chats beside it use two compute
streams (on a CPU, two cores) instead of sharing one.

Only the run whose chunk is in flight is the lane's: its session's cache is touched by nothing
else until the engine takes the chunk back (`take`), and the engine takes it back, waiting,
before anything that could touch that session (a command, a cancellation, shutdown) and
whenever no one decodes. The chunk is read exactly as the round-robin engine reads it
(backend.prefill), so the heap is what it would be alone. Knows nothing about HTTP or sessions
beyond the run it carries.

Threads: where the backend has intra-op threads (torch on the CPU), the lane and the engine thread
split them while a chunk is in flight (the lane half, the engine the rest), and the engine
thread takes them all back when the lane is idle, so the two never ask for more cores than the
process was given.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional


class PrefillLane:
    def __init__(self, backend: Any):
        self.backend = backend
        self.total = backend.get_threads() if hasattr(backend, "get_threads") else None
        lane = None if self.total is None else max(1, self.total // 2)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="localheap-prefill",
                                        initializer=None if lane is None else (lambda: backend.set_threads(lane)))
        self.run: Any = None                  # the Run whose chunk is in flight, if any
        self._chunk: list[int] = []
        self._future: Optional[Future] = None
        self._began = 0.0

    @property
    def busy(self) -> bool:
        return self.run is not None

    def submit(self, run: Any, chunk: list[int]) -> None:
        assert self.run is None, "one chunk in flight at a time"
        self.run, self._chunk, self._began = run, chunk, time.monotonic()
        self._future = self._pool.submit(self.backend.prefill, run.session.cache, chunk)

    def take(self, block: bool) -> Optional[tuple[Any, list[int], Optional[BaseException], float]]:
        """(run, chunk, error or None, seconds) of the chunk in flight once it is read (waiting
        for it with `block`); None when there is none, or it is still being read."""
        if self.run is None or (not block and not self._future.done()):
            return None
        error = self._future.exception()   # waits
        out = (self.run, self._chunk, error, time.monotonic() - self._began)
        self.run, self._chunk, self._future = None, [], None
        return out

    def engine_threads(self) -> None:
        """On the engine thread, before a step: the cores the lane leaves while a chunk is in
        flight, all of them otherwise."""
        if self.total is not None:
            self.backend.set_threads(max(1, self.total - self.total // 2) if self.busy else self.total)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
