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

Knows nothing about HTTP or sessions: heaps are numbered, paths are sent relative to the
sessions directory (each rank resolves them against its own).
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...engine.errors import RankLost
from ...generation import SamplingParams
from ...heap import HeapConfig
from ..paging import release_pages
from .distributed import DistributedMLXBackend

log = logging.getLogger("localheap.distributed")


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
            self.lost = (f"rank lost: {e}; the ranks cannot go on: restart every rank (mlx.launch), "
                         f"saved sessions restore with the same layout")
            log.error("%s", self.lost)
            raise RankLost(self.lost) from e

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
        self.send("new", handle=self._handles + 1, cfg=cfg.to_dict(), pages_dir=self._path(pages_dir))
        return self._adopt(self.backend.new_cache(cfg, pages_dir))

    def load_cache(self, cfg: HeapConfig, path: Path, pages_dir: Optional[Path] = None):
        self.send("load", handle=self._handles + 1, cfg=cfg.to_dict(), path=self._path(path),
                  pages_dir=self._path(pages_dir))
        return self._adopt(self._guard(lambda: self.backend.load_cache(cfg, path, pages_dir)))

    def save_cache(self, cache, path: Path, snapshot: bool = False) -> None:
        self.send("save", handle=cache.handle, path=self._path(path), snapshot=snapshot)
        self._guard(lambda: self.backend.save_cache(cache, path, snapshot))

    def prefill(self, cache, tokens, progress=None, cancelled=None) -> None:
        self.send("prefill", handle=cache.handle, tokens=[int(t) for t in tokens])
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
        self.send("generate", handle=cache.handle, gen=gen_id, tokens=[int(t) for t in new_tokens], params=sent)
        inner = self._guard(lambda: self.backend.generate(cache, new_tokens, params, progress))
        return self._tokens(gen_id, inner)

    def _tokens(self, gen_id: int, inner):
        try:
            while True:
                self.send("next", gen=gen_id)
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


def follow(backend: DistributedMLXBackend, root: Path, remove_files=None) -> int:
    """A follower rank's loop: rank 0's heap calls on this rank's shard, until it says stop;
    `remove_files(root, session_id, keep_gen, whole)` removes this rank's files of a session.
    Returns the exit status (1: rank 0 was lost)."""
    assert backend.rank != 0
    root = Path(root)
    caches: dict[int, object] = {}
    gens: dict[int, object] = {}
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
            release_pages(caches.pop(h, None))
        op = cmd["op"]
        if op == "stop":
            return 0
        try:
            if op == "new":
                caches[cmd["handle"]] = backend.new_cache(HeapConfig(**cmd["cfg"]), path(cmd["pages_dir"]))
            elif op == "load":
                caches[cmd["handle"]] = backend.load_cache(HeapConfig(**cmd["cfg"]), path(cmd["path"]),
                                                           path(cmd["pages_dir"]))
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
        except Exception as e:   # rank 0 fails the same call (its collectives agree on it): go on
            if lost(e) or lost(e.__cause__):
                log.error("a rank was lost (%s): this rank stops", e)
                return 1
            log.warning("%s failed on this rank: %s", op, e)
