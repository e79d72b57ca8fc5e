"""--disk-total: one bound on everything under the sessions directory, kept by taking space back
from idle sessions.

Every file under the directory counts (heaps, token files, pages, checkpoints, the index, files
moved aside), a file with several hard links once. Past the bound, space comes back from idle
sessions, least recently used first: their lowest-value pages (compacted out of the files),
then their checkpoints, then whole sessions (which then answer 410, like a lost one); never a
busy session. The one about to run gives back its own checkpoints, then its lowest-value pages,
only where the idle ones could not give the room. The room left is shared by the sessions that run, as
their page stores' disk budget (each drops its lowest-value pages beyond it, as --disk-budget
does), after a reserve for what their next save writes. A request that cannot fit even so is
refused: DiskTotalExceeded (507).

Also tells the store which sessions' page-out is failing (its degraded list, /health).
Engine thread only; knows nothing about tensors (the page files are heap/pages.py's).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

from ..backends.paging import release_pages
from ..heap import format_bytes
from ..heap.pages import compact_store
from .disk import INDEX
from .errors import DiskTotalExceeded, SpillFailed
from .session import Reclaims, Session

log = logging.getLogger("localheap.sessions")
TOKEN_BYTES = 4           # a saved token: one int32
INDEX_ENTRY_BYTES = 1024  # more than one session's entry in index.json takes
LOOK_INTERVAL_S = 0.25    # while a prompt is read, the directory is measured at most this often,
LOOK_SHARE = 0.05         # and for at most this share of the time (256 sessions of an 8B model: ~40 ms a look)


def dir_bytes(root: Path) -> int:
    """Bytes under `root` as `du -sb` counts them: every file and directory's size, a file with
    several hard links once (and one renamed while we walk)."""
    return scan(root)[0]


def scan(root: Path) -> tuple[int, dict[str, int]]:
    """(bytes under `root`, bytes by session id): a session's own files are `<id>.*` (heaps,
    tokens, its `.pages/`) and `checkpoints/<id>/`; a file linked from several places counts
    once, for the first session seen with it. Every file's inode is remembered, not only a linked
    one's: a file renamed (an atomic write's last step) or unlinked from a checkpoint while we walk
    would otherwise count twice, and a sampler would see bytes that were never there."""
    seen: set = set()
    by_session: dict[str, int] = {}
    total = _size(str(root))
    stack = [(str(root), None, 0)]
    while stack:
        path, owner, depth = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:   # removed while we walk
            continue
        for e in entries:
            sid = owner
            if sid is None and (depth == 0 or (depth == 1 and os.path.basename(path) == "checkpoints")):
                sid = e.name.split(".")[0] if e.name.startswith("sess_") else None
            try:
                st = e.stat(follow_symlinks=False)
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, sid, depth + 1))
                elif (st.st_dev, st.st_ino) in seen:
                    continue
                else:
                    seen.add((st.st_dev, st.st_ino))
            except OSError:
                continue
            total += st.st_size
            if sid is not None:
                by_session[sid] = by_session.get(sid, 0) + st.st_size
    return total, by_session


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _unshared_bytes(paths) -> int:
    """Bytes that removing these (distinct) files gives back: each file once, where every link to it
    is among them (a file that links elsewhere share frees nothing)."""
    found: dict[tuple[int, int], list] = {}   # (device, inode) -> [links among the paths, st_nlink, size]
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        found.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])[0] += 1
    return sum(size for seen, links, size in found.values() if seen >= links)


class DiskTotal:
    """The --disk-total bound (bytes; 0: none) on `store`'s directory."""

    def __init__(self, store: Any, total: int = 0):
        assert total >= 0
        self.store, self.total = store, total
        self.reclaimed = Reclaims()
        self.expect: dict[str, int] = {}   # running session id -> tokens it holds when its run ends
        self.faults_before: dict[str, tuple[int, int]] = {}   # running session id -> its pages failed, lost
        self.used = 0                      # bytes under the directory at the last look
        self.by_session: dict[str, int] = {}
        self._looked_at = 0.0
        self._look_s = 0.0                 # how long the last look took
        self.waiting: Callable[[], set[str]] = set   # ids that jobs waiting to start name (the engine's): kept

    # --- the engine's hooks ---

    def admit(self, s: Session, tokens: int) -> None:
        """Before a run on `s` that ends with about `tokens` tokens: make room, or raise DiskTotalExceeded."""
        self.expect[s.id] = tokens
        pages = self._pages(s)
        self.faults_before[s.id] = (pages.failed, pages.lost) if pages is not None else (0, 0)
        try:
            self.fit(keep=s, strict=True)
        except DiskTotalExceeded:
            self.expect.pop(s.id, None)
            raise

    def grew(self) -> None:
        """A running session read a prompt chunk (its pages grew): keep the bound, now and then (between
        looks, each running page store keeps inside the share the last look gave it)."""
        if self.total and time.monotonic() - self._looked_at >= max(LOOK_INTERVAL_S, self._look_s / LOOK_SHARE):
            self.fit()

    def ended(self, s: Session) -> None:
        """A run on `s` ended (its turn saved): report its page-out, and take space back if needed."""
        self.expect.pop(s.id, None)
        self.note_pages(s)
        if self.total:
            self.fit()

    def room_for(self, nbytes: int, *keep: Session) -> None:
        """Before a write of about `nbytes` outside a run (a checkpoint, a fork's copy of one): make
        room, never from `keep` nor a running session, or raise DiskTotalExceeded."""
        if not self.total:
            return
        ids = {s.id for s in self.store.sessions() if s.busy} | {s.id for s in keep}
        need = self._beside_running(nbytes)
        over = self.usage() + need - self.total
        if over > 0:
            held = self._held(ids)
            if held + need > self.total:
                raise DiskTotalExceeded(nbytes, self.total, held)
            self.reclaim(over, exclude=ids)
            if self.usage() + need > self.total:
                raise DiskTotalExceeded(nbytes, self.total, self.used)

    def fits(self, nbytes: int) -> bool:
        """Whether a write of about `nbytes` fits under the bound as the directory is, beside what
        the running sessions may still add, with nothing taken back (an optional write: the
        document's own checkpoint)."""
        return not self.total or self.usage() + self._beside_running(nbytes) <= self.total

    def _beside_running(self, nbytes: int) -> int:
        """`nbytes` and what the running sessions may still add (their reserves)."""
        return nbytes + sum(self.reserve(s) for s in self.store.sessions() if s.busy)

    # --- the bound ---

    def usage(self) -> int:
        t0 = time.monotonic()
        self.used, self.by_session = scan(self.store.spill_dir)
        self._looked_at = time.monotonic()
        self._look_s = self._looked_at - t0
        return self.used

    def _index_rewrite(self) -> int:
        """A commit writes the index beside the old one, then renames it: room for a second copy
        (grown by an entry)."""
        try:
            return (self.store.spill_dir / INDEX).stat().st_size + INDEX_ENTRY_BYTES
        except OSError:
            return INDEX_ENTRY_BYTES

    def reserve(self, s: Session, pages: bool = True) -> int:
        """What a running session may still add: its next save and a checkpoint (a document's), each
        a heap and its tokens, its own copy of the page files a checkpoint links (taken before a
        drop) and, with `pages`, the pages of the prompt it has yet to read (to keep its recall)."""
        tokens = max(len(s.fed), self.expect.get(s.id, 0))
        need = 2 * (self.store.heap_bytes() + TOKEN_BYTES * tokens)
        store = self._pages(s)
        if store is not None:
            need += store.shared_bytes + store.state_bytes   # a commit writes its next state beside the last
        if pages and store is not None:
            grow = int((tokens - len(s.fed) + s.cfg.chunk) * store.disk_bytes_per_token())
            if s.cfg.disk_budget:   # never more than its own --disk-budget
                grow = min(grow, max(0, s.cfg.disk_budget - store.disk_bytes))
            need += grow
        return need

    def fit(self, keep: Optional[Session] = None, strict: bool = False) -> None:
        """Keep the directory, plus what the running sessions may still add, inside the bound:
        take space back from idle sessions, then share what is left among the running ones.
        `strict` (a run about to start on `keep`): DiskTotalExceeded when it cannot fit."""
        if not self.total:
            return
        running = [s for s in self.store.sessions() if s.busy or s is keep]
        ids = {s.id for s in running}
        need = sum(self.reserve(s) for s in running) + self._index_rewrite()
        over = self.usage() + need - self.total

        def least() -> int:   # the least they can run with: their saves, without pages (they page out
            return sum(self.reserve(s, pages=False) for s in running) + self._index_rewrite()   # what room is left)

        def own() -> int:   # what its own checkpoints and pages give back, and the copy of the pages they
            pinned = getattr(self._pages(keep), "shared_bytes", 0)   # pin that its reserve then no longer needs
            return self._own_freeable(keep) + pinned

        if over > 0 and strict:   # refused before anything is taken back when even all of it would not do,
            held = self._held(ids)
            if held - own() + least() > self.total:   # its own pages and checkpoints gone too
                raise DiskTotalExceeded(self.reserve(keep, pages=False), self.total, held, least())
        if over > 0:
            self.reclaim(over, exclude=ids)
            self.usage()   # (measured again only where something may have been taken back)
        if strict and self.used + least() > self.total:
            # measured again, the idle ones' space taken: where all its own would not do either, it keeps it
            if self.used - own() + least() > self.total:
                raise DiskTotalExceeded(self.reserve(keep, pages=False), self.total, self.used, least())
            self._own_room(keep, lambda: self.usage() + least() - self.total)
        if strict and self.used + least() > self.total:
            raise DiskTotalExceeded(self.reserve(keep, pages=False), self.total, self.used, least())
        self._share(running, max(0, self.total - self.used - least()))

    def _own_room(self, s: Session, over) -> None:
        """The session about to run, where the idle ones could not give the room (`over()`: bytes still
        wanted): its checkpoints (their links pin its page files: a page dropped in one would be a
        copy first), then its lowest-value pages, as an idle session's (spilled, its closed store
        compacted, made resident again)."""
        for step in (self._drop_checkpoints, self._drop_pages, self._drop_pages):   # (pages again: what a
            wanted = over()                                               # compaction frees is not all a drop's)
            if wanted <= 0:
                return
            got = step(s, wanted)
            self.reclaimed.add(got)
            s.reclaimed.add(got)
            self.store.make_resident(s)
            s.refresh()
            if got.bytes or got.checkpoints:
                log.warning("--disk-total: session %s, about to run, gave back its own %s (the idle ones could "
                            "not give the room)", s.id, "checkpoints" if step == self._drop_checkpoints else "pages")

    def _held(self, ids: set[str]) -> int:
        """Bytes under the directory that taking space back from idle sessions leaves: all but what the
        idle ones (not `ids`, nor waited for by a queued request) hold."""
        keep = ids | self.waiting()
        return self.used - sum(b for sid, b in self.by_session.items() if sid not in keep and sid in self.store)

    def _own_freeable(self, s: Session) -> int:
        """What the session's own checkpoints and page files can give back: their files that no
        other folder links (a fork's pages, another's checkpoint: pinned), each once; not its page
        store's state files, which a compaction keeps."""
        pages, checkpoints = self.store.pages_dir(s), self.store.checkpoints.root / s.id
        files = [*pages.glob("layer*.pages"), *(p for p in checkpoints.rglob("*") if p.is_file())]
        return _unshared_bytes(files)

    def _share(self, running: list[Session], room: int) -> None:
        """Each running page store may grow its files by an equal part of `room`: its disk budget
        becomes that, less the dropped slots its files hold (reused only within their layer)."""
        stores = [(s, p) for s in running if (p := self._pages(s)) is not None]
        for s, p in stores:
            files = p.file_bytes
            live = max(1, files + room // len(stores) - (files - p.disk_bytes))   # 1: under a record, no pages
            p.disk_budget = min(s.cfg.disk_budget, live) if s.cfg.disk_budget else live
            grown = max(1, files + room // len(stores))   # its files, holes and all, by the same part
            p.file_budget = min(s.cfg.disk_budget, grown) if s.cfg.disk_budget else grown

    # --- taking space back ---

    def reclaim(self, need: int, exclude: set[str]) -> int:
        """Free at least `need` bytes if idle sessions hold them: least recently used first, their
        pages, then their checkpoints (and the pages those shared), then whole sessions. Returns bytes freed."""
        freed = 0
        exclude = exclude | self.waiting()   # a request waiting for its turn on it: not idle
        for step in (self._drop_pages, self._drop_checkpoints, self._drop_pages, self._drop_session):
            idle = sorted((s for s in self.store.sessions() if s.id not in exclude and not s.busy),
                          key=lambda s: s.last_used)
            for s in idle:
                if freed >= need:
                    return freed
                got = step(s, need - freed)
                freed += got.bytes
                self.reclaimed.add(got)
                if s.id in self.store:
                    s.reclaimed.add(got)
                    s.refresh()
        return freed

    def _drop_pages(self, s: Session, need: int) -> Reclaims:
        root = self.store.pages_dir(s)
        if not root.is_dir():
            return Reclaims()
        if s.cache is not None:   # resident: spilled first (free when its copy on disk is current), store closed
            cache = s.cache
            try:
                self.store.spill(s.id)
            except SpillFailed as e:
                log.warning("--disk-total: session %s not spilled, its pages stay: %s", s.id, e)
                return Reclaims()
            release_pages(cache)
        try:
            # at the state its committed heap file names (no saved turn: nothing of it is kept)
            dropped, freed = compact_store(root, 0, s.saved_gen)   # dropped slots first: that loses nothing
            if freed < need:
                more = compact_store(root, need - freed, s.saved_gen)
                dropped, freed = dropped + more[0], freed + more[1]
        except (OSError, ValueError, KeyError) as e:   # CorruptPageState too: rebuilt when used
            log.warning("--disk-total: pages of session %s not compacted: %s", s.id, e)
            return Reclaims()
        if dropped or freed:
            log.info("--disk-total: session %s: %d lowest-value pages dropped, %s freed", s.id, dropped,
                     format_bytes(freed))
        return Reclaims(pages=dropped, bytes=freed)

    def _drop_checkpoints(self, s: Session, need: int) -> Reclaims:
        cps = self.store.checkpoints.of(s.id)
        if not cps:
            return Reclaims()
        folder = self.store.checkpoints.root / s.id
        freed = _unshared_bytes(p for p in folder.rglob("*") if p.is_file())
        self.store.checkpoints.drop(s.id)
        s.checkpoints = []
        log.info("--disk-total: session %s: %d checkpoints removed, %s freed", s.id, len(cps), format_bytes(freed))
        return Reclaims(checkpoints=len(cps), bytes=freed)

    def _drop_session(self, s: Session, need: int) -> Reclaims:
        root = self.store.spill_dir
        paths = [*root.glob(f"{s.id}.*"), *self.store.pages_dir(s).rglob("*"),
                 *(self.store.checkpoints.root / s.id).rglob("*")]
        freed = _unshared_bytes(p for p in paths if p.is_file())
        if not freed:   # nothing of it on disk (just created, never saved): deleting it gives no room
            return Reclaims()
        self.store.delete(s.id)
        self.store.forget(s.id, "deleted to stay inside --disk-total")
        log.warning("--disk-total: idle session %s deleted (%s freed)", s.id, format_bytes(freed))
        return Reclaims(sessions=1, bytes=freed)

    # --- page-out faults ---

    def note_pages(self, s: Session) -> None:
        """Once its queued writes are done: the session is degraded (the store's list, /health) while
        its page-out fails, and when its latest run lost pages; a run without loss clears it."""
        failed0, lost0 = self.faults_before.pop(s.id, (0, 0))
        pages = self._pages(s)
        if pages is None:
            return
        try:
            s.cache.writer.drain()
        except Exception as e:   # noqa: BLE001 - a failed write job: the session serves on without it
            log.error("session %s: page-out failed: %s", s.id, e)
            pages.fault = pages.fault or f"page-out failed: {e}"
        why = [pages.fault] if pages.fault else []
        if pages.failed > failed0:
            why.append(f"{pages.failed - failed0} pages not written in its latest turn")
        if pages.lost > lost0:
            why.append(f"{pages.lost - lost0} pages lost with its removed page directory")
        key = f"{s.id}:recall"
        if why:
            self.store.mark_degraded(key, f"session {s.id}: recall degraded: {'; '.join(why)}")
        else:
            self.store.clear_degraded(key)

    @staticmethod
    def _pages(s: Session):
        return getattr(s.cache, "pages", None) if s.cache is not None else None

    def snapshot(self) -> dict:
        return {"total_bytes": self.total, "used_bytes": self.used, "reclaimed": asdict(self.reclaimed)}
