"""Serving on several ranks: rank 0 runs the server, the other ranks follow its heap calls.

Rank 0's engine drives a `Leader`: its DistributedMLXBackend behind the Backend protocol, where
every call that touches a heap (a new heap, a prefill chunk, each generated token, a rollback,
a save or a restore) is first sent to the other ranks as a command, through a collective (an
all_sum of rank 0's bytes and the others' zeros), then run here. `follow` is the other ranks'
loop: receive a command, make the same call on the same heap of its own shard. The collectives
inside each call (the broadcast logits and sampled token, the recall vote, save and restore's
agreement) then meet on every rank. Admission, spill and eviction timing are rank 0's
decisions (its governor and store), which reach the followers as these calls.
A lost rank fails the call in flight, and every later one, with RankLost.

A call that fails on a follower alone: after a call that makes a heap (a new one, a restore's
read), every rank says how its call went (`Ranks.notes`, one small all_gather); before a prefill
chunk or a generation's start, every rank says whether it can start it (one flag each). A
follower's failure there fails the request with RankFailed (that heap dropped on every rank) and
the ranks go on. A generated token has no such check: decoding costs what it did. A follower
that fails inside a forward it started has left collectives that rank 0 is waiting in: it
cannot get back in step, so it logs the traceback and exits, which closes its ring connections:
rank 0's collective fails and it reports the rank lost (RankLost). (MLX 0.32's ring can leave a
forward that was already running waiting instead: a supervisor must restart the ranks.) A save
agrees already (DistributedMLXBackend.save_cache); other failures (a rollback, removing files)
are logged with their traceback on the follower, which goes on.

Knows nothing about HTTP or sessions: heaps are numbered, paths are sent relative to the
sessions directory (each rank resolves them against its own).
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...engine.errors import RankFailed, RankLost
from ...generation import SamplingParams
from ...heap import HeapConfig
from ..paging import release_pages
from .distributed import DistributedMLXBackend

log = logging.getLogger("localheap.distributed")
CHECKED = ("new", "load")   # a heap made or read: every rank reports how the call went
OUT_OF_STEP = ("prefill", "generate", "next")   # forwards: a follower failing inside one exits
START_CHECKED = ("prefill", "generate")         # every rank says it can start these first
OUT_OF_STEP_EXIT = 3   # follow's status when this rank must leave the ring at once
FAULT_ENV = "LOCALHEAP_TEST_FOLLOWER_FAULT"     # "OP:N": a follower's N-th OP raises (tests)


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


class Leader:
    """Rank 0's backend for the engine: each heap call is sent to the followers, then run."""

    def __init__(self, backend: DistributedMLXBackend, root: Optional[Path] = None):
        assert backend.rank == 0
        self.backend = backend
        self.root = Path(root) if root is not None else None   # the sessions directory
        self.lost: Optional[str] = None   # why the ranks cannot go on (a rank was lost)
        self.failures = 0                  # calls that failed on a follower only (RankFailed)
        self.last_failure: Optional[str] = None
        self.stopped = False
        self._handles = 0
        self._dropped: list[int] = []     # heaps rank 0 let go of: the followers free theirs

    def __getattr__(self, name):   # stats, tokens_in_cache, heap_bytes...: this rank's, no message
        return getattr(self.backend, name)

    @property
    def ranks(self):
        return self.backend.ranks

    # --- the command channel ---

    def send(self, op: str, **args) -> None:
        if self.lost is not None:
            raise RankLost(self.lost)
        drop, self._dropped = self._dropped, []
        self._guard(lambda: broadcast(self.ranks, json.dumps({"op": op, "drop": drop, **args}).encode()))

    def _guard(self, work):
        """`work()`; a peer's loss there becomes RankLost, here and for every later call."""
        try:
            return work()
        except Exception as e:
            if not (lost(e) or lost(e.__cause__)):   # distributed.lost_rank_errors says it too
                raise
            self.lost = (f"rank lost: {e} (a rank exited, or failed mid-step: its log says which); the ranks "
                         f"cannot go on: restart every rank (mlx.launch), saved sessions restore with the same layout")
            log.error("%s", self.lost)
            raise RankLost(self.lost) from e

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
            rank, note = failed[0]
            self.failures += 1
            self.last_failure = f"rank {rank}: {op}: {note}"
            log.error("rank %d failed the %s call (%s): the request fails, the ranks go on", rank, op, note)
            raise RankFailed(rank, op, note)

    def ping(self) -> None:
        """A command that does nothing: finds a lost rank while the server is idle."""
        self.send("ping")

    def stop(self) -> None:
        """The followers leave their loop (the server is exiting)."""
        if self.stopped:
            return
        self.stopped = True
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
        self.send("truncate", handle=cache.handle, tokens=int(tokens))
        self.backend.truncate(cache, tokens)

    def generate(self, cache, new_tokens, params: SamplingParams, progress=None, cancelled=None):
        """Each token is one command (the followers step their generator with this one); a
        constraint stays on rank 0, whose sampled token every rank takes."""
        self._handles += 1
        gen_id = self._handles
        sent = {k: v for k, v in asdict(replace(params, constraint=None)).items() if k != "constraint"}
        self._step("generate", handle=cache.handle, gen=gen_id, tokens=[int(t) for t in new_tokens], params=sent)
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


