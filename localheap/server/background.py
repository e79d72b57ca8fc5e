"""Background responses (POST /v1/responses with `background: true`): the request is answered at
once (status "queued"), the reply runs on with no client attached, and GET /v1/responses/{id}
polls it, streams it again from any event (`?stream=true&starting_after=N`), POST
/v1/responses/{id}/cancel stops it. A response is kept (ResponseLog) when it is queued, with its
request, and again when it ends; meanwhile its events and the reply's pieces go to a file of its
own (Progress), so a server stopped or crashed in between goes on with it at its restart from the
last piece kept (routes/responses.resume_backgrounds; unless it was stopped in RUNS runs in a row
that kept nothing more of its reply: it then reads back "failed"). An event reaches a reader once
its line is fsynced: no crash, even of the machine, takes an event a reader saw.

Event loop only (but Progress's fsyncs and deletes, on the responses' writer thread)."""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import os
import random
import threading
from collections import OrderedDict
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

from ..heap.private import open_private
from ..sessions.disk import fsync_fd
from .ids import seeded
from .jsonlines import FileBacked
from .responses import UNFINISHED, Built

log = logging.getLogger("localheap.server")

KEEP_FINISHED = 64   # ended runs whose events stay in memory for a stream read again
RUN_EVENTS = 10 ** 9   # run k (after k - 1 restarts) numbers its events from (k - 1) * RUN_EVENTS


class Run:
    """One background response: its stream's events so far, in order (each kept as the SSE message
    it is sent as: an event's response is the one of its moment; `numbers` their sequence numbers:
    those of earlier runs kept, then this run's from `first`; `visible` of them a reader may be sent:
    those on the disk, or never to be kept), its status, the job once the engine admitted it. `ids`:
    the source of its items' and calls' ids (ids.SOURCE in its task)."""

    def __init__(self, built: Built, owner: Optional[str]):
        self.built, self.owner = built, owner
        self.first = built.sequence
        self.events: list[dict] = []
        self.numbers: list[int] = []
        self.visible = 0
        self.ids: random.Random = seeded(built.id)
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

    def push(self, events: list[dict], status: Optional[str] = None, synced: bool = True) -> None:
        """Events appended (and a new status), the readers woken; unless `synced`, its readers are
        sent them once `synced_to` says their line is on the disk (with those before them)."""
        self.events += [sse(e) for e in events]
        self.numbers += [e["sequence_number"] for e in events]
        if synced:
            self.visible = len(self.events)
        if status is not None:
            self.status = status
        self._wake()

    def synced_to(self, mark: int) -> None:
        """The first `mark` events are on the disk: readers may be sent them."""
        if mark > self.visible:
            self.visible = min(mark, len(self.events))
            self._wake()

    def end(self, body: dict, events: list[dict], synced: bool = True) -> None:
        self.body = body
        self.push(events, body["status"], synced)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

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

    def lost(self, after: int) -> bool:
        """Whether event `after` was sent by an earlier run and not kept (those a stopping server
        sends as it stops): the events after it are not known."""
        if after < 0 or after >= self.first - 1:
            return False
        at = bisect.bisect_left(self.numbers, after)
        return at == len(self.numbers) or self.numbers[at] != after

    async def read(self, after: int = -1) -> AsyncIterator[dict]:
        """The SSE messages of the events after sequence number `after`, then each as it comes
        (once on the disk), until it ends. A reader that leaves changes nothing: the reply runs on."""
        at = bisect.bisect_right(self.numbers, after)
        while True:
            changed = self._changed
            while at < self.visible:
                yield self.events[at]
                at += 1
            if self.ended and at >= len(self.events):
                return
            await changed.wait()


def sse(event: dict) -> dict:
    """A Responses stream event as its server-sent message."""
    return {"event": event["type"], "data": json.dumps(event, separators=(",", ":"))}


class Backgrounds:
    """The background responses running, and the latest KEEP_FINISHED ended ones (their events)."""

    def __init__(self, keep_finished: int = KEEP_FINISHED, progress: Optional["Progress"] = None):
        self.keep_finished = keep_finished
        self.progress = progress   # None: in memory (a restart does not run them again)
        self._runs: OrderedDict[str, Run] = OrderedDict()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        if progress is not None:
            progress.on_synced = self._synced

    def add(self, run: Run) -> None:
        self._runs[run.id] = run
        try:
            self._loop = asyncio.get_running_loop()   # (the server's: where its runs' readers wait)
        except RuntimeError:
            pass

    def _synced(self, response_id: str, mark: int) -> None:
        """(The writer thread) `response_id`'s first `mark` events are on the disk."""
        def show() -> None:
            run = self._runs.get(response_id)
            if run is not None:
                run.synced_to(mark)
        try:
            self._loop.call_soon_threadsafe(show)
        except (AttributeError, RuntimeError):   # no loop yet, or closed (the server stopped)
            pass

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


