"""The other ranks' loop when serving on several ranks: rank 0's heap calls, on this rank's shard.

`follow` receives each command rank 0's Leader sends (leader.py) and makes the same call on the
same heap of this rank's shard, until rank 0 says stop or is lost.

A call that fails here alone: after a call that makes a heap (a new one, a restore's read) or
cuts one back (a rollback),
every rank says how its call went (`Ranks.notes`, one small all_gather); before a prefill chunk
or a generation's start, every rank says whether it can start it (one flag each). A failure
there fails the request on rank 0 with RankFailed (that heap dropped on every rank) and the
ranks go on. A generated token has no such check: decoding costs what it did. A follower that
fails inside a forward it started has left collectives that rank 0 is waiting in: it cannot get
back in step, so it logs the traceback and exits; rank 0's heartbeat (liveness.py) sees its
connection close and reports the rank lost, even where MLX's ring leaves rank 0's collective
waiting. A save agrees already (DistributedMLXBackend.save_cache); other failures (removing
files, dropping a heap) are logged with their traceback here, and this rank goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Optional

from ...generation import SamplingParams
from ...heap import HeapConfig
from ..paging import release_pages
from .distributed import DistributedMLXBackend
from .leader import CHECKED, START_CHECKED, broadcast, error_note, lost

log = logging.getLogger("localheap.distributed")
OUT_OF_STEP = ("prefill", "generate", "next")   # forwards: a follower failing inside one exits
OUT_OF_STEP_EXIT = 3   # follow's status when this rank must leave the ring at once
FAULT_ENV = "LOCALHEAP_TEST_FOLLOWER_FAULT"     # "OP:N": a follower's N-th OP raises (tests)
STALL_ENV = "LOCALHEAP_TEST_FOLLOWER_STALL"     # "OP:N": a follower's N-th OP never ends (tests)


class InjectedFault(RuntimeError):
    """A follower's failure made on purpose (FAULT_ENV), to test that rank 0 does not hang."""


class Faults:
    """FAULT_ENV="OP:N[,OP:N...]": the N-th OP command on this follower raises InjectedFault, where
    a real failure of it would: before its work (a forward: before it starts), or for a restore
    after the ranks agreed that every shard is there (reading this rank's shard failed). With
    `stall` (STALL_ENV), the N-th OP waits for ever in the call itself, after any start check: a
    rank alive but stuck, which rank 0's step watch must find (Leader.watch)."""

    def __init__(self, spec: Optional[str], stall: bool = False):
        self.at = {op: int(n) for op, _, n in (part.partition(":") for part in (spec or "").split(",") if part)}
        self.seen: dict[str, int] = {}
        self.stall = stall   # STALL_ENV: the N-th OP waits for ever instead (this rank alive, its heartbeat on)

    def check(self, op: str) -> None:
        if op in self.at:
            self.seen[op] = self.seen.get(op, 0) + 1
            if self.seen[op] == self.at[op] and self.stall:
                log.error("stalling in %s #%d for ever (%s)", op, self.at[op], STALL_ENV)
                threading.Event().wait()
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


def memory_reading(reading) -> tuple[int, int]:
    """This rank's (RSS past its budget, available bytes); one that cannot be read counts as no pressure."""
    if reading is None:
        return -(1 << 62), 1 << 62
    try:
        over, free = reading()
        return int(over), int(free)
    except Exception:   # noqa: BLE001 - the ranks must still meet in the reading's collectives
        log.warning("this rank's memory reading failed", exc_info=True)
        return -(1 << 62), 1 << 62


def follow(backend: DistributedMLXBackend, root: Path, remove_files=None, reading=None, prune_files=None,
           wait=None) -> int:
    """A follower rank's loop: rank 0's heap calls on this rank's shard, until it says stop;
    `remove_files(root, session_id, keep_gen, whole, checkpoint)` removes this rank's files of a
    session (or of one of its checkpoints); `reading()` is this rank's (RSS past its RAM budget,
    available bytes) for rank 0's admissions; `prune_files(root, keep, tag)` removes this rank's
    files (named with `tag`) of what rank 0's saved sessions do not hold, at start; `wait()`
    returns when rank 0 says its next command comes (Heartbeat.wait_wake: MLX's ring waits in a
    collective by polling, a core busy for as long as it waits).
    Returns the exit status (1: rank 0 was lost; OUT_OF_STEP_EXIT: a forward failed here, see the
    log, and the process must exit now)."""
    assert backend.rank != 0
    root = Path(root)
    caches: dict[int, object] = {}
    gens: dict[int, object] = {}
    faults = Faults(os.environ.get(FAULT_ENV))
    stalls = Faults(os.environ.get(STALL_ENV), stall=True)   # in the call itself, after any start check
    path = lambda p: None if p is None else root / p   # noqa: E731  (an absolute p stays as it is)
    while True:
        if wait is not None:
            wait()
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
            stalls.check(op)
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
            elif op == "reading":
                over, free = memory_reading(reading)
                backend.ranks.each(over)
                backend.ranks.each(free)
            elif op == "remove" and remove_files is not None:
                remove_files(root, cmd["session"], cmd["keep_gen"], cmd["whole"], cmd.get("checkpoint"))
            elif op == "prune" and prune_files is not None:
                prune_files(root, cmd["keep"], f"{backend.mode}-rank{backend.rank}of{backend.ranks.size}")
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
