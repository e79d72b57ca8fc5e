"""Between the event loop and the engine thread: submit jobs, await their events, cancel
them when the client goes away. Nothing here blocks the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import Request

from ..engine import Delta, Emit, Engine, Event, Failed, Finished, Job, Started

log = logging.getLogger("localheap.server")
DISCONNECT_POLL_S = 0.2
MAX_BACKLOG = 1024   # events a job's client has not taken yet: past that it is not reading, and its request stops


class Mailbox:
    """Events from other threads into one event loop's queues, in the order they were posted,
    with one wake-up of the loop for all that arrive before it runs. A batched engine step emits a
    token for each of its rows; a wake-up each (`call_soon_threadsafe` writes to the loop's
    self-pipe, a system call that lets the loop's thread take a core and the GIL from the engine
    mid-step) cost ~0.15 ms apiece at 8 rows on two cores."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._posted: list = []
        self._waking = False   # a drain is scheduled and has not taken the posts yet

    def post(self, queue: asyncio.Queue, event: Event) -> None:   # any thread
        with self._lock:
            self._posted.append((queue, event))
            if self._waking:
                return
            self._waking = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except BaseException:   # the loop is closed: nobody reads these queues any more
            with self._lock:
                self._waking = False
            raise

    def _drain(self) -> None:   # the loop's thread
        with self._lock:
            posted, self._posted = self._posted, []
            self._waking = False
        for queue, event in posted:
            queue.put_nowait(event)


_MAILBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (one per loop, so that posts to all its queues share wake-ups)."""
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = Mailbox(loop)
        return box


class JobEvents:
    """One job's events, handed from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_backlog: int = MAX_BACKLOG):
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._mailbox = mailbox(loop)
        self.job: Optional[Job] = None   # (set once submitted)
        self.following = False           # its consumer reads it (follow): before that, a request's other choices
                                         # may still wait their turn, and its events wait for them, unread
        self.max_backlog = max_backlog
        self._posted = 0   # events posted (the engine thread's count) and taken (the loop's): each thread writes
        self._taken = 0    # its own, so their difference, the backlog, needs no lock

    def emit(self, event: Event) -> None:   # engine thread
        self._posted += 1
        behind = self._posted - self._taken
        self._mailbox.post(self.queue, event)
        if behind > self.max_backlog and self.following and self.job is not None and not self.job.cancelled:
            # a client that reads nothing (its socket full) would have the whole reply held here: it is
            # stopped as a client gone is, its session keeping what was generated
            log.warning("a client has not read its last %d events: its request is stopped", behind)
            self.job.cancel()

    async def get(self) -> Event:
        event = await self.queue.get()
        self._taken += 1
        return event


async def submit(engine: Engine, make: Callable[[Emit], object]) -> tuple[Job, JobEvents, Started]:
    """Submit a request and wait until the engine admits it: returns its Started event, or
    raises the error that stopped it (so the HTTP status can still say what went wrong)."""
    events = JobEvents(asyncio.get_running_loop())
    job = events.job = engine.submit(make(events.emit))
    try:
        first = await events.get()
    except BaseException:   # client gone while queued
        job.cancel()
        raise
    if isinstance(first, Failed):
        raise first.error
    assert isinstance(first, Started), first
    return job, events, first


async def follow(job: Job, events: JobEvents) -> AsyncIterator[Event]:
    """The job's events up to Finished; the job is cancelled if the consumer stops early
    (sse-starlette cancels the stream's generator when the client disconnects)."""
    events.following = True
    try:
        while True:
            event = await events.get()
            if isinstance(event, Failed):
                raise event.error
            yield event
            if isinstance(event, Finished):
                return
    finally:
        job.cancel()


async def merged(sources: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(i, item) from each of `sources` as they come, until all of them end; a source's error is
    raised here. Closing it cancels the sources still running (a client gone: each follow() in
    them cancels its job): use it under contextlib.aclosing."""
    arrived: asyncio.Queue = asyncio.Queue(maxsize=len(sources) * 64)   # (a reader that stops: the pumps wait,
    ended = object()                                                    # so its jobs' own backlogs stop them)

    async def pump(i: int, source: AsyncIterator) -> None:
        try:
            async for item in source:
                await arrived.put((i, item))
            await arrived.put((i, ended))
        except Exception as e:   # noqa: BLE001 - raised to the reader
            await arrived.put((i, e))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(pumps)
        while left:
            i, item = await arrived.get()
            if item is ended:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in pumps:
            task.cancel()


async def collect(request: Request, job: Job, events: JobEvents) -> tuple[str, Finished, Optional[list]]:
    """Run a job to the end for a non-streamed response, cancelling it if the client leaves:
    (text, Finished, the TokenLogprob entries of its tokens, or None where it has no recorder)."""
    watcher = asyncio.create_task(watch_disconnect(request, job))
    parts: list[str] = []
    logprobs: Optional[list] = None
    try:
        async for event in follow(job, events):
            if isinstance(event, Delta):
                parts.append(event.text)
                if event.logprobs is not None:
                    logprobs = [] if logprobs is None else logprobs
                    logprobs.extend(event.logprobs)
            elif isinstance(event, Finished):
                return "".join(parts), event, logprobs
        raise RuntimeError("job ended without a Finished event")
    finally:
        watcher.cancel()


async def watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client leaves (a non-streamed reply notices no broken pipe)."""
    while not job.done.is_set():
        if await request.is_disconnected():
            job.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)
