"""Rank 0's side of serving on several ranks: the command channel and the `Leader`.

Rank 0's engine drives a `Leader`: its DistributedMLXBackend behind the Backend protocol, where
every call that touches a heap (a new heap, a prefill chunk, each generated token, a rollback,
a save or a restore) is first sent to the other ranks as a command, through a collective (an
all_sum of rank 0's bytes and the others' zeros), then run here. The other ranks' loop
(follow.py) makes the same call on the same heap of its own shard. The collectives inside each
call (the broadcast logits and sampled token, the recall vote, save and restore's agreement)
then meet on every rank. Admission, spill and eviction timing are rank 0's decisions (its
governor and store), which reach the followers as these calls.

A lost rank fails the call in flight, and every later one, with RankLost: found by a ring error
in a collective, or by the heartbeat (liveness.py) while a collective waits for a rank that is
gone. In that case the engine thread cannot come out of the collective (MLX's ring calls cannot
be interrupted): after STUCK_GRACE_S, `on_stuck` fails what the engine holds (Engine.abandon).
A rank that is alive (its heartbeat beating) but never answers a step is found by the step
watch (`watch`): one call that meets the other ranks running longer than --step-timeout counts
as the ranks lost, the same way.
A call that fails on a follower alone fails the request with RankFailed (see follow.py).

Knows nothing about HTTP or sessions: heaps are numbered, paths are sent relative to the
sessions directory (each rank resolves them against its own).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ...engine.errors import RankFailed, RankLost
from ...generation import SamplingParams
from ...heap import HeapConfig
from .distributed import DistributedMLXBackend

log = logging.getLogger("localheap.distributed")
CHECKED = ("new", "load", "truncate")   # a heap made, read or cut back: every rank reports how the call went
START_CHECKED = ("prefill", "generate")   # every rank says it can start these first
STUCK_GRACE_S = 2.0   # a rank is gone: how long a collective in flight may take to fail by itself
HEARD_S = 1.0         # a ring error: how long the heartbeat may take to say which rank is gone
STEPS = {"new": "a new heap", "load": "a restore", "save": "a save", "prefill": "a prefill chunk",
         "truncate": "a rollback", "generate": "a generation's start", "next": "a generated token",
         "close": "a generation's end", "remove": "removing files", "ping": "a ping",
         "reading": "a memory reading", "prune": "pruning files at start"}   # for --step-timeout's error


def broadcast(ranks, payload: Optional[bytes]) -> bytes:
    """Rank 0's bytes on every rank (`payload` is ignored elsewhere): a length, then the bytes."""
    first = ranks.rank == 0
    n = mx.array([len(payload) if first else 0], mx.int64)
    size = int(mx.distributed.all_sum(n, group=ranks.group, stream=mx.cpu).item())
    raw = np.frombuffer(payload, np.uint8) if first else np.zeros(size, np.uint8)
    return bytes(np.array(mx.distributed.all_sum(mx.array(raw), group=ranks.group, stream=mx.cpu)))


def lost(e: BaseException) -> bool:
    """MLX's ring (or another backend) saying a peer is gone."""
    return isinstance(e, RuntimeError) and "[ring]" in str(e)


def error_note(e: Optional[BaseException]) -> str:
    """What a rank tells the others of a failed call: the error's class and the start of its text."""
    return "" if e is None else f"{type(e).__name__}: {e}"[:160]


