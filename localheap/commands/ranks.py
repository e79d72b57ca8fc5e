"""`serve` and `chat` with --distributed: rank 0 runs the command on a Leader, the others follow.

Every rank loads its shard and plans its own RAM (its psutil, its weights and heaps); the
tightest rank sets how many heaps rank 0's governor lets be resident, and a budget too small
on any rank stops every rank. The followers then run `follow` until rank 0 says stop or is lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from .common import load_model_backend

log = logging.getLogger("localheap.distributed")
PING_S = 2.0        # how often an idle server checks that every rank is still there
LAYOUT_FILE = "layout.json"


def load_rank(args):
    """This rank's shard (DistributedMLXBackend); a follower's output goes to /dev/null but its log."""
    backend = load_model_backend(args)
    if backend.rank != 0:
        sys.stdout = open(os.devnull, "w")
    return backend


def agreed_plan(backend, cfg, ram_budget: Optional[int]):
    """This rank's MemoryPlan, with the heap counted as the tightest rank's: rank 0's governor
    then refuses what any rank cannot hold. BudgetTooSmall on any rank stops all of them."""
    from ..governor import plan_for
    from ..governor.budget import BudgetTooSmall

    try:
        plan, error = plan_for(backend, cfg, ram_budget), None
    except BudgetTooSmall as e:
        plan, error = None, e
    fits = backend.ranks.each(plan.max_resident if plan else 0)
    if error is not None:
        raise error
    tightest = min(fits)
    if tightest < 1:
        raise SystemExit(f"localheap: rank {fits.index(tightest)} cannot hold one heap in its RAM budget (see its "
                         f"log); nothing was started")
    if tightest < plan.max_resident:   # fewer heaps here too, as many as the tightest rank holds
        plan = dataclasses.replace(plan, heap=max(plan.heap, plan.free_for_heaps // tightest))
    return plan


def check_layout(sessions_dir: Optional[Path], layout: Optional[dict]) -> None:
    """Saved sessions restore only with the layout that saved them (one process, or a mode on
    N ranks): refuse another one clearly, before anything is read; mark a new directory."""
    if sessions_dir is None:
        return
    marker = Path(sessions_dir) / LAYOUT_FILE
    saved = json.loads(marker.read_text()) if marker.exists() else None
    if saved is None and layout is not None and (Path(sessions_dir) / "index.json").exists():
        saved = {"mode": "one process"}
    if saved is not None and saved != layout:
        said = lambda x: "one process" if x is None or x.get("mode") == "one process" else \
            f"--distributed {x['mode']} on {x['ranks']} ranks"   # noqa: E731
        raise SystemExit(f"localheap: the sessions in {sessions_dir} were saved by {said(saved)}; this run is "
                         f"{said(layout)}: restart with that layout, or give another --sessions-dir")
    if layout is not None and saved is None:   # atomically: ranks sharing the directory read it meanwhile
        Path(sessions_dir).mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{LAYOUT_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(layout))
        os.replace(tmp, marker)


def layout_of(backend) -> Optional[dict]:
    ranks = getattr(backend, "ranks", None)
    return None if ranks is None else {"mode": backend.mode, "ranks": ranks.size}


def heartbeat(backend, timeout: float, step_timeout: float):
    """Every rank at start: the heartbeat between rank 0 and each follower (liveness.py), or None
    (both flags checked first)."""
    from ..backends.mlx.liveness import connect

    if timeout <= 0:
        raise SystemExit("localheap: --rank-timeout must be > 0 seconds")
    if step_timeout <= 0:
        raise SystemExit("localheap: --step-timeout must be > 0 seconds")
    return connect(backend.ranks, timeout)


def lead(leader, beat, step_timeout: float, on_stuck=None) -> None:
    """Rank 0: the heartbeat reports a rank gone to the Leader, and the step watch a step that has
    run `step_timeout` s; `on_stuck` fails what waits on a collective that cannot end
    (Engine.abandon), by default rank 0 exits."""
    leader.on_stuck = on_stuck or (lambda error: exit_now(f"localheap: {error}", 1))
    leader.watch(step_timeout)
    if beat is not None:   # (the Leader was made with it: its commands wake the followers)
        beat.on_lost = leader.rank_gone
        beat.start()


def exit_now(message: str, code: int) -> None:
    """End this process at once (a thread may wait in a collective for ever: a normal exit could too)."""
    log.critical("%s", message)
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StepWatch:
    """`generate --distributed`, on every rank: no step done (a prefill chunk, a token) for
    `step_timeout` s means this rank waits in a collective with a rank that is stuck or gone, which
    MLX's ring may never end: it says so and exits (status 1). `tick` after each step, `end` when done."""

    def __init__(self, step_timeout: float, rank: int):
        if step_timeout <= 0:
            raise SystemExit("localheap: --step-timeout must be > 0 seconds")
        self.step_timeout, self.rank = step_timeout, rank
        self.last = time.monotonic()
        self.done = False
        threading.Thread(target=self._run, name="localheap-step-watch", daemon=True).start()

    def tick(self, *_) -> None:
        self.last = time.monotonic()

    def end(self) -> None:
        self.done = True

    def _run(self) -> None:
        while not self.done:
            time.sleep(min(1.0, self.step_timeout / 4))
            if not self.done and time.monotonic() - self.last > self.step_timeout:
                exit_now(f"localheap: rank {self.rank}: the ranks did not answer within {self.step_timeout:g} s "
                         f"(--step-timeout): a rank is stuck or gone, its log says which", 1)