def error_note(e: Optional[BaseException]) -> str:
    """What a rank tells the others of a failed call: the error's class and the start of its text."""
    return "" if e is None else f"{type(e).__name__}: {e}"[:160]


class InjectedFault(RuntimeError):
    """A follower's failure made on purpose (FAULT_ENV), to test that rank 0 does not hang."""


class Faults:
    """FAULT_ENV="OP:N[,OP:N...]": the N-th OP command on this follower raises InjectedFault, where
    a real failure of it would: before its work (a forward: before it starts), or for a restore
    after the ranks agreed that every shard is there (reading this rank's shard failed)."""

    def __init__(self, spec: Optional[str]):
        self.at = {op: int(n) for op, _, n in (part.partition(":") for part in (spec or "").split(",") if part)}
        self.seen: dict[str, int] = {}

    def check(self, op: str) -> None:
        if op in self.at:
            self.seen[op] = self.seen.get(op, 0) + 1
            if self.seen[op] == self.at[op]:
                raise InjectedFault(f"injected failure of {op} #{self.at[op]} ({FAULT_ENV})")


def start_step(backend, cmd: dict, op: str, faults: Faults, caches: dict) -> bool:
    """Can this rank start the forward `cmd` asks for (its heap or generator here, its params
    read)? Every rank says so before anyone enters its collectives (Leader._step)."""
    error = None
    try:
        faults.check(op)
        caches[cmd["handle"]]
        if op == "generate":
            SamplingParams(**cmd["params"])
    except Exception as e:   # noqa: BLE001 - told to rank 0, which fails the request
        log.error("%s cannot start on this rank", op, exc_info=True)
        error = e
    if backend.ranks.any(error is not None):
        backend.ranks.notes(error_note(error))
        return False
    return True


def follow(backend: DistributedMLXBackend, root: Path, remove_files=None) -> int:
    """A follower rank's loop: rank 0's heap calls on this rank's shard, until it says stop;
    `remove_files(root, session_id, keep_gen, whole)` removes this rank's files of a session.
    Returns the exit status (1: rank 0 was lost; OUT_OF_STEP_EXIT: a forward failed here, see the
    log, and the process must exit now)."""
    assert backend.rank != 0
    root = Path(root)
    caches: dict[int, object] = {}
    gens: dict[int, object] = {}
    faults = Faults(os.environ.get(FAULT_ENV))
    path = lambda p: None if p is None else root / p   # noqa: E731  (an absolute p stays as it is)
    while True:
        try:
            cmd = json.loads(broadcast(backend.ranks, None))
        except RuntimeError as e:
            if lost(e):
                log.error("rank 0 was lost (%s): this rank stops", e)
                return 1
            raise
        for h in cmd["drop"]:
            try:
                release_pages(caches.pop(h, None))
            except Exception:   # noqa: BLE001 - its files only; the ranks stay in step
                log.exception("releasing heap %d's pages failed on this rank", h)
        op = cmd["op"]
        if op == "stop":
            return 0
        if op in START_CHECKED and not start_step(backend, cmd, op, faults, caches):
            continue   # this rank could not start it: every rank heard so, and the request fails
        error = None
        try:
            if op not in ("load", *START_CHECKED):
                faults.check(op)
            if op == "new":
                caches[cmd["handle"]] = backend.new_cache(HeapConfig(**cmd["cfg"]), path(cmd["pages_dir"]))
            elif op == "load":
                cache = backend.load_cache(HeapConfig(**cmd["cfg"]), path(cmd["path"]), path(cmd["pages_dir"]))
                faults.check(op)
                caches[cmd["handle"]] = cache
            elif op == "save":
                backend.save_cache(caches[cmd["handle"]], path(cmd["path"]), cmd["snapshot"])
            elif op == "prefill":
                backend.prefill(caches[cmd["handle"]], cmd["tokens"])
            elif op == "truncate":
                backend.truncate(caches[cmd["handle"]], cmd["tokens"])
            elif op == "generate":
                params = SamplingParams(**cmd["params"])
                gens[cmd["gen"]] = backend.generate(caches[cmd["handle"]], cmd["tokens"], params)
            elif op == "next":
                next(gens[cmd["gen"]], None)
            elif op == "close":
                gens.pop(cmd["gen"]).close()
            elif op == "remove" and remove_files is not None:
                remove_files(root, cmd["session"], cmd["keep_gen"], cmd["whole"])
        except Exception as e:
            if lost(e) or lost(e.__cause__):
                log.error("a rank was lost (%s): this rank stops", e)
                return 1
            if op in OUT_OF_STEP:   # rank 0 waits in collectives this rank skipped: break the ring
                log.critical("%s failed on this rank mid-step; it cannot get back in step with rank 0, so it "
                             "exits (rank 0 then reports the rank lost)", op, exc_info=True)
                return OUT_OF_STEP_EXIT
            log.error("%s failed on this rank", op, exc_info=True)   # save: the ranks agreed on it
            error = e
        if op in CHECKED:
            if any(backend.ranks.notes(error_note(error))):   # rank 0 does not keep that heap either
                release_pages(caches.pop(cmd["handle"], None))