class Leader:
    """Rank 0's backend for the engine: each heap call is sent to the followers, then run."""

    def __init__(self, backend: DistributedMLXBackend, root: Optional[Path] = None, heartbeat=None):
        assert backend.rank == 0
        self.backend = backend
        self.root = Path(root) if root is not None else None   # the sessions directory
        self.lost: Optional[str] = None   # why the ranks cannot go on (a rank was lost)
        self.failures = 0                  # calls that failed on a follower only (RankFailed)
        self.last_failure: Optional[str] = None
        self.stopped = False
        self.heartbeat = heartbeat         # liveness.Heartbeat, when the ranks have one (it wakes the followers)
        self.on_stuck: Optional[Callable[[RankLost], None]] = None   # the engine thread cannot come back
        self._inside = 0                   # > 0 while this rank is in a call that meets the others
        self._since: Optional[float] = None   # when that call began (time.monotonic)
        self._op = ""                      # the command it belongs to (the last one sent)
        self._lock = threading.Lock()
        self._handles = 0
        self._dropped: list[int] = []     # heaps rank 0 let go of: the followers free theirs

    def __getattr__(self, name):   # stats, tokens_in_cache, heap_bytes...: this rank's, no message
        return getattr(self.backend, name)

    @property
    def ranks(self):
        return self.backend.ranks

    def rollback_floor(self, cache) -> int:
        """Exact rollbacks only: a rewind picks what it keeps by each rank's own scores and heads."""
        return cache.exact_floor()

    def rollback_mark(self, cache) -> None:
        """None: only rank 0 marks its caches (a model with sliding layers reads a rewritten turn again)."""
        return None

    # --- the command channel ---

    def send(self, op: str, **args) -> None:
        if self.lost is not None:
            raise RankLost(self.lost)
        drop, self._dropped = self._dropped, []
        self._op = op
        if self.heartbeat is not None:   # the followers wait for this before they enter the broadcast
            self.heartbeat.wake()
        self._guard(lambda: broadcast(self.ranks, json.dumps({"op": op, "drop": drop, **args}).encode()))

    def _guard(self, work):
        """`work()`; a peer's loss there becomes RankLost, here and for every later call. A call the
        ranks were found lost during is not trusted whatever it returned: MLX's ring can hand back a
        buffer, not an error, from a collective a peer died in (a save's agreement read "every rank
        saved" from a dead rank)."""
        with self._lock:
            self._inside += 1
            if self._inside == 1:
                self._since = time.monotonic()
        try:
            result = work()
            if self.lost is not None:
                raise RankLost(self.lost)
            return result
        except RankLost:
            raise
        except Exception as e:
            if not (lost(e) or lost(e.__cause__)):   # distributed.lost_rank_errors says it too
                raise
            who = self.heartbeat.wait_gone(HEARD_S) if self.heartbeat is not None else None
            raise RankLost(self._mark_lost(f"{who} ({e})" if who else
                                           f"{e} (a rank exited, or failed mid-step: its log says which)")) from e
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    self._since = None

    def _mark_lost(self, cause: str) -> str:
        with self._lock:
            first = self.lost is None
            if first:
                self.lost = (f"rank lost: {cause}; the ranks cannot go on: restart every rank (mlx.launch), saved "
                             f"sessions restore with the same layout")
        if first:
            log.error("%s", self.lost)
        return self.lost

    def rank_gone(self, rank: int, why: str) -> None:
        """The heartbeat's report (its own thread): rank `rank` is gone. Every later call fails with
        RankLost; a call in flight that does not fail by itself within STUCK_GRACE_S waits in a
        collective for ever: `on_stuck` fails what depends on it."""
        if self.stopped:
            return
        message = self._mark_lost(f"rank {rank} {why}")
        deadline = time.monotonic() + STUCK_GRACE_S
        while self._inside and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._inside:
            log.critical("rank 0 is stuck in a collective with a rank that is gone: failing the requests in flight")
            if self.on_stuck is not None:
                self.on_stuck(RankLost(message))

    def watch(self, step_timeout: float, every: Optional[float] = None) -> threading.Thread:
        """Watch the steps (a thread of its own): a call that meets the other ranks and has run
        `step_timeout` s (a rank alive but stuck: its heartbeat beats, its step never answers)
        marks the ranks lost and hands the call to `on_stuck`, as a rank that is gone does."""
        every = every or min(1.0, step_timeout / 4)

        def loop() -> None:
            while self.lost is None and not self.stopped:
                time.sleep(every)
                with self._lock:
                    since, op = self._since, self._op
                if since is not None and time.monotonic() - since > step_timeout and not self.stopped:
                    self.step_stuck(op, step_timeout)

        t = threading.Thread(target=loop, name="localheap-step-watch", daemon=True)
        t.start()
        return t

    def step_stuck(self, op: str, step_timeout: float) -> None:
        """One step has run `step_timeout` s: the ranks are lost, the call is handed to `on_stuck`."""
        if self.lost is not None:   # the heartbeat said so first, and handed it on
            return
        message = self._mark_lost(f"the ranks did not answer within {step_timeout:g} s (rank 0 waited that long in "
                                  f"one step, {STEPS.get(op, op)}; --step-timeout): a rank is alive but stuck, "
                                  f"its log says where")
        log.critical("rank 0 is stuck in a step (%s): failing the requests in flight", STEPS.get(op, op))
        if self.on_stuck is not None:
            self.on_stuck(RankLost(message))

    def _checked(self, op: str, work, **args):
        """A call with no collective of its own: sent, run here, then every rank says how it went.
        Rank 0's own error is raised as it is; a follower's becomes RankFailed (the followers
        dropped the heap the call was on, and rank 0's caller drops its own)."""
        self.send(op, **args)
        try:
            result, error = work(), None
        except RankLost:
            raise
        except Exception as e:   # the others must hear of it before anyone goes on
            result, error = None, e
        notes = self._guard(lambda: self.ranks.notes(error_note(error)))
        if error is not None:
            raise error
        self._raise_failed(op, notes)
        return result

    def _step(self, op: str, **args) -> None:
        """A forward (a prefill chunk, a generation's start): sent, then every rank says whether it could
        start it (one flag each) before anyone enters its collectives; a follower that could
        not becomes RankFailed here, with the ranks still in step."""
        self.send(op, **args)
        if self._guard(lambda: self.ranks.any(False)):
            self._raise_failed(op, self._guard(lambda: self.ranks.notes("")))

    def _raise_failed(self, op: str, notes: list[str]) -> None:
        failed = [(r, note) for r, note in enumerate(notes) if note]
        if failed:
            # a rank killed inside the collective can leave the ring handing back bytes, not an
            # error: what reads as a failure note is then garbage. The heartbeat says if one is gone.
            who = self.heartbeat.wait_gone(HEARD_S) if self.heartbeat is not None else None
            if who:
                raise RankLost(self._mark_lost(f"{who} (in {STEPS.get(op, op)})"))
            rank, note = failed[0]
            self.failures += 1
            self.last_failure = f"rank {rank}: {op}: {note}"
            log.error("rank %d failed the %s call (%s): the request fails, the ranks go on", rank, op, note)
            raise RankFailed(rank, op, note)

    def ping(self) -> None:
        """A command that does nothing: finds a lost rank while the server is idle."""
        self.send("ping")

    def readings(self, over: int, available: int) -> list[tuple[int, int]]:
        """Every rank's memory at an admission, in rank order: (its RSS past its RAM budget, its
        host's available bytes); this rank's are given."""
        self.send("reading")
        overs, free = self._guard(lambda: (self.ranks.each(over), self.ranks.each(available)))
        return list(zip(overs, free))

    def stop(self) -> None:
        """The followers leave their loop (the server is exiting)."""
        if self.stopped:
            return
        self.stopped = True   # from here a follower's end is expected, not a loss
        if self.heartbeat is not None:   # first: the followers end their watch quietly, or, lost, exit
            self.heartbeat.close(bye=self.lost is None)   # (a stuck one too: it never reads a "stop")
        if self.lost is None:
            try:
                self.send("stop")
            except RankLost:
                pass

    def _adopt(self, cache):
        self._handles += 1
        cache.handle = self._handles
        weakref.finalize(cache, self._dropped.append, self._handles)
        return cache

    def _path(self, path) -> Optional[str]:
        if path is None:
            return None
        path = Path(path)
        if self.root is not None and path.is_relative_to(self.root):
            return str(path.relative_to(self.root))
        return str(path)

    def remove_session_files(self, session_id: str, keep_gen: Optional[int], whole: bool) -> None:
        """The store removed a session's files here (another generation's, or all of them with
        `whole`): the followers remove theirs."""
        self.send("remove", session=session_id, keep_gen=keep_gen, whole=whole)

    def prune_files(self, store) -> None:
        """At start, the saved sessions read (rank 0's store recovered them): the followers remove
        their files of any other session, generation or checkpoint (a crash's leftovers, or removals
        they never heard of), each under its own sessions directory."""
        keep = {s.id: {"gen": s.saved_gen, "checkpoints": [c.n for c in store.checkpoints.of(s.id)]}
                for s in store.sessions()}
        self.send("prune", keep=keep)

    def remove_checkpoint_files(self, session_id: str, tokens: int) -> None:
        """The checkpoints removed one of a session's checkpoints here (a cap dropped it, or it was
        unreadable): the followers remove their shards of it."""
        self.send("remove", session=session_id, keep_gen=None, whole=False, checkpoint=int(tokens))

    # --- heap calls, mirrored ---

    def new_cache(self, cfg: HeapConfig, pages_dir: Optional[Path] = None):
        make = lambda: self.backend.new_cache(cfg, pages_dir)   # noqa: E731
        return self._adopt(self._checked("new", make, handle=self._handles + 1, cfg=cfg.to_dict(),
                                         pages_dir=self._path(pages_dir)))

    def load_cache(self, cfg: HeapConfig, path: Path, pages_dir: Optional[Path] = None):
        read = lambda: self._guard(lambda: self.backend.load_cache(cfg, path, pages_dir))   # noqa: E731
        return self._adopt(self._checked("load", read, handle=self._handles + 1, cfg=cfg.to_dict(),
                                         path=self._path(path), pages_dir=self._path(pages_dir)))

    def save_cache(self, cache, path: Path, snapshot: bool = False) -> None:
        self.send("save", handle=cache.handle, path=self._path(path), snapshot=snapshot)
        self._guard(lambda: self.backend.save_cache(cache, path, snapshot))

    def prefill(self, cache, tokens, progress=None, cancelled=None) -> None:
        self._step("prefill", handle=cache.handle, tokens=[int(t) for t in tokens])
        self._guard(lambda: self.backend.prefill(cache, tokens, progress))

    def truncate(self, cache, tokens: int) -> None:
        """A rollback: checked, since a rank whose heap was not cut back would answer from another turn
        (on a failure every rank drops this heap; the caller falls back to the saved copy)."""
        self._checked("truncate", lambda: self.backend.truncate(cache, tokens), handle=cache.handle,
                      tokens=int(tokens))

    def generate(self, cache, new_tokens, params: SamplingParams, progress=None, cancelled=None):
        """Each token is one command (the followers step their generator with this one); a
        constraint (and a logprobs recorder) stays on rank 0, whose sampled token every rank takes."""
        self._handles += 1
        gen_id = self._handles
        self._step("generate", handle=cache.handle, gen=gen_id, tokens=[int(t) for t in new_tokens],
                   params=params.portable())
        inner = self._guard(lambda: self.backend.generate(cache, new_tokens, params, progress))
        return self._tokens(gen_id, inner)

    def _tokens(self, gen_id: int, inner):
        try:
            while True:
                self.send("next", gen=gen_id)   # no start check: the decode path stays one broadcast
                try:
                    token = self._guard(lambda: next(inner))
                except StopIteration:
                    return
                yield token
        finally:
            if self.lost is None:
                try:
                    self.send("close", gen=gen_id)
                except RankLost:
                    pass
            inner.close()