OPEN_FILES = 32   # Progress keeps this many files open at most (macOS gives a process 256 descriptors)


class Progress:
    """What each background response has done so far, in a file of its own (`directory`/<id>.jsonl):
    a line per change, each {"e": the events it sent} with {"d": [text, ids, logprobs]}, the Delta
    they came of (logprobs as [[id, logprob, [[id, logprob], ...]], ...] or null), or {"x": the
    response's `localheap` fields}. A line is written (to the system's file cache), then fsynced on
    the kept responses' writer thread (`log`), lines written meanwhile with one fsync; `on_synced(id,
    mark)` then says so, with the `mark` its last line was added with (its run's event count): a
    run's events are sent to its readers only then, so no reader sees an event a crash loses, of the
    server (kill -9 included) or of the machine. The file is deleted on that thread too,
    in order with its records (a response kept ended is on disk before its file goes). A torn last
    line is dropped when read back."""

    def __init__(self, directory: Path, log_: FileBacked):
        self.directory, self.log = directory, log_
        self._unsynced: set[str] = set()
        self._marks: dict[str, int] = {}   # each response's mark of the last line written
        self.on_synced: Optional[Callable[[str, int], None]] = None
        self._failed: set[str] = set()   # logged once each
        # the files of the responses written to latest, open (until `drop`, or OPEN_FILES later ones)
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}.jsonl"

    def add(self, response_id: str, record: dict, mark: Optional[int] = None) -> bool:
        """`record` written, its fsync to follow on the writer thread (then `on_synced(response_id,
        mark)`, where `mark` is given); False where it could not be written (its events then go
        out as they are: the restart runs the response again from an earlier point)."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        path = self.path(response_id)
        try:
            fd = self._fds.get(response_id)
            if fd is None:
                try:
                    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                except FileNotFoundError:
                    self.directory.mkdir(mode=0o700, exist_ok=True)
                    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                self._fds[response_id] = fd
                if len(self._fds) > OPEN_FILES:   # (many queued: a system's few descriptors are not spent)
                    os.close(self._fds.popitem(last=False)[1])
            else:
                self._fds.move_to_end(response_id)
            data = memoryview(line)
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            if response_id not in self._failed:
                self._failed.add(response_id)
                log.error("could not write to %s: %s (a restart runs the response again from an earlier point)",
                          path, e)
            return False
        with self._lock:
            first = response_id not in self._unsynced
            self._unsynced.add(response_id)
            if mark is not None:
                self._marks[response_id] = mark
        if first:
            self.log.submit(self._sync, response_id)
        return True

    def close(self) -> None:
        """The files open for writing closed (what is written stays: the server stopping)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def drop(self, response_id: str) -> None:
        """Its file closed, and deleted on the writer thread (after what was submitted before)."""
        self._failed.discard(response_id)
        fd = self._fds.pop(response_id, None)
        if fd is not None:
            os.close(fd)
        self.log.submit(self._unlink, response_id)

    def read(self, response_id: str) -> list[dict]:
        """Its records (none without a file), the file cut to the whole ones (start only)."""
        path = self.path(response_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            log.error("could not read %s: %s (the response runs again from its start)", path, e)
            return []
        records, good = [], 0
        for line in data.split(b"\n")[:-1]:   # (a last line without its newline is torn)
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not isinstance(record, dict):
                break
            records.append(record)
            good += len(line) + 1
        if good < len(data):
            log.warning("%s: %d bytes after its last whole line dropped (a crash cut them short)", path,
                        len(data) - good)
            os.truncate(path, good)
        return records

    def reset(self, response_id: str) -> None:
        """Its file deleted now (start only: a response that runs again from its start)."""
        self.path(response_id).unlink(missing_ok=True)

    def stale(self, keep: set[str]) -> None:
        """The files of responses not in `keep` deleted (start only: ended while its file stayed)."""
        if not self.directory.is_dir():
            return
        for path in self.directory.glob("*.jsonl"):
            if path.stem not in keep:
                path.unlink(missing_ok=True)

    def _sync(self, response_id: str) -> None:
        with self._lock:   # (lines written from here on are another fsync's)
            self._unsynced.discard(response_id)
            mark = self._marks.pop(response_id, None)
        path = self.path(response_id)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            fd = None   # (dropped)
        except OSError as e:
            log.error("could not sync %s: %s", path, e)
            fd = None
        if fd is not None:
            try:
                fsync_fd(fd)   # (to the drive itself: its readers wait for this)
            except OSError as e:
                log.error("could not sync %s: %s (a crash of the machine may lose its last lines)", path, e)
            finally:
                os.close(fd)
        if mark is not None and self.on_synced is not None:   # (failed too: its readers are not held for ever)
            self.on_synced(response_id, mark)

    def _unlink(self, response_id: str) -> None:
        try:
            self.path(response_id).unlink(missing_ok=True)
        except OSError as e:
            log.error("could not delete %s: %s", self.path(response_id), e)
