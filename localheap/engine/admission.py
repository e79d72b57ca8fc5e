"""Admission and placement: which waiting job starts next, on which session, with which heap.

Jobs start in arrival order; a job for a busy session waits its turn. Under a RAM budget,
once one job waits for room (the governor refused its heap), later jobs that need a heap wait
behind it (FIFO) until a heap frees up or `timeout` passes (OverBudget, 503). Placement finds
the session a prompt continues (named, matched by prefix, a checkpoint's branch, or a new one),
spills what the governor names, and rolls the session back to the shared prefix.
Runs the engine thread's code but knows nothing about running a job: `start` is the engine's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Optional

from ..embedding import embedding_heap
from ..sessions import RollbackRefused, Session, SessionLost, SessionNotFound, SessionStore, SpillFailed, continue_session, match_session
from . import branching
from .errors import InvalidTokens, OverBudget
from .events import Feed, Job
from .governor import Governor
from .slots import InvalidSlot

log = logging.getLogger("localheap.engine")
ROOM_RECHECK_S = 0.1   # how often a job waiting for RAM asks the governor again (runs ending ask at once)
SCRATCH_KEEP = 2       # an owner's scratch sessions (an editor's completions) kept at most: one a file or two


class WaitForRoom(Exception):
    """Internal: the job needs a heap and an earlier job is already waiting for RAM."""


class AdmissionQueue:
    """The jobs waiting to start (arrival order) and where each one goes when it does."""

    def __init__(self, backend: Any, store: SessionStore, governor: Governor, timeout: float):
        self.backend, self.store, self.governor = backend, store, governor
        self.timeout = timeout
        self.waiting: deque[Job] = deque()
        self.placing: Optional[Job] = None   # the job being placed and started (out of `waiting`)
        self._skipped: deque[Job] = deque()  # (admit) jobs passed over this round: still waiting
        self._room_check_at = 0.0          # before this (monotonic), don't ask the governor again
        self._refusal: Optional[OverBudget] = None
        self.vocab_size: Optional[int] = getattr(backend, "vocab_size", None)
        if getattr(store, "disk", None) is not None:   # --disk-total keeps the sessions jobs wait for
            store.disk.waiting = self.named

    def named(self) -> set[str]:
        """The sessions the waiting jobs (and the one being placed) name."""
        jobs = [*list(self.waiting), *list(self._skipped), *([self.placing] if self.placing is not None else [])]
        return {sid for j in jobs if (sid := getattr(j.request, "session_id", None)) is not None}

    def admit(self, slot_free: Callable[[], bool], start: Callable[[Job, Any, bool], None],
              fail: Callable[[Job, Exception], None], drop: Callable[[Job], None],
              slot_open: Callable[[int], bool] = lambda i: True) -> None:
        """Start waiting jobs in arrival order while `slot_free()`: `start(job, match, created)`
        runs a placed job, `fail(job, error)` refuses one, `drop(job)` ends a cancelled one. A job
        that names a slot (id_slot) waits, behind none of the others, until `slot_open(slot)`."""
        skipped = self._skipped = deque()
        blocked = time.monotonic() < self._room_check_at
        while self.waiting and slot_free():
            job = self.waiting.popleft()
            if job.cancelled:
                drop(job)
                continue
            sid = job.request.session_id
            if sid is not None and sid in self.store and self.store.get(sid).busy:
                skipped.append(job)
                continue
            want = getattr(job.request, "slot", None)
            try:
                if want is not None and not slot_open(want):
                    skipped.append(job)
                    continue
            except InvalidSlot as e:   # no such slot (the routes check first)
                fail(job, e)
                continue
            self.placing = job
            try:
                start(job, *self.place(job.request, blocked))
            except (WaitForRoom, OverBudget) as e:
                if isinstance(e, OverBudget):
                    self._refusal, self._room_check_at, blocked = e, time.monotonic() + ROOM_RECHECK_S, True
                if time.monotonic() - job.submitted < self.timeout:
                    skipped.append(job)
                else:
                    fail(job, self._refusal or OverBudget("over the RAM budget"))
            except Exception as e:
                fail(job, e)
            finally:
                self.placing = None
        skipped.extend(self.waiting)
        self.waiting, self._skipped = skipped, deque()

    def room_freed(self) -> None:
        """A heap may have become spillable or free: jobs waiting for RAM ask again now."""
        self._room_check_at = 0.0

    def place(self, req, room_blocked: bool = False) -> tuple[Any, bool]:
        """(match, created): the session `req` runs on, resident, rolled back to the shared prefix.
        Raises WaitForRoom when it needs a heap while `room_blocked`, OverBudget when refused one."""
        tok = self.backend.tokenizer
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        scratch = bool(getattr(req, "scratch", False))
        self.check_tokens(req.prompt.tokens, req.prompt.continuation or ())
        if getattr(req, "ephemeral", False):   # a session of its own: nothing kept is read or changed
            pooled = getattr(req, "pool", None) is not None   # an embedding: a heap the size of its input
            cfg = embedding_heap(self.store.cfg, len(req.prompt.tokens)) if pooled else None
            match = continue_session(self.store.create(owner=req.owner, ephemeral=True, cfg=cfg), req.prompt, encode,
                                     tok.decode)
            return self._prepare(match, True, room_blocked), True
        if req.session_id is not None:
            named = self.store.get(req.session_id)
            if named.owner != req.owner:   # another key's session: as if it did not exist
                raise SessionNotFound(req.session_id)
            match = continue_session(named, req.prompt, encode, tok.decode)
            named.addressed = True
        else:
            documents = isinstance(req, Feed) and not scratch   # a document without a session starts a new one
            # an editor's requests and the rest never share sessions: scratch ones are never saved
            mine = lambda x: x.owner == req.owner and x.scratch == scratch   # noqa: E731
            sessions = [] if documents else [x for x in self.store.sessions() if mine(x)]
            checkpoints = [] if documents else [c for c in self.store.checkpoints.all()
                                                if c.session_id in self.store and mine(self.store.get(c.session_id))]
            reuse = getattr(req, "cache_reuse", None)
            match = match_session(sessions, req.prompt, encode, tok.decode, checkpoints,
                                  self.store.cache_reuse if reuse is None else reuse)
        try:
            if match is not None and match.checkpoint is not None:
                match.session = branching.new_branch(self.store, match.checkpoint.session_id, scratch)
                prepared = self._prepare(match, True, room_blocked)
                if scratch:
                    self._drop_scratch(match.checkpoint.session_id)
                return prepared, True
            if match is not None:
                return self._prepare(match, False, room_blocked), False
        except SessionLost:
            if req.session_id is not None:
                raise   # the client named it: it must resend the history
            log.warning("the session matching a prompt was lost; serving it in a new session")
        except RollbackRefused as e:   # the session stays as it was; the prompt is read in full
            if req.session_id is not None:
                raise   # the client named it: it may send the request again
            log.warning("session %s not rolled back (%s); serving the prompt in a new session", match.session.id, e)
        except OSError as e:   # an unreadable checkpoint: read the prompt in full instead
            if match is None or match.checkpoint is None:
                raise
            log.warning("checkpoint %s unreadable (%s); serving the prompt in a new session",
                        match.checkpoint.path, e)
        match = continue_session(self.store.create(owner=req.owner, scratch=scratch), req.prompt, encode, tok.decode)
        prepared = self._prepare(match, True, room_blocked)
        if scratch:
            self._cap_scratch(req, match.session)
        return prepared, True

    def _cap_scratch(self, req, kept: Session) -> None:
        """A new scratch session (an editor's prompt that nothing held): the owner's idle scratch
        sessions beyond the SCRATCH_KEEP - 1 used last go, as a llama-server's slots are reused."""
        idle = sorted((x for x in self.store.sessions() if x.scratch and x.owner == req.owner and x is not kept
                       and not x.busy), key=lambda x: x.last_used, reverse=True)
        for x in idle[SCRATCH_KEEP - 1:]:
            try:
                self.store.delete(x.id)
            except Exception:   # noqa: BLE001 - it stays; the next one may drop it
                log.exception("dropping scratch session %s failed", x.id)

    def _drop_scratch(self, source_id: str) -> None:
        """An editor's completion forked from a checkpoint of a scratch session (one the last
        completion or warm-up left, which can no longer be rolled back to its context): the fork
        holds that checkpoint now, so the source goes, and an editor keeps one session, not one
        a keystroke (each spilled to disk past --max-resident-sessions)."""
        if source_id not in self.store:
            return
        source = self.store.get(source_id)
        if not source.scratch or source.busy or source.addressed:
            return
        try:
            self.store.delete(source_id)
        except Exception:   # noqa: BLE001 - it stays; the next completion may drop it
            log.exception("dropping scratch session %s failed", source_id)

    def admit_heap(self, s: Session) -> None:
        """Ask the governor before one more heap becomes resident; spill what it names."""
        resident = [x for x in self.store.sessions() if x.cache is not None]
        idle = sorted((x for x in resident if not x.busy and x is not s), key=lambda x: x.last_used)
        extra = self._recall_extra()
        # a heap sized to its input (an embedding's) is charged what it holds, not a session's heap
        size = {"size": self.backend.heap_bytes(s.cfg)} if s.sized else {}
        decision = self.governor.admit(len(resident), [x.id for x in idle], **({"extra": extra} if extra else {}),
                                       **size)
        if decision.action != "admit":
            raise OverBudget(decision.reason, retry_after=decision.retry_after_s)
        for sid in decision.spill:
            log.info("RAM budget: spilling idle session %s to disk", sid)
            self.store.spill(sid)

    def fit_grown(self) -> None:
        """Recall sessions grow as they page out (their page summaries stay in RAM): spill idle
        sessions, least recently used first, until the resident ones fit the plan again. A
        failed spill is logged; the next check tries again."""
        extra = self._recall_extra()
        if not extra:
            return
        resident = [x for x in self.store.sessions() if x.cache is not None]
        idle = sorted((x for x in resident if not x.busy), key=lambda x: x.last_used)
        decision = self.governor.admit(len(resident), [x.id for x in idle], new_heap=False, extra=extra)
        for sid in decision.spill:
            log.info("RAM budget: recall summaries grew; spilling idle session %s to disk", sid)
            try:
                self.store.spill(sid)
            except SpillFailed as e:
                log.error("%s (sessions stay in memory)", e)
                return

    def _recall_extra(self) -> dict[str, int]:
        """Bytes each resident recall session holds past its planned heap, by id (empty without
        recall or a plan): MemoryPlan.recall_extra of the tokens its pages hold."""
        plan = getattr(self.governor, "plan", None)
        if plan is None or not plan.recall_token_bytes:
            return {}
        out = {}
        for x in self.store.sessions():
            pages = getattr(x.cache, "pages", None) if x.cache is not None else None
            if pages is not None:
                extra = plan.recall_extra(pages.tokens)
                if extra:
                    out[x.id] = extra
        return out

    def check_tokens(self, *lists) -> None:
        """Ids outside the vocabulary are refused before they touch any session."""
        if self.vocab_size is None:
            return
        for ids in lists:
            if len(ids) and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise InvalidTokens(bad, self.vocab_size)

    def _prepare(self, match, created: bool, room_blocked: bool = False):
        """Make room for the match's session and give it its heap (from a checkpoint, or rolled
        back to the shared prefix); a session created for this request is dropped again when
        that fails (it holds no history)."""
        s = match.session
        try:
            if not match.new_tokens:
                raise ValueError("the prompt is empty: nothing to feed")
            self.check_tokens(match.new_tokens)
            if s.cache is None:
                if room_blocked:
                    raise WaitForRoom()
                self.admit_heap(s)   # before _make_room: a refused job must not evict sessions
            source = match.checkpoint.session_id if match.checkpoint is not None else None
            self._make_room(s, self.store.get(source) if source in self.store else None)
            if match.checkpoint is not None:
                branching.fork_into(self.store, s, match.checkpoint, strict=False)   # (a full disk: read again)
            self.store.make_resident(s)
            # --disk-total: room (its page store gets its share), or 507 before the session is rolled back
            self.store.disk.admit(s, match.cached + len(match.new_tokens))
            if match.rollback is not None:
                branching.roll_back(self.backend, s, match.rollback, self.store)
            if match.cut is not None:
                branching.cut(self.backend, s, match.cut, self.store)
        except Exception:
            if created:
                self.store.delete(s.id)
            raise
        return match

    def _make_room(self, s: Session, spare: Optional[Session] = None) -> None:
        """Spill beyond max_resident, never `spare` (the session whose checkpoint `s` is forked
        from: an editor's scratch session would be dropped, checkpoint and all, before it is read).
        A failed spill fails this request only when it needs the room (its heap is not resident);
        every session stays as it was either way."""
        try:
            self.store.enforce_limits(keep=s, spare=spare)
        except SpillFailed as e:
            if s.cache is None:
                raise
            log.error("%s (sessions stay in memory)", e)
