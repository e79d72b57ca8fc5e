"""Background responses (POST /v1/responses with `background: true`): the request is answered at
once (status "queued"), the reply runs on with no client attached, and GET /v1/responses/{id}
polls it, streams it again from any event (`?stream=true&starting_after=N`), POST
/v1/responses/{id}/cancel stops it. A response is kept (ResponseLog) when it is queued, with its
request, and again when it ends, so a server stopped in between runs it again at its restart
(routes/responses.resume_backgrounds; RUNS times in all at most, then it reads back "failed").

Event loop only."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import AsyncIterator, Optional

from .responses import UNFINISHED, Built

KEEP_FINISHED = 64   # ended runs whose events stay in memory for a stream read again
RUN_EVENTS = 10 ** 9   # run k (after k - 1 restarts) numbers its events from (k - 1) * RUN_EVENTS


class Run:
    """One background response: its stream's events so far, in order (an event's index is its
    sequence_number less `first`, its run's first; each kept as the SSE message it is sent as: an
    event's response is the one of its moment), its status, the job once the engine admitted it."""

    def __init__(self, built: Built, owner: Optional[str]):
        self.built, self.owner = built, owner
        self.first = built.sequence
        self.events: list[dict] = []
        self.status = "queued"
        self.body: Optional[dict] = None   # the whole response once it ended
        self.extra: dict = {}              # the `localheap` fields while it runs (its session)
        self.job = None
        self.task: Optional[asyncio.Task] = None
        self.cancel_asked = False
        self._changed = asyncio.Event()

    @property
    def id(self) -> str:
        return self.built.id

    @property
    def ended(self) -> bool:
        return self.status not in UNFINISHED

    def snapshot(self) -> dict:
        """The response as it stands (its output so far while it runs)."""
        if self.body is not None:
            return self.body
        body = self.built.response(self.status)
        if self.extra:
            body["localheap"] = dict(self.extra)
        return body

    def push(self, events: list[dict], status: Optional[str] = None) -> None:
        """Events appended (and a new status), the readers woken."""
        self.events += [sse(e) for e in events]
        if status is not None:
            self.status = status
        self._changed.set()
        self._changed = asyncio.Event()

    def end(self, body: dict, events: list[dict]) -> None:
        self.body = body
        self.push(events, body["status"])

    def cancel(self) -> None:
        """Stop it: the job cancelled (the engine ends it at its next step, keeping what it
        generated, as for a client gone), or, still queued, the wait for the engine given up."""
        self.cancel_asked = True
        if self.job is not None:
            self.job.cancel()
        elif self.task is not None:
            self.task.cancel()

    async def wait_end(self, timeout: float) -> None:
        """Until it has ended, or `timeout` seconds."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while not self.ended and loop.time() < until:
            try:
                await asyncio.wait_for(self._changed.wait(), until - loop.time())
            except asyncio.TimeoutError:
                return

    async def read(self, after: int = -1) -> AsyncIterator[dict]:
        """The SSE messages of the events after sequence number `after`, then each as it comes,
        until it ends. A reader that leaves changes nothing: the reply runs on."""
        at = max(0, after + 1 - self.first)
        while True:
            changed = self._changed
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.ended:
                return
            await changed.wait()


def sse(event: dict) -> dict:
    """A Responses stream event as its server-sent message."""
    return {"event": event["type"], "data": json.dumps(event, separators=(",", ":"))}


class Backgrounds:
    """The background responses running, and the latest KEEP_FINISHED ended ones (their events)."""

    def __init__(self, keep_finished: int = KEEP_FINISHED):
        self.keep_finished = keep_finished
        self._runs: OrderedDict[str, Run] = OrderedDict()

    def add(self, run: Run) -> None:
        self._runs[run.id] = run

    def get(self, response_id: str, owner: Optional[str]) -> Optional[Run]:
        run = self._runs.get(response_id)
        return run if run is not None and run.owner == owner else None

    def ended(self, run: Run) -> None:
        """`run` ended: the oldest ended runs past keep_finished are let go (GET reads them from
        the ResponseLog; their events are gone)."""
        self._runs.move_to_end(run.id)
        done = [rid for rid, r in self._runs.items() if r.ended]
        for rid in done[:max(0, len(done) - self.keep_finished)]:
            del self._runs[rid]

    @property
    def running(self) -> int:
        return sum(not r.ended for r in self._runs.values())
