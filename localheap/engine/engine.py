"""The engine: one worker thread owns the backend and every session.

Requests come in on a queue; events go out through each request's emit callable. With a
backend that batches (`step_rows`), each engine step advances every decoding run by one token
in ONE forward pass (at most `max_batch` runs, those that waited longest first) and
prefilling runs, in turn, feed chunks that ride in the same pass, `mixed_chunk` tokens in all
while others decode, so a document read never freezes a chat; with a prefill lane (lane.py:
backends whose forward passes may run on two threads, the torch CPU backend) a prompt with more
than `mixed_chunk` tokens left instead reads whole chunks on a second thread beside the decode
batch, while a turn's few new tokens still ride. Turns that start together when no one decodes
read their short prompts in one pass (so their decoding starts in the same step). Otherwise (or
with `batched=False`) active runs are served round-robin, one step each per round: a decode
token or a prefill chunk.
Which waiting job starts next and on which session is admission.py's: under a RAM budget, jobs
that need a heap wait in arrival order (FIFO) for room, up to `admission_timeout` seconds, then
fail with OverBudget (503); later jobs never overtake them.
The engine knows nothing about HTTP; it tokenizes nothing but the text it detokenizes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from ..sessions import Session, SessionNotFound, SessionStore
from ..sessions.store import DIR_FULL
from . import branching
from .admission import AdmissionQueue
from .errors import EngineFailed, EngineStopped, OverBudget, Overloaded
from .events import Failed, Feed, Job, Started
from .governor import AdmitAll, Governor
from .lane import PrefillLane
from .runs import Run
from .slots import Slots
from .telemetry import Counters

log = logging.getLogger("localheap.engine")
IDLE_POLL_S = 0.05     # with nothing running, how often waiting jobs are looked at (room, timeouts)
MIXED_CHUNK = 64       # prefill tokens riding in a decode step (README: prefill beside decode)
BATCH_SLICE = 32       # steps a run keeps its batch seat while others wait for one (a swap copies two heaps)
SIDE_SHARE = 0.5       # of the engine's time while runs decode, what embeddings may take (README: Embeddings)
RETRY_SAVE_S = 5.0     # how often a turn the disk refused (full, read-only) is tried again
PAGE_OUT_SLICE_S = 0.0005   # page-out run between two decode steps (at least one layer's): page_out "steps"
SAVE_POLL_S = 0.002    # with nothing running but a turn's save on the saver thread, how often it is looked at


def page_out_mode(backend: Any, asked: Optional[str] = None) -> str:
    """Where the decode batch's page-outs run: "steps" (on the engine thread, a slice between its
    steps: where the batch computes on the CPU's cores) or "thread" (the session's page writer,
    beside the steps). `asked` or LOCALHEAP_PAGE_OUT: steps, thread or auto (the default)."""
    asked = asked or os.environ.get("LOCALHEAP_PAGE_OUT") or "auto"
    if asked == "auto":
        return "steps" if getattr(backend, "computes_on_cpu", False) else "thread"
    if asked not in ("steps", "thread"):
        raise ValueError(f"page-out mode must be steps, thread or auto, not {asked!r}")
    return asked


class Engine:
    def __init__(self, backend: Any, store: SessionStore, governor: Optional[Governor] = None,
                 max_active: int = 8, max_queued: int = 32, admission_timeout: float = 30.0,
                 batched: Optional[bool] = None, max_batch: int = 8, mixed_chunk: int = MIXED_CHUNK,
                 batch_slice: int = BATCH_SLICE, lane: Optional[bool] = None, page_out: Optional[str] = None):
        assert max_active >= 1 and max_queued >= 0 and admission_timeout >= 0
        assert max_batch >= 1 and mixed_chunk >= 1 and batch_slice >= 1
        self.backend, self.store = backend, store
        can_batch = getattr(backend, "step_rows", None) is not None
        if batched and not can_batch:
            raise ValueError(f"the {getattr(backend, 'name', '?')} backend has no batched decode")
        self.batched = can_batch if batched is None else batched
        self.max_batch, self.mixed_chunk, self.batch_slice = max_batch, mixed_chunk, batch_slice
        if lane and not getattr(backend, "concurrent_prefill", False):
            raise ValueError(f"the {getattr(backend, 'name', '?')} backend cannot read a prompt beside the decode batch")
        use_lane = self.batched and (getattr(backend, "concurrent_prefill", False) if lane is None else lane)
        self.lane: Optional[PrefillLane] = PrefillLane(backend) if use_lane else None
        self.page_out = page_out_mode(backend, page_out)
        self._writers: dict = {}   # id -> PageWriter of the batch's sessions, their page-outs left to us
        self._parts_waited = False   # the last step ran no page-out part (its event queued one)
        self._steps = 0   # batched engine steps so far (a run's advanced_at is one of them)
        self.governor = governor or AdmitAll()
        self.max_active, self.max_queued = max_active, max_queued
        self.admission = AdmissionQueue(backend, store, self.governor, admission_timeout)
        self.counters = Counters()
        self._inbox: queue.Queue = queue.Queue()
        self._active: list[Run] = []
        self.slots = Slots(max_active)   # the runs' slots, as llama-server's /slots shows them (engine thread)
        self._turns: deque = deque()   # (fn, future, "turn") from call_in_turn: one per engine step
        self._side_free_at = 0.0       # while runs decode, no embedding work before this (SIDE_SHARE)
        self._in_flight = 0
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._draining = False   # interrupt(): new jobs are refused, running ones were stopped
        self.unsaved: dict[str, str] = {}   # session id -> why its latest turn is not on disk
        self._save_tried_at = 0.0
        # a finished turn's heap file is written on the saver thread while the others decode (backends
        # that allow it: torch); the run ends when it is on disk (_settle_saves), its session busy till then
        self.saves_off_thread = bool(getattr(backend, "saves_off_thread", False))
        self._saver: Optional[ThreadPoolExecutor] = None
        self._saving: list[tuple[Future, Run]] = []
        self._finishing: list[Run] = []   # runs out of _active whose turn is being closed and saved here
        self._thermal = "unknown"
        self.failure: Optional[BaseException] = None      # set when the thread died on an internal error
        self.abandoned: Optional[Exception] = None   # set when the thread is stuck for good (abandon)
        self.on_fatal: Optional[Callable[[BaseException], None]] = None   # e.g. make the server exit

    # --- any thread ---

    def start(self) -> "Engine":
        assert self._thread is None
        self._thread = threading.Thread(target=self._loop, name="localheap-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel what runs, fail what waits, and end the thread. False when the thread is
        still inside a backend call after `timeout` (the backend is not this caller's yet)."""
        if self._thread is None:
            return self.failure is None
        if self.abandoned is not None:   # it will not come back: nothing to wait for
            self._thread = None
            return False
        with self._lock:
            self._stopping = True
            self._inbox.put(None)   # under the lock: no job can land behind the sentinel
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if not ended:
            log.error("the engine thread did not stop within %.0f s", timeout)
        self._thread = None
        return ended and self.failure is None

    def submit(self, request) -> Job:
        """Queue a Generate or Feed request; raises Overloaded when the queue is full."""
        with self._lock:
            limit = self.max_active + self.max_queued
            if self.abandoned is not None:
                raise type(self.abandoned)(*self.abandoned.args)
            if self.failure is not None:
                raise EngineFailed()
            if self._stopping or self._draining:
                raise EngineStopped()
            if self._in_flight >= limit:
                self.counters.rejected += 1
                raise Overloaded(self._in_flight, limit)
            self._in_flight += 1
            self.counters.requests += 1
            job = Job(request)
            self._inbox.put(job)
        return job

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the engine thread between steps (it may touch sessions and the backend)."""
        fut: Future = Future()
        with self._lock:   # never behind a dead thread: the fatal handler drains under this lock
            if self.abandoned is not None:
                fut.set_exception(type(self.abandoned)(*self.abandoned.args))
            elif self.failure is not None:
                fut.set_exception(EngineFailed())
            else:
                self._inbox.put((fn, fut))
        return fut

    def call_in_turn(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the engine thread as a step's own work: one such call per engine step, in
        order, beside the decode batch's step (a forward that is no run's: a batch of short
        embeddings), so that however many wait, the batch waits for one of them a step."""
        fut: Future = Future()
        with self._lock:
            if self.abandoned is not None:
                fut.set_exception(type(self.abandoned)(*self.abandoned.args))
            elif self.failure is not None:
                fut.set_exception(EngineFailed())
            elif self._stopping or self._draining:
                fut.set_exception(EngineStopped())
            else:
                self._inbox.put((fn, fut, "turn"))
        return fut

    def interrupt(self, reason: str = "shutdown") -> None:
        """Stop every running job at its next step (each ends with its Finished event, its session
        keeping and saving what it read and wrote) and fail those waiting; refuse new ones. Any thread."""
        with self._lock:
            self._draining = True
        self.call(lambda: self._interrupt(reason))

    def _interrupt(self, reason: str) -> None:
        for run in self._active:
            run.job.cancel(reason)
        while self.admission.waiting:
            self._end(self.admission.waiting.popleft(), Failed(EngineStopped()), "failed")

    @property
    def healthy(self) -> bool:
        return self.failure is None and (self._thread is None or self._thread.is_alive() or self._stopping)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self.admission.waiting)

    # --- engine thread ---

    def _loop(self) -> None:
        try:
            while True:
                # running: just look; only waiting (for RAM or a busy session): poll; idle: sleep
                timeout = 0.0 if self._active or self._turns else IDLE_POLL_S if self.admission.waiting else None
                if self._saving:
                    timeout = SAVE_POLL_S if timeout is None else min(timeout, SAVE_POLL_S)
                if timeout is None and self.unsaved:
                    timeout = RETRY_SAVE_S
                if not self._drain(timeout):
                    break
                self._settle_saves(block=False)
                if self.unsaved and time.monotonic() - self._save_tried_at >= RETRY_SAVE_S:
                    self._retry_saves()
                self._admit()
                if self.batched:
                    self._batch_step()
                else:
                    for run in list(self._active):
                        self._step(run)
                if self._turns and (self._side_due() or not self.decoding):
                    began = time.monotonic()
                    _run_call(*self._turns.popleft()[:2])
                    self._side_done(time.monotonic() - began)
            self._shutdown()
        except BaseException as e:   # a bug outside any one request: nothing here can be trusted
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """Fail every job and pending call, then tell the server (it exits for a restart)."""
        log.critical("the engine thread stopped on an internal error", exc_info=error)
        with self._lock:
            self.failure = error
        self._fail_all(EngineFailed)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def abandon(self, error: Exception) -> None:
        """The engine thread is inside a backend call that will not return (--distributed: a
        collective waiting for a rank that is gone). From any thread: fail every job and pending
        call with `error`, and every later one; /health says failed. Nothing is saved or rolled
        back here (the stuck thread holds the sessions): on disk each session keeps its last
        saved turn. Should the call come back after all, its job is already over."""
        log.critical("the engine is stuck in a backend call: failing every request (%s)", error)
        with self._lock:
            self.abandoned = error
            self.failure = error
        self._fail_all(lambda: type(error)(*error.args))

    def _fail_all(self, make_error: Callable[[], Exception]) -> None:
        jobs = [r.job for r in self._active] + [r.job for _, r in self._saving] + list(self.admission.waiting)
        # (and the jobs held between those lists: a turn being saved inline, a job being placed, whose
        # save or restore is what is stuck)
        jobs += [r.job for r in self._finishing]
        if self.admission.placing is not None:
            jobs.append(self.admission.placing)
        for job in jobs + self._fail_queued(make_error):
            self._end(job, Failed(make_error()), "failed")

    def _fail_queued(self, make_error: Callable[[], Exception]) -> list[Job]:
        """The calls waiting (turns, commands in the inbox) failed with make_error() (not one its
        caller cancelled); the jobs in the inbox taken out and returned."""
        jobs = []
        while self._turns:
            fut = self._turns.popleft()[1]
            if fut.set_running_or_notify_cancel():
                fut.set_exception(make_error())
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return jobs
            if isinstance(item, Job):
                jobs.append(item)
            elif item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(make_error())

    def _drain(self, timeout: Optional[float]) -> bool:
        """Take everything in the inbox (waiting up to `timeout` for the first item, None:
        for ever); False on the stop sentinel."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout != 0.0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, Job):
                self.admission.waiting.append(item)
            elif len(item) == 3:   # call_in_turn: after the next step
                self._turns.append(item)
            else:
                self._harvest(block=True)   # a command may touch the lane's session
                _run_call(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self) -> None:
        """Start waiting jobs (admission.py: arrival order, FIFO for RAM, placement)."""
        self.admission.admit(slot_free=lambda: len(self._active) < self.max_active, start=self._run,
                             fail=self._fail, drop=lambda job: self._end(job, None, "cancelled"),
                             slot_open=self.slots.free)

    def _room_freed(self) -> None:
        self.admission.room_freed()

    def _run(self, job: Job, match, created: bool) -> None:
        s = match.session
        run = Run(job, s, match.new_tokens, match.cached, self.backend)
        run.created = created
        s.busy, s.dirty = True, True
        self.store.touch(s)
        s.refresh()
        self._active.append(run)
        self.slots.take(run, getattr(job.request, "slot", None))
        self.counters.prompt_tokens += run.prompt_tokens
        self.counters.cached_tokens += run.cached
        self._emit(job, Started(s.id, run.prompt_tokens, run.cached, run.slot))

    def _throttle(self, run: Run) -> float:
        """Thermal pressure: smaller prefill chunks and a pause; returns the pause."""
        t = self.governor.throttle(run.session.cfg.chunk)
        if t.state != self._thermal:
            log.log(logging.WARNING if t.active else logging.INFO,
                    "thermal state %s: prefill chunk %d, pause %.2fs", t.state, t.chunk, t.pause_s)
            self._thermal = t.state
        run.chunk = t.chunk
        return t.pause_s

    def _step(self, run: Run, cap: Optional[int] = None) -> None:
        """One unit of `run` on its own (`cap`: its prefill chunk at most that many tokens)."""
        if run.job.cancelled:
            self._finish(run)
            return
        try:
            pause = self._throttle(run)
            if cap is not None:
                run.chunk = min(run.chunk, cap)
            if pause:
                time.sleep(pause if run.prefilling else pause / 10)
            began = time.monotonic()
            done = run.step()
        except Exception as e:
            log.exception("a request failed on session %s", run.session.id)
            self._leave(run)
            self._fail(run.job, e, run)
            return
        kind, n = run.last_step
        if n:
            meter = self.counters.decode if kind == "decode" else self.counters.prefill
            meter.add(n, took=time.monotonic() - began)
            if kind == "prefill":
                self.counters.prefill_tokens += n
                if run.session.cfg.recall:
                    self.admission.fit_grown()   # its page summaries grew with the chunk
                    self.store.disk.grew()       # and its pages: --disk-total
        if done:
            self._finish(run)

    def _batch_step(self) -> None:
        """One step of the batched engine: every decoding run with a seat in the batch (max_batch
        seats, see _seats) advances one token, runs that start decoding feed their prompt's last
        token, and prefilling runs (in turn) feed up to mixed_chunk tokens, all in one forward pass
        (with the lane, only runs with at most mixed_chunk prompt tokens left ride; the lane reads
        the others, one chunk at a time). With no run decoding, a prefilling run feeds a full chunk
        on its own, unless several have short prompts left: those ride together. A run that cannot
        ride (a scored prompt: Run.rides; a heap the batch cannot take) feeds a full chunk on its
        own beside the batch's step, one such run per step, in turn."""
        self._steps += 1
        if self.lane is not None and self.lane.busy and self.lane.run.job.cancelled:
            self._harvest(block=True)
        for run in [r for r in self._active if r.job.cancelled]:
            self._finish(run)
        pauses = [self._throttle(r) for r in self._active]
        prefilling = [r for r in self._active if r.prefilling and (self.lane is None or r is not self.lane.run)]
        pause = max(pauses, default=0.0)
        if pause:
            time.sleep(pause if prefilling else pause / 10)
        for run in [r for r in self._active if not r.prefilling and r.row is None]:
            if run.gen is None and self.backend.batchable(run.session.cache):
                self._guarded(run, run.begin)
            else:
                self._step(run)   # a heap the batch cannot take (sliding layers): its own generator
        batch = self._seats([r for r in self._active if r.row is not None])
        writers = self._between_steps(batch)
        if self.lane is not None:
            if not batch:   # no one decodes: the engine thread reads the chunks itself
                self._harvest(block=True)
                self.lane.engine_threads()
                prefilling = [r for r in self._active if r.prefilling]
            else:   # documents (more than a mixed chunk left) on the lane; a turn's few new tokens ride
                reads = [r for r in prefilling if r.left > self.mixed_chunk and r.rides]
                if not self.lane.busy and reads:
                    self.lane.submit(reads[0], reads[0].next_chunk(reads[0].chunk))
                    self._rotate(reads[0])
                prefilling = [r for r in prefilling if r.left <= self.mixed_chunk or not r.rides]
        rides = [r for r in prefilling if r.rides and self.backend.batchable(r.session.cache)]
        if not batch:
            rides = [r for r in rides if r.left <= self.mixed_chunk]
            if len(rides) < 2:   # one full chunk on its own, in turn
                if prefilling:
                    self._rotate(prefilling[0])
                    self._step(prefilling[0])
                return
            # several turns start at once and no one decodes yet: their prompts in one pass
        else:   # those that cannot ride (a scored prompt, a heap the batch cannot take): a full chunk
            # on its own, in turn
            lone = [r for r in prefilling if r not in rides]
            if not self._side_due():   # an embedding's chunk waits for its share of the engine's time
                lone = [r for r in lone if r.pooled is None]
            if lone:
                self._rotate(lone[0])
                began = time.monotonic()
                if lone[0].pooled is not None:   # an embedding's chunk beside decoding runs: a riding chunk's size,
                    self._step(lone[0], cap=self.mixed_chunk)   # so a chat waits one small forward at most
                    self._side_done(time.monotonic() - began)
                else:
                    self._step(lone[0])
        chunks, room = [], self.mixed_chunk   # prefill tokens per step beside the decoding runs
        for run in rides:
            if room <= 0:
                break
            chunks.append((run, run.next_chunk(room)))
            room -= len(chunks[-1][1])
            self._rotate(run)
        if self.lane is not None:
            self.lane.engine_threads()
        began = time.monotonic()
        try:
            errors = self.backend.step_rows([r.row for r in batch], [(r.session.cache, c) for r, c in chunks])
        except Exception as e:   # the forward itself: every run in it is suspect
            log.exception("a batched decode step failed (%d runs)", len(batch) + len(chunks))
            for run in batch + [r for r, _ in chunks]:
                self._leave(run)
                self._fail(run.job, e, run)
            return
        took = time.monotonic() - began
        # a slice of page-out before the tokens go out: after, the server's threads sending them
        # would contend with it for the cores (measured: docs/serve_bench.md, "Ninth round"). Not in
        # a step whose eviction event queued a page-out (that step is the long one already), unless
        # the step before left its slice out too
        fresh = [writer.fresh_parts() for writer in writers]
        if any(fresh) and not self._parts_waited:
            self._parts_waited = True
        else:
            self._parts_waited = False
            until = time.monotonic() + PAGE_OUT_SLICE_S
            for writer in writers:
                writer.run_parts(until)
                if time.monotonic() >= until:
                    break
        # a row waiting for its recall's pick (picked on another thread) did not advance
        waiting = [error is None and getattr(run.row, "waiting", False) for run, error in zip(batch, errors)]
        if batch:
            self.counters.decode.add(sum(e is None and not w for e, w in zip(errors, waiting)), took=took)
        ended: list[Run] = []   # every run's token goes out before any run's end is done (a few ms each)
        for run, error, wait in zip(batch, errors, waiting):
            if wait:
                continue
            run.advanced_at = self._steps
            self._guarded(run, lambda run=run: run.take(run.row.token), error, ended)
        for run in ended:
            self._finish(run)
        for (run, chunk), error in zip(chunks, errors[len(batch):]):
            if error is None:
                self.counters.prefill.add(len(chunk), took=took)
                self.counters.prefill_tokens += len(chunk)
            self._guarded(run, lambda run=run, chunk=chunk: self._chunk_fed(run, chunk), error)
        self._harvest(block=False)

    @property
    def decoding(self) -> bool:
        """Whether a run is decoding now (engine thread: a call in turn sizes its work by it)."""
        return any(r.row is not None or r.gen is not None for r in self._active)

    def _side_due(self) -> bool:
        """Whether embedding work (a call in turn, a pooled run's lone chunk) may run now."""
        return time.monotonic() >= self._side_free_at

    def _side_done(self, took: float) -> None:
        """Embedding work took `took` s: while runs decode, the next waits until the engine has
        spent as much on them (SIDE_SHARE of its time), so a chat beside a batch of embeddings
        keeps about half its speed however many are queued."""
        if self.decoding:
            self._side_free_at = time.monotonic() + took * (1 - SIDE_SHARE) / SIDE_SHARE

    def _between_steps(self, batch: list[Run]) -> list:
        """With page_out "steps": the page writers of the batch's sessions leave their page-outs to
        this thread (PageWriter.between_steps); a writer whose session left the batch gets what it
        still holds back. Returns the batch's writers."""
        if self.page_out != "steps":
            return []
        now = {}
        for run in batch:
            writer = getattr(run.session.cache, "writer", None)
            if writer is not None:
                writer.between_steps = True
                now[id(writer)] = writer
        for key in self._writers.keys() - now.keys():
            self._writers[key].release_parts()
        self._writers = now
        return list(now.values())

    def _harvest(self, block: bool) -> None:
        """Take back the lane's chunk once it is read (waiting for it with `block`): the run
        advances, fails or ends here, on the engine thread."""
        got = self.lane.take(block) if self.lane is not None else None
        if got is None:
            return
        run, chunk, error, took = got
        if error is None:
            self.counters.prefill.add(len(chunk), took=took)
            self.counters.prefill_tokens += len(chunk)
            if run.session.cfg.recall:
                self.store.disk.grew()   # its pages grew: --disk-total
        elif not isinstance(error, Exception):
            raise error   # not a request's failure: the engine stops (_die)
        self._guarded(run, lambda: self._chunk_fed(run, chunk), error)

    def _rotate(self, run: Run) -> None:
        """The next step's prefill chunks start with another run."""
        self._active.remove(run)
        self._active.append(run)

    def _seats(self, decoding: list[Run]) -> list[Run]:
        """The runs this step advances: all of them while they fit in max_batch; beyond, a seated
        run keeps its seat for batch_slice steps, then yields it to the run that waited longest.
        So a decoding run waits at most batch_slice x ceil(waiting / max_batch) steps."""
        seated = [r for r in decoding if r.seated_at is not None]
        waiting = sorted((r for r in decoding if r.seated_at is None), key=lambda r: r.advanced_at)
        expired = sorted((r for r in seated if self._steps - r.seated_at >= self.batch_slice),
                         key=lambda r: r.seated_at)
        keep = [r for r in seated if r not in expired]
        incoming = waiting[: self.max_batch - len(keep)]
        stay = expired[: self.max_batch - len(keep) - len(incoming)]
        for r in expired[len(stay):]:
            r.seated_at = None
        for r in incoming:
            r.seated_at = self._steps
        return keep + stay + incoming

    def _chunk_fed(self, run: Run, chunk: list[int]) -> None:
        run.chunk_fed(chunk)
        if run.session.cfg.recall:
            self.admission.fit_grown()   # its page summaries grew with the chunk

    def _guarded(self, run: Run, work: Callable[[], None], error: Optional[Exception] = None,
                 ended: Optional[list] = None) -> None:
        """Do `work` for one run of the batch (unless the backend already failed it with `error`):
        a failure fails that run alone; a finished run ends (or goes into `ended`, to end once the
        step's other runs have taken their tokens)."""
        if error is None:
            try:
                work()
            except Exception as e:
                error = e
        if error is not None:
            log.error("a request failed on session %s", run.session.id, exc_info=error)
            self._leave(run)
            self._fail(run.job, error, run)
        elif run.finish_reason is not None:
            if ended is None:
                self._finish(run)
            else:
                ended.append(run)

    def _leave(self, run: Run) -> None:
        """`run` is no longer active (finished, failed or cancelled): its slot is free."""
        self._active.remove(run)
        self.slots.leave(run)

    def _finish(self, run: Run) -> None:
        self._finishing.append(run)
        try:
            self._finish_run(run)
        finally:
            self._finishing.remove(run)

    def _finish_run(self, run: Run) -> None:
        self._leave(run)
        try:
            run.close()
        except Exception as e:
            log.exception("closing a run failed")
            self._fail(run.job, e, run)
            return
        s = run.session
        s.busy = False
        s.turns += 1
        fed_document = isinstance(run.request, Feed) and run.finish_reason == "fed"
        branching.settle(self.backend, s, None if fed_document else run.prompt_tokens)
        if isinstance(run.request, Feed):
            s.ends_in_reply = False
        elif run.completion or len(s.fed) > run.cached:   # a reply (or its turn opened): its end never read
            s.ends_in_reply = True
        if fed_document and not s.ephemeral:
            branching.checkpoint_quietly(self.store, s)
        self.store.touch(s)
        saved = None
        if s.ephemeral:
            self.store.delete(s.id)   # before the reply ends: the client sees it end with nothing kept
        elif run.job.cancel_reason == "deleted" and run.finish_reason is None:
            pass   # delete_session removes the session next: nothing to save
        elif self.store.durable and not s.scratch:   # (an editor's scratch session is never saved)
            # before the reply ends: a turn the client saw finish survives kill -9
            if self.saves_off_thread and self._needs_save(s) and not self._stopping:
                if self._saver is None:
                    self._saver = ThreadPoolExecutor(1, thread_name_prefix="localheap-saver", initializer=self._saver_threads)
                s.busy = True   # nothing touches its heap until the file is written (_settle_saves)
                self.backend.ready_to_save(s.cache)   # (what the save reads, computed on this thread)
                self._saving.append((self._saver.submit(self.store.write_heap, s), run))
                return
            saved = self._save(s)
        self._finished(run, saved)

    def _finished(self, run: Run, saved) -> None:
        """The rest of _finish, once the turn is saved (True), not saved (why) or not to be (None)."""
        s = run.session
        self.store.disk.ended(s)   # page-out faults reported; --disk-total kept
        # its heap's figures now its page-outs have landed (a stopped document's were read before: stale)
        s.refresh(self.backend.stats(s.cache) if s.cache is not None and s.id in self.store else None)
        self.counters.completion_tokens += len(run.completion)
        event = run.finished_event()
        if saved is not None:   # the reply says whether its turn is on disk (README: saved)
            event.saved, event.save_error = saved is True, None if saved is True else saved
        self._end(run.job, event, "finished" if run.finish_reason else "cancelled")
        try:
            self.store.enforce_limits()
            if s.cfg.recall:
                self.admission.fit_grown()
        except Exception as e:   # the request is answered; the next one that needs room reports it
            log.error("%s (sessions stay in memory)", e)
        self._room_freed()

    def _settle_saves(self, block: bool) -> None:
        """Turns whose heap file the saver thread wrote (all of them, waiting, with `block`): each is
        committed here (tokens, index; store.commit_save) and its run ends (_finished)."""
        while self._saving and (block or self._saving[0][0].done()):
            future, run = self._saving.pop(0)
            s = run.session
            saved = self._saving_outcome(s, lambda: self.store.commit_save(s, future.result()))
            s.busy = False
            self._finished(run, saved)

    def _saver_threads(self) -> None:
        """The saver computes on one intra-op thread: with two, a second OpenMP team beside the
        engine's (torch on a CPU), one client's decode ran at half speed once the first save had
        run, the speed OMP_WAIT_POLICY=PASSIVE gives (libgomp, more of its threads than cores, by
        all appearances stops spinning between parallel regions; docs/serve_bench.md, tenth round)."""
        self.backend.set_threads(1)

    def _needs_save(self, s: Session) -> bool:
        return bool(self.store.durable and s.fed and s.cache is not None) and not s.saved and not s.scratch

    def _save(self, s: Session):
        """Write-through in a durable store: True when the session's turn is on disk, else why not
        (logged; the session stays resident and unsaved, /health degraded, and is tried again every
        RETRY_SAVE_S and after its next turn)."""
        if not self._needs_save(s):
            self._saved(s.id)
            return True
        return self._saving_outcome(s, lambda: self.store.save(s))

    def _saving_outcome(self, s: Session, save: Callable[[], None]):
        """Run `save` (the session's turn to disk): True when it is there, else why not (_save_failed)."""
        try:
            save()
        except Exception as e:
            return self._save_failed(s, e)
        self.store.clear_degraded(DIR_FULL)   # (a directory found full at start: there is room again)
        self._saved(s.id)
        return True

    def _save_failed(self, s: Session, e: Exception) -> str:
        """A turn the disk refused: logged, counted, the store degraded; returns why."""
        reason = str(e) or type(e).__name__
        log.error("session %s: turn not saved: %s", s.id, reason)
        self.counters.save_failures += 1
        if s.id not in self.unsaved:
            self._save_tried_at = time.monotonic()   # the first retry a full period from now
        self.unsaved[s.id] = reason
        self.store.mark_degraded(f"{s.id}:unsaved", f"session {s.id}: latest turn not saved: {reason}")
        return reason

    def _saved(self, session_id: str) -> None:
        if self.unsaved.pop(session_id, None) is not None:
            log.info("session %s: saved", session_id)
            self.store.clear_degraded(f"{session_id}:unsaved")

    def _retry_saves(self) -> None:
        """Save the idle sessions whose latest turn the disk refused (space may be back)."""
        self._save_tried_at = time.monotonic()
        for sid in list(self.unsaved):
            if sid not in self.store:   # deleted meanwhile
                self._saved(sid)
            elif not self.store.get(sid).busy:   # a running one is saved when its run ends
                self._save(self.store.get(sid))

    def _fail(self, job: Job, error: Exception, run: Optional[Run] = None) -> None:
        """Fail one request. A session it was running on is rolled back to its last saved
        turn (or to empty); dropped only when neither exists, since its cache may hold a
        half-fed chunk."""
        if run is not None and run.row is not None:
            self.backend.end_row(run.row)   # out of the batch before the session is rolled back
            run.row = None
        if run is not None and (run.created or not self.store.rollback(run.session, fed_before=run.cached)):
            if not run.created:
                log.error("session %s dropped: its cache cannot be trusted and it has no saved copy", run.session.id)
            run.session.busy = False
            self.store.delete(run.session.id)
        self._room_freed()
        # refusals (budget, queue) are not failures: they count as rejected, like a full queue
        self._end(job, Failed(error), "rejected" if isinstance(error, (OverBudget, Overloaded)) else "failed")

    def _end(self, job: Job, event, outcome: str) -> None:
        """Every job ends here exactly once: finished, cancelled or failed (a second end, after
        `abandon` ended it from another thread, does nothing)."""
        with self._lock:
            if job.ended:
                return
            job.ended = True
        if event is not None:
            self._emit(job, event)
        setattr(self.counters, outcome, getattr(self.counters, outcome) + 1)
        job.done.set()
        with self._lock:
            self._in_flight -= 1

    def _emit(self, job: Job, event) -> None:
        try:
            job.request.emit(event)
        except Exception:  # a consumer that went away must not stop the engine
            log.debug("emit failed; cancelling job %s", job.id, exc_info=True)
            job.cancel()

    def _shutdown(self) -> None:
        self._harvest(block=True)
        if self.lane is not None:
            self.lane.close()
        for run in list(self._active):
            run.job.cancel()
            self._finish(run)
        self._settle_saves(block=True)   # (the runs above saved here: stop() set _stopping)
        if self._saver is not None:
            self._saver.shutdown()
        while self.admission.waiting:
            self._end(self.admission.waiting.popleft(), Failed(EngineStopped()), "failed")
        for job in self._fail_queued(EngineStopped):
            self._end(job, Failed(EngineStopped()), "failed")

    # --- session commands (engine thread, via call) ---

    # A session whose turn is being saved is busy until the turn is committed: the commands that
    # checkpoint or remove one wait for the saves in flight first (the store's other commands,
    # a title or a new session, never touch the heap file the saver writes, and do not wait).

    def checkpoint_session(self, session_id: str):
        self._settle_saves(block=True)
        return branching.checkpoint(self.store, session_id)

    def fork_session(self, session_id: str, tokens: Optional[int] = None) -> Session:
        self._settle_saves(block=True)   # (tokens None: the source is checkpointed now)
        return branching.fork(self.store, session_id, tokens, self.admission.admit_heap)

    def stop_session(self, session_id: str) -> int:
        """End the replies (or document reads) running on the session at their next step ("interrupted":
        "stopped"); their clients read them to their end, the session keeps what they read and wrote.
        Requests still queued are left as they are (their clients stop them by leaving). Returns how
        many were stopped."""
        s = self.store.get(session_id)
        runs = [r for r in self._active if r.session is s and not r.job.cancelled]
        for run in runs:
            run.job.cancel("stopped")
        return len(runs)

    def delete_session(self, session_id: str) -> None:
        """Cancel whatever runs on the session, then forget it."""
        s = self.store.get(session_id)
        for run in [r for r in self._active if r.session is s]:
            run.job.cancel("deleted")   # its reply ends now, saying so ("interrupted": "deleted"), nothing saved
            self._finish(run)
        self._settle_saves(block=True)   # its save, from a run cancelled just now or ended before
        for job in [j for j in self.admission.waiting if j.request.session_id == session_id]:
            self.admission.waiting.remove(job)
            self._end(job, Failed(SessionNotFound(session_id)), "failed")
        self.store.delete(session_id)
        self._room_freed()


def _run_call(fn: Callable[[], Any], fut: Future) -> None:
    """fn() into its future (unless the caller cancelled it first); its exception is the caller's."""
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the caller
            fut.set_exception(e)


def wait_idle(engine: Engine, timeout: float = 10.0) -> bool:
    """Block until nothing is in flight (tests, shutdown)."""
    deadline = time.monotonic() + timeout
    while engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.in_flight == 0