class RankSensors:
    """Rank 0's governor sensors on ranks: at an admission, every rank's memory (one collective,
    Leader.readings), so that the governor spills for the rank furthest past its RAM budget and the
    host with the least memory available; elsewhere (/health) rank 0's own reading."""

    def __init__(self, mine, leader, budget: int):
        self.mine, self.leader, self.budget = mine, leader, budget

    def memory(self):
        return self.mine.memory()

    def thermal(self) -> str:
        return self.mine.thermal()

    def admission_memory(self):
        """Rank 0's reading with the RSS of the rank furthest past its budget (as if its budget were
        rank 0's) and the least available memory of any host."""
        from ..engine.errors import RankLost

        r = self.mine.memory()
        try:
            seen = self.leader.readings(r.rss - self.budget, r.available)
        except RankLost:   # the request fails at its first heap call
            return r
        return dataclasses.replace(r, rss=self.budget + max(over for over, _ in seen),
                                   available=min(free for _, free in seen))


def own_reading(sensors, budget: int):
    """A follower's answer to rank 0's admission reading: (RSS past its budget, its host's available bytes)."""
    def read() -> tuple[int, int]:
        r = sensors.memory()
        return r.rss - budget, r.available
    return read


def follower(backend, sessions_dir: Optional[Path], beat=None, reading=None) -> int:
    """A follower rank until rank 0 stops: its own sessions directory (the same flag, on its
    host) or a temp dir when sessions are not kept. A step it failed mid-forward ends the process
    at once, which closes its ring connections and heartbeat: rank 0 knows. A rank 0 that is gone
    (its heartbeat ended) ends this process: it may be waiting in a collective for ever. `reading`:
    this rank's memory for rank 0's admissions (own_reading)."""
    from ..backends.mlx.follow import OUT_OF_STEP_EXIT, follow

    root = Path(sessions_dir) if sessions_dir is not None else Path(tempfile.mkdtemp(prefix="localheap-rank-"))
    root.mkdir(parents=True, exist_ok=True)
    log.info("rank %d follows rank 0 (sessions in %s)", backend.rank, root)
    if beat is not None:
        beat.on_lost = lambda rank, why: exit_now(f"rank 0 {why}: this rank exits", 1)
        beat.start()
    code = follow(backend, root, remove_files, reading, prune_files, wait=beat.wait_wake if beat is not None else None)
    if code == OUT_OF_STEP_EXIT:   # leave the ring now: a normal exit may wait on it, rank 0 with it
        exit_now(f"rank {backend.rank} leaves the ring (exit status {code})", code)
    if beat is not None:
        beat.close()
    return code


def remove_files(root: Path, session_id: str, keep_gen: Optional[int], whole: bool,
                 checkpoint: Optional[int] = None) -> None:
    """A follower's part of the store removing a session's files: its shards of other generations
    (or of all, and its pages and checkpoints, with `whole`) under its own sessions directory; with
    `checkpoint` (its token count), only that checkpoint's files."""
    from ..sessions.checkpoints import remove_checkpoint_files
    from ..sessions.disk import SessionDir, valid_id

    if not valid_id(session_id):
        return
    if checkpoint is not None:
        remove_checkpoint_files(root / "checkpoints" / session_id / f"{int(checkpoint)}.safetensors")
        return
    SessionDir(root).remove(session_id, keep_gen)
    if whole:
        shutil.rmtree(root / f"{session_id}.pages", ignore_errors=True)
        shutil.rmtree(root / "checkpoints" / session_id, ignore_errors=True)


def prune_files(root: Path, keep: dict, tag: str) -> None:
    """A follower at start: rank 0's saved sessions are `keep` (id -> {"gen", "checkpoints"}); this
    rank's files (named with `tag`, e.g. "tensor-rank1of2") of any other session, generation or
    checkpoint go from its sessions directory. Another rank's files sharing the directory stay."""
    from ..sessions.disk import SHARD_FILE, valid_id

    for path in sorted(root.glob(f"sess_*.{tag}.safetensors")):   # heap shards: the saved generation only
        m = SHARD_FILE.fullmatch(path.name)
        if m is not None and (keep.get(m.group(1)) or {}).get("gen") != int(m.group(2)):
            log.info("removing %s: no saved session holds it", path.name)
            path.unlink(missing_ok=True)
    rank_dir = tag.rsplit("-", 1)[1].split("of")[0]   # "rank1": its page store under <id>.pages/
    for pages in sorted(root.glob(f"sess_*.pages/{rank_dir}")):
        sid = pages.parent.name[: -len(".pages")]
        if valid_id(sid) and sid not in keep:
            shutil.rmtree(pages, ignore_errors=True)
            _rmdir_if_empty(pages.parent)
    for folder in sorted((root / "checkpoints").glob("sess_*")):   # listed now: rank 0 may be making new ones
        held = (keep.get(folder.name) or {}).get("checkpoints") or []
        for path in sorted(folder.glob(f"*.{tag}.*")):
            n = path.name.split(".")[0]
            if not (n.isdigit() and int(n) in held):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if folder.name not in keep:
            _rmdir_if_empty(folder)


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def keep_pinging(engine, leader, every: float = PING_S) -> threading.Thread:
    """An idle server still notices a lost rank (so /health says so before a request fails)."""
    def loop() -> None:
        while leader.lost is None and not leader.stopped and engine.healthy:
            threading.Event().wait(every)
            if engine.active == 0 and leader.lost is None and not leader.stopped:
                engine.call(leader.ping)

    t = threading.Thread(target=loop, name="localheap-ranks", daemon=True)
    t.start()
    return t
