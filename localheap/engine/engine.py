"""The engine: one worker thread owns the backend and every session.

Requests come in on a queue; events go out through each request's emit callable. Active
runs are served round-robin, one step each per round: a decode token or a prefill chunk,
so a long document upload never stalls another session's chat for more than one chunk.
Under a RAM budget, jobs that need a heap wait in arrival order (FIFO) for room, up to
`admission_timeout` seconds, then fail with OverBudget (503); later jobs never overtake them.
The engine knows nothing about HTTP; it tokenizes nothing but the text it detokenizes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional

from ..sessions import Session, SessionLost, SessionNotFound, SessionStore, SpillFailed, continue_session, match_session
from . import branching
from .errors import EngineFailed, EngineStopped, InvalidTokens, OverBudget, Overloaded
from .events import Failed, Feed, Job, Started
from .governor import AdmitAll, Governor
from .runs import Run
from .telemetry import Counters

log = logging.getLogger("localheap.engine")
ROOM_RECHECK_S = 0.1   # how often a job waiting for RAM asks the governor again (runs ending ask at once)
IDLE_POLL_S = 0.05     # with nothing running, how often waiting jobs are looked at (room, timeouts)


class WaitForRoom(Exception):
    """Internal: the job needs a heap and an earlier job is already waiting for RAM."""


class Engine:
    def __init__(self, backend: Any, store: SessionStore, governor: Optional[Governor] = None,
                 max_active: int = 8, max_queued: int = 32, admission_timeout: float = 30.0):
        assert max_active >= 1 and max_queued >= 0 and admission_timeout >= 0
        self.backend, self.store = backend, store
        self.governor = governor or AdmitAll()
        self.max_active, self.max_queued = max_active, max_queued
        self.admission_timeout = admission_timeout
        self._room_check_at = 0.0          # before this (monotonic), don't ask the governor again
        self._refusal: Optional[OverBudget] = None
        self.counters = Counters()
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._active: list[Run] = []
        self._in_flight = 0
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._thermal = "unknown"
        self.failure: Optional[BaseException] = None      # set when the thread died on an internal error
        self.on_fatal: Optional[Callable[[BaseException], None]] = None   # e.g. make the server exit
        self.vocab_size: Optional[int] = getattr(backend, "vocab_size", None)

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
            if self.failure is not None:
                raise EngineFailed()
            if self._stopping:
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
            if self.failure is not None:
                fut.set_exception(EngineFailed())
            else:
                self._inbox.put((fn, fut))
        return fut

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
        return len(self._waiting)

    # --- engine thread ---

    def _loop(self) -> None:
        try:
            while True:
                # running: just look; only waiting (for RAM or a busy session): poll; idle: sleep
                timeout = 0.0 if self._active else IDLE_POLL_S if self._waiting else None
                if not self._drain(timeout):
                    break
                self._admit()
                for run in list(self._active):
                    self._step(run)
            self._shutdown()
        except BaseException as e:   # a bug outside any one request: nothing here can be trusted
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """Fail every job and pending call, then tell the server (it exits for a restart)."""
        log.critical("the engine thread stopped on an internal error", exc_info=error)
        with self._lock:
            self.failure = error
        jobs = [r.job for r in self._active] + list(self._waiting)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                jobs.append(item)
            elif item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(EngineFailed())
        for job in jobs:
            if not job.done.is_set():
                self._end(job, Failed(EngineFailed()), "failed")
        if self.on_fatal is not None:
            self.on_fatal(error)

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
                self._waiting.append(item)
            else:
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self) -> None:
        """Start waiting jobs in arrival order; a job for a busy session waits its turn, and
        once one job waits for RAM, later jobs that need a heap wait behind it (FIFO)."""
        skipped: deque[Job] = deque()
        blocked = time.monotonic() < self._room_check_at
        while self._waiting and len(self._active) < self.max_active:
            job = self._waiting.popleft()
            if job.cancelled:
                self._end(job, None, "cancelled")
                continue
            sid = job.request.session_id
            if sid is not None and sid in self.store and self.store.get(sid).busy:
                skipped.append(job)
                continue
            try:
                self._start(job, blocked)
            except (WaitForRoom, OverBudget) as e:
                if isinstance(e, OverBudget):
                    self._refusal, self._room_check_at, blocked = e, time.monotonic() + ROOM_RECHECK_S, True
                if time.monotonic() - job.submitted < self.admission_timeout:
                    skipped.append(job)
                else:
                    self._fail(job, self._refusal or OverBudget("over the RAM budget"))
            except Exception as e:
                self._fail(job, e)
        skipped.extend(self._waiting)
        self._waiting = skipped

    def _room_freed(self) -> None:
        """A heap may have become spillable or free: jobs waiting for RAM ask again now."""
        self._room_check_at = 0.0

    def _start(self, job: Job, room_blocked: bool = False) -> None:
        req, tok = job.request, self.backend.tokenizer
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        self._check_tokens(req.prompt.tokens, req.prompt.continuation or ())
        if req.session_id is not None:
            named = self.store.get(req.session_id)
            if named.owner != req.owner:   # another key's session: as if it did not exist
                raise SessionNotFound(req.session_id)
            match = continue_session(named, req.prompt, encode, tok.decode)
            named.addressed = True
        else:
            documents = isinstance(req, Feed)   # a document without a session starts a new one
            sessions = [] if documents else [x for x in self.store.sessions() if x.owner == req.owner]
            checkpoints = [] if documents else [c for c in self.store.checkpoints.all()
                                                if self._same_owner(c.session_id, req)]
            match = match_session(sessions, req.prompt, encode, tok.decode, checkpoints)
        try:
            if match is not None and match.checkpoint is not None:
                match.session = branching.new_branch(self.store, match.checkpoint.session_id)
                return self._run(job, self._prepare(match, True, room_blocked), created=True)
            if match is not None:
                return self._run(job, self._prepare(match, False, room_blocked), created=False)
        except SessionLost:
            if req.session_id is not None:
                raise   # the client named it: it must resend the history
            log.warning("the session matching a prompt was lost; serving it in a new session")
        except OSError as e:   # an unreadable checkpoint: read the prompt in full instead
            if match is None or match.checkpoint is None:
                raise
            log.warning("checkpoint %s unreadable (%s); serving the prompt in a new session",
                        match.checkpoint.path, e)
        match = continue_session(self.store.create(owner=req.owner), req.prompt, encode, tok.decode)
        self._run(job, self._prepare(match, True, room_blocked), created=True)

    def _same_owner(self, session_id: str, req) -> bool:
        """Where API keys own sessions, a prompt reuses only its own key's checkpoints."""
        return session_id in self.store and self.store.get(session_id).owner == req.owner

    def _prepare(self, match, created: bool, room_blocked: bool = False):
        """Make room for the match's session and give it its heap (from a checkpoint, or rolled
        back to the shared prefix); a session created for this request is dropped again when
        that fails (it holds no history)."""
        s = match.session
        try:
            if not match.new_tokens:
                raise ValueError("the prompt is empty: nothing to feed")
            self._check_tokens(match.new_tokens)
            if s.cache is None:
                if room_blocked:
                    raise WaitForRoom()
                self._admit_heap(s)   # before _make_room: a refused job must not evict sessions
            self._make_room(s)
            if match.checkpoint is not None:
                branching.fork_into(self.store, s, match.checkpoint)
            self.store.make_resident(s)
            if match.rollback is not None:
                branching.roll_back(self.backend, s, match.rollback)
        except Exception:
            if created:
                self.store.delete(s.id)
            raise
        return match

    def _make_room(self, s: Session) -> None:
        """Spill beyond max_resident. A failed spill fails this request only when it needs the
        room (its heap is not resident); every session stays as it was either way."""
        try:
            self.store.enforce_limits(keep=s)
        except SpillFailed as e:
            if s.cache is None:
                raise
            log.error("%s (sessions stay in memory)", e)

    def _check_tokens(self, *lists) -> None:
        """Ids outside the vocabulary are refused before they touch any session."""
        if self.vocab_size is None:
            return
        for ids in lists:
            if len(ids) and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise InvalidTokens(bad, self.vocab_size)

    def _run(self, job: Job, match, created: bool) -> None:
        s = match.session
        run = Run(job, s, match.new_tokens, match.cached, self.backend)
        run.created = created
        s.busy, s.dirty = True, True
        self.store.touch(s)
        s.refresh()
        self._active.append(run)
        self.counters.prompt_tokens += run.prompt_tokens
        self.counters.cached_tokens += run.cached
        self._emit(job, Started(s.id, run.prompt_tokens, run.cached))

    def _admit_heap(self, s: Session) -> None:
        """Ask the governor before one more heap becomes resident; spill what it names."""
        resident = [x for x in self.store.sessions() if x.cache is not None]
        idle = sorted((x for x in resident if not x.busy and x is not s), key=lambda x: x.last_used)
        decision = self.governor.admit(len(resident), [x.id for x in idle])
        if decision.action != "admit":
            raise OverBudget(decision.reason, retry_after=decision.retry_after_s)
        for sid in decision.spill:
            log.info("RAM budget: spilling idle session %s to disk", sid)
            self.store.spill(sid)

    def _throttle(self, run: Run) -> float:
        """Thermal pressure: smaller prefill chunks and a pause; returns the pause."""
        t = self.governor.throttle(run.session.cfg.chunk)
        if t.state != self._thermal:
            log.log(logging.WARNING if t.active else logging.INFO,
                    "thermal state %s: prefill chunk %d, pause %.2fs", t.state, t.chunk, t.pause_s)
            self._thermal = t.state
        run.chunk = t.chunk
        return t.pause_s

    def _step(self, run: Run) -> None:
        if run.job.cancelled:
            self._finish(run)
            return
        try:
            pause = self._throttle(run)
            if pause:
                time.sleep(pause if run.prefilling else pause / 10)
            began = time.monotonic()
            done = run.step()
        except Exception as e:
            log.exception("a request failed on session %s", run.session.id)
            self._active.remove(run)
            self._fail(run.job, e, run)
            return
        kind, n = run.last_step
        if n:
            meter = self.counters.decode if kind == "decode" else self.counters.prefill
            meter.add(n, took=time.monotonic() - began)
            if kind == "prefill":
                self.counters.prefill_tokens += n
        if done:
            self._finish(run)

    def _finish(self, run: Run) -> None:
        self._active.remove(run)
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
        if fed_document:
            branching.checkpoint_quietly(self.store, s)
        self.store.touch(s)
        self._save(s)   # before the reply ends: a turn the client saw finish survives kill -9
        s.refresh()
        self.counters.completion_tokens += len(run.completion)
        self._end(run.job, run.finished_event(), "finished" if run.finish_reason else "cancelled")
        try:
            self.store.enforce_limits()
        except Exception as e:   # the request is answered; the next one that needs room reports it
            log.error("%s (sessions stay in memory)", e)
        self._room_freed()

    def _save(self, s: Session) -> None:
        """Write-through in a durable store; a failed write keeps the session, logged."""
        if self.store.durable and s.fed and s.cache is not None:
            try:
                self.store.save(s)
            except Exception as e:
                log.error("session %s: turn not saved: %s", s.id, e)

    def _fail(self, job: Job, error: Exception, run: Optional[Run] = None) -> None:
        """Fail one request. A session it was running on is rolled back to its last saved
        turn (or to empty); dropped only when neither exists, since its cache may hold a
        half-fed chunk."""
        if run is not None and (run.created or not self.store.rollback(run.session, fed_before=run.cached)):
            if not run.created:
                log.error("session %s dropped: its cache cannot be trusted and it has no saved copy", run.session.id)
            run.session.busy = False
            self.store.delete(run.session.id)
        self._room_freed()
        # refusals (budget, queue) are not failures: they count as rejected, like a full queue
        self._end(job, Failed(error), "rejected" if isinstance(error, (OverBudget, Overloaded)) else "failed")

    def _end(self, job: Job, event, outcome: str) -> None:
        """Every job ends here exactly once: finished, cancelled or failed."""
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
        for run in list(self._active):
            run.job.cancel()
            self._finish(run)
        while self._waiting:
            self._end(self._waiting.popleft(), Failed(EngineStopped()), "failed")
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                self._end(item, Failed(EngineStopped()), "failed")
            elif item is not None:
                item[1].set_exception(EngineStopped())

    # --- session commands (engine thread, via call) ---

    def checkpoint_session(self, session_id: str):
        return branching.checkpoint(self.store, session_id)

    def fork_session(self, session_id: str, tokens: Optional[int] = None) -> Session:
        return branching.fork(self.store, session_id, tokens, self._admit_heap)

    def delete_session(self, session_id: str) -> None:
        """Cancel whatever runs on the session, then forget it."""
        s = self.store.get(session_id)
        for run in [r for r in self._active if r.session is s]:
            run.job.cancel()
            self._finish(run)
        for job in [j for j in self._waiting if j.request.session_id == session_id]:
            self._waiting.remove(job)
            self._end(job, Failed(SessionNotFound(session_id)), "failed")
        self.store.delete(session_id)
        self._room_freed()


def wait_idle(engine: Engine, timeout: float = 10.0) -> bool:
    """Block until nothing is in flight (tests, shutdown)."""
    deadline = time.monotonic() + timeout
    while engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.in_flight == 0
