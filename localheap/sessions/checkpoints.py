"""Checkpoints: a session's heap and tokens saved at a point, to fork new sessions from.

A document read is checkpointed, so an edited or regenerated turn after it starts from the
checkpoint instead of reading the document again. Files live under `root/<session id>/`:
`<tokens>.safetensors` (the backend's save_cache format), `<tokens>.tokens` (int32 ids) and,
with recall on, `<tokens>.pages/` (hard links of the session's page store as it was: the
store never rewrites what a checkpoint can see, heap/pages.py). A fork gets hard links to the
checkpoints it inherits, so each session owns its files, and its own copy of the page store.

Engine thread only, like the store; knows nothing about tensors (the backend saves and loads).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from .. import faults
from ..heap import HeapConfig
from ..heap.pages import link_tree
from ..heap.private import FILE_MODE, private_dir, write_private
from .disk import read_token_file
from .errors import SpillFailed
from .session import Session, token_array

log = logging.getLogger("localheap.sessions")
PER_SESSION = 4   # kept per session (a checkpoint is a heap's worth of disk)
MAX_TOTAL = 32    # kept in all; the oldest go first beyond


@dataclass(eq=False)
class Checkpoint:
    session_id: str
    tokens: Any    # array('i'): the session's tokens at the checkpoint
    path: Path     # heap file; the tokens sit beside it (.tokens)
    seq: int = 0   # creation order, for the global cap

    @property
    def n(self) -> int:
        return len(self.tokens)


class Checkpoints:
    def __init__(self, root: Path, backend: Any, per_session: int = PER_SESSION, max_total: int = MAX_TOTAL):
        assert 2 <= per_session <= max_total
        self.root, self.backend = Path(root), backend
        self.per_session, self.max_total = per_session, max_total
        self._by_session: dict[str, list[Checkpoint]] = {}
        self._owners: dict[str, Session] = {}
        self._seq = 0

    def of(self, session_id: str) -> list[Checkpoint]:
        return list(self._by_session.get(session_id, []))

    def all(self) -> list[Checkpoint]:
        return [c for cs in self._by_session.values() for c in cs]

    def nearest(self, session_id: str, tokens: int) -> Optional[Checkpoint]:
        """The session's latest checkpoint at or before `tokens`."""
        fitting = [c for c in self.of(session_id) if c.n <= tokens]
        return max(fitting, key=lambda c: c.n) if fitting else None

    def save(self, s: Session) -> Checkpoint:
        """Checkpoint a resident, idle session at its current tokens."""
        assert s.cache is not None and not s.busy
        for c in self.of(s.id):
            if c.n == len(s.fed) and c.tokens == s.fed:
                return c
        path = self.root / s.id / f"{len(s.fed)}.safetensors"
        try:
            private_dir(path.parent)
            _write_tokens(path.with_suffix(".tokens"), s.fed)   # tokens first: the heap file marks it complete
            faults.step("checkpoint.tokens")
            self.backend.save_cache(s.cache, path, snapshot=True)   # written atomically by the backend
        except BaseException as e:
            try:
                remove_checkpoint_files(path)
                path.with_name(path.with_suffix(".tokens").name + ".tmp").unlink(missing_ok=True)
            except OSError:   # (the folder itself is what failed)
                pass
            if isinstance(e, OSError) and not isinstance(e, SpillFailed):   # full, read-only, a folder gone or
                raise SpillFailed(self.root, e) from e                        # a file in its place: a 507
            raise
        faults.step("checkpoint.heap")
        return self._add(s, Checkpoint(s.id, token_array(s.fed), path))

    def load(self, c: Checkpoint, cfg: HeapConfig, pages_dir: Optional[Path] = None) -> Any:
        """A new cache holding the checkpoint's heap; with recall on, its page store is a copy
        made in `pages_dir` (the forked session's)."""
        return self.backend.load_cache(cfg, c.path, pages_dir=pages_dir)

    def inherit(self, parent: Checkpoint, child: Session) -> None:
        """Give a session forked at `parent` its own copies (hard links) of the parent
        session's checkpoints up to and including `parent`."""
        for c in self.of(parent.session_id):
            if c.n > parent.n or c.tokens != parent.tokens[:c.n]:
                continue
            try:
                self._inherit_one(c, child)
            except OSError as e:
                try:
                    remove_checkpoint_files(self.root / child.id / c.path.name)
                except OSError:
                    pass
                if not c.path.exists():   # its files are gone (removed under the server): it is forgotten
                    log.warning("checkpoint %s: its files are gone (%s); forgotten", c.path, e)
                    self._remove(c)
                    continue
                raise SpillFailed(self.root, e) from e

    def _inherit_one(self, c: Checkpoint, child: Session) -> None:
        """inherit's work for one checkpoint: the child's links to its files, registered."""
        path = self.root / child.id / c.path.name
        private_dir(path.parent)
        if c.path.with_suffix(".pages").is_dir():
            link_tree(c.path.with_suffix(".pages"), path.with_suffix(".pages"))
        shards = sorted(c.path.parent.glob(f"{c.path.stem}.*-rank*of*"))   # --distributed: this host's ranks'
        for shard in (x for x in shards if x.is_dir()):
            link_tree(shard, path.parent / shard.name)
        files = [(x, path.parent / x.name) for x in shards if not x.is_dir()]
        for src, dst in (*files, (c.path.with_suffix(".tokens"), path.with_suffix(".tokens")), (c.path, path)):
            try:
                os.link(src, dst)
            except OSError:   # a filesystem without hard links
                shutil.copyfile(src, dst)
                os.chmod(dst, FILE_MODE)
        self._add(child, Checkpoint(child.id, c.tokens, path))

    def adopt(self, s: Session, c: Checkpoint) -> Checkpoint:
        """Register a checkpoint whose files were put in the session's folder from elsewhere (a
        slot file read back, engine/slotstate.py)."""
        assert c.session_id == s.id and c.path.parent == self.root / s.id and c.path.exists()
        return self._add(s, c)

    def drop(self, session_id: str) -> None:
        self._by_session.pop(session_id, None)
        self._owners.pop(session_id, None)
        shutil.rmtree(self.root / session_id, ignore_errors=True)

    def load_persisted(self, sessions: Iterable[Session]) -> int:
        """Register the checkpoints on disk of known sessions (each lists them again); remove those
        of unknown ones, and what a checkpoint interrupted by a crash left (a token file or page
        links without the heap file that completes it, temp files). Never raises on the content."""
        if not self.root.is_dir():
            return 0
        known = {s.id: s for s in sessions}
        try:
            folders = sorted(self.root.iterdir())
        except OSError as e:   # (unreadable: its sessions start with no checkpoints; nothing is removed)
            log.warning("checkpoints %s not read (%s); sessions start without them", self.root, e)
            return 0
        found = 0
        for folder in folders:
            try:
                found += self._load_folder(folder, known)
            except OSError as e:
                log.warning("checkpoints %s not read (%s); left as they are", folder, e)
        return found

    def _load_folder(self, folder: Path, known: dict) -> int:
        """load_persisted's work for one session's folder: the checkpoints registered."""
        found = 0
        s = known.get(folder.name)
        if s is None or not folder.is_dir():
            log.info("removing checkpoints %s: they belong to no session", folder)
            shutil.rmtree(folder, ignore_errors=True) if folder.is_dir() else folder.unlink(missing_ok=True)
            return 0
        entries = sorted(folder.iterdir())   # (unreadable: raises before anything is registered or removed)
        kept = set()
        heaps = (p for p in entries if p.suffix == ".safetensors")
        for path in sorted(heaps, key=lambda p: int(p.stem) if p.stem.isdigit() else -1):
            tokens_file = path.with_suffix(".tokens")
            if not path.stem.isdigit() or not tokens_file.exists():
                continue
            try:
                tokens = read_token_file(tokens_file)
            except (OSError, ValueError) as e:
                log.warning("checkpoint %s: unreadable token file (%s); removed", path, e)
                continue
            if len(tokens) != int(path.stem):
                log.warning("checkpoint %s: token file does not match its name; removed", path)
                continue
            self._add(s, Checkpoint(s.id, tokens, path))
            kept.add(path.stem)
            found += 1
        for leftover in entries:
            if leftover.name.split(".")[0] not in kept or leftover.name.endswith(".tmp") or ".tmp." in leftover.name:
                log.info("removing %s: left by a checkpoint that never completed", leftover)
                shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
        s.refresh()
        return found

    def _add(self, s: Session, c: Checkpoint) -> Checkpoint:
        self._seq += 1
        c.seq = self._seq
        self._owners[s.id] = s
        kept = sorted(self.of(s.id) + [c], key=lambda x: x.n)
        if len(kept) > self.per_session:
            self._remove_files(kept.pop(1))   # keep the first (often a document) and the newest ones
        self._by_session[s.id] = kept
        s.checkpoints = [x.n for x in kept]
        s.refresh()   # the snapshot lists them (a restarted session too)
        while len(self.all()) > self.max_total:
            self._remove(min((x for x in self.all() if x is not c), key=lambda x: x.seq))
        return c

    def discard(self, c: Checkpoint) -> None:
        """Forget a checkpoint found unreadable, and remove its files."""
        self._remove(c)

    def _remove(self, c: Checkpoint) -> None:
        self._remove_files(c)
        left = [x for x in self._by_session.get(c.session_id, []) if x is not c]
        self._by_session[c.session_id] = left
        if c.session_id in self._owners:
            self._owners[c.session_id].checkpoints = [x.n for x in left]
            self._owners[c.session_id].refresh()   # (the listing's snapshot too)


    def _remove_files(self, c: Checkpoint) -> None:
        """A checkpoint's files here, and where other ranks keep theirs (--distributed), theirs."""
        remove_checkpoint_files(c.path)
        remove = getattr(self.backend, "remove_checkpoint_files", None)
        if remove is not None:
            try:
                remove(c.session_id, c.n)
            except Exception as e:   # a lost rank: what it kept stays on its disk
                log.warning("checkpoint %s: the other ranks' files not removed: %s", c.path, e)


def remove_checkpoint_files(path: Path) -> None:
    """A checkpoint's files: the heap file at `path`, its tokens and its pages, and the shards of
    the ranks that keep theirs on this host (--distributed)."""
    path.unlink(missing_ok=True)
    path.with_suffix(".tokens").unlink(missing_ok=True)
    shutil.rmtree(path.with_suffix(".pages"), ignore_errors=True)
    for shard in path.parent.glob(f"{path.stem}.*-rank*of*"):   # this host's ranks' shards (--distributed)
        shutil.rmtree(shard, ignore_errors=True) if shard.is_dir() else shard.unlink(missing_ok=True)


def _write_tokens(path: Path, tokens) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with write_private(tmp) as f:
        tokens.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
