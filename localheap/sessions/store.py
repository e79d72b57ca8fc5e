"""SessionStore: sessions by id, heaps allocated lazily, least recently used ones spilled to disk.

Mutating methods run on the engine thread only (it owns the backend); `infos()` and `info()`
read published snapshots and are safe from any thread.
"""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Optional

from .. import faults
from ..backends.paging import commit_pages, release_pages
from ..heap import HeapConfig
from .checkpoints import Checkpoints
from .disk import SessionDir, file_crc, new_id, valid_id
from .diskbudget import DiskTotal
from .errors import SessionBusy, SessionLost, SessionNotFound, SpillFailed
from .recover import recover_sessions
from .session import ORIGINS, Session

FULL = {errno.ENOSPC, errno.EDQUOT}   # a write refused for room (the directory is writable)
DIR_FULL = "sessions-dir:full"        # the degraded key of a directory found full at start

ANY_OWNER = object()   # info() without an ownership check (the server's own lookups)
log = logging.getLogger("localheap.sessions")


def points_entry(points: Optional[tuple]) -> dict:
    """Where a saved copy rolls back to and whether it can be cut, for the index: a session read
    back at start then rolls back and is cut as before the restart (recover.py reads them)."""
    if points is None:
        return {}
    floor, reply_start, cuttable = points
    return {"rollback_floor": floor, "reply_start": reply_start, "cuttable": bool(cuttable)}


class SessionStore:
    """durable: the directory is the sessions' record across restarts: every change is
    committed to its index, a heap saved after each turn stays on disk after a restore,
    and the engine saves a session after each turn (kill -9 loses at most the turn in flight).
    Otherwise the directory only holds spilled heaps. Raises SpillFailed at once when the
    directory cannot be written."""

    def __init__(self, backend: Any, cfg: HeapConfig, spill_dir: Optional[Path] = None,
                 max_resident: int = 8, max_sessions: int = 256, durable: bool = False, disk_total: int = 0,
                 cache_reuse: int = 0):
        assert max_resident >= 1 and max_sessions >= max_resident
        self.backend = backend
        self.cfg = cfg
        self.model_id = getattr(backend, "model_name", "model")
        self.model_key = getattr(backend, "model_key", None)   # its checkpoint's fingerprint (models.model_fingerprint)
        self._own_dir = spill_dir is None
        self.spill_dir = Path(spill_dir or tempfile.mkdtemp(prefix="localheap-sessions-"))
        self.dir = SessionDir(self.spill_dir)
        full = None
        try:
            self.dir.check()
        except SpillFailed as e:   # full, not unwritable (a crash on a full disk): start, to read what is saved
            if not (durable and isinstance(e.cause, OSError) and e.cause.errno in FULL):   # and to make room
                raise
            full = e
        self.durable = durable
        self.max_resident = max_resident
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()   # guards the dict against readers on other threads
        self._lost: dict[str, str] = {}  # ids whose saved files were unreadable -> why (410, not 404)
        self.spills = 0
        self.restores = 0
        self.checkpoints = Checkpoints(self.spill_dir / "checkpoints", backend)
        self.disk = DiskTotal(self, disk_total)   # --disk-total (0: none) and page-out faults
        self.degraded: dict[str, str] = {}        # what /health reports: key -> reason
        if full is not None:   # (cleared by the first save that succeeds)
            self.mark_degraded(DIR_FULL, f"{full}: sessions are read, none saved until there is room "
                                         f"(delete sessions, or start with --disk-total)")
        self.rebuilt = 0                          # heaps rebuilt from their tokens (unreadable heap or pages)
        self.rollbacks = 0                        # sessions rolled back to a prompt's shared prefix (engine/branching.py)
        self.rewinds = 0                          # of those, past an eviction (backends/slots.py)
        self.rollbacks_refused = 0                # rewinds and cuts the page store's disk refused (the prompt read anew)
        self.cuts = 0                             # sessions cut to a client's trimmed history (--cache-reuse)
        self.cache_reuse = cache_reuse            # fewest tokens of a run a trimmed history keeps (0: none)

    def room_again(self) -> None:
        """Clear DIR_FULL where the directory takes a write again (what a crash left was read, and
        cleaned up, or --disk-total reclaimed)."""
        if DIR_FULL in self.degraded:
            try:
                self.dir.check()
            except SpillFailed:
                return
            self.clear_degraded(DIR_FULL)

    def mark_degraded(self, key: str, reason: str) -> None:
        if self.degraded.get(key) != reason:
            log.warning("degraded: %s", reason)
        self.degraded[key] = reason

    def clear_degraded(self, key: str) -> None:
        if self.degraded.pop(key, None) is not None:
            log.info("no longer degraded: %s", key)

    def forget(self, session_id: str, reason: str) -> None:
        """A session removed by the server itself: its id answers SessionLost (410), not 404."""
        self._lost[session_id] = reason

    # --- lookup (engine thread) ---

    def create(self, session_id: Optional[str] = None, origin: str = "api", title: Optional[str] = None,
               owner: Optional[str] = None, ephemeral: bool = False, strict: bool = False,
               cfg: Optional[HeapConfig] = None, scratch: bool = False) -> Session:
        """A new, empty session. strict: it must be in the index (durable stores) before anyone is
        told it exists, or it is not made (SpillFailed: disk full or read-only). `cfg`: an
        ephemeral session's own heap, no larger than the store's (an embedding's, sized to its input)."""
        assert origin in ORIGINS, origin
        assert cfg is None or ephemeral, "only a session that is never saved has heap settings of its own"
        s = Session(id=session_id or new_id(), cfg=cfg or self.cfg, origin=origin, title=title, owner=owner,
                    ephemeral=ephemeral, sized=cfg is not None, scratch=scratch)
        assert valid_id(s.id), s.id
        s.refresh()
        with self._lock:
            assert s.id not in self._sessions
            self._sessions[s.id] = s
        if not strict:
            if not (ephemeral or scratch):   # (the index never names those: nothing to rewrite)
                self._try_commit()
            return s
        try:
            self._commit()
        except SpillFailed:
            with self._lock:
                del self._sessions[s.id]
            raise
        return s

    def get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            self._not_found(session_id)
        return s

    def _not_found(self, session_id: str):
        """SessionLost for a session whose files could not be read (tell the client to resend
        the history), SessionNotFound for an id never seen."""
        if session_id in self._lost:
            raise SessionLost(session_id, self._lost[session_id])
        raise SessionNotFound(session_id)

    def set_title(self, session_id: str, title: Optional[str], replace: bool = True) -> None:
        """Name a session; replace=False names it only if it has no title yet."""
        s = self.get(session_id)
        if replace or s.title is None:
            s.title = title
            s.refresh()
            self._try_commit()   # the index holds titles: a durable store keeps this one too

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def delete(self, session_id: str) -> None:
        s = self.get(session_id)
        if s.busy:
            raise SessionBusy(session_id)
        with self._lock:
            del self._sessions[session_id]
        release_pages(s.cache)
        s.cache = None
        if not (s.ephemeral or s.scratch):
            self._try_commit()
        self._remove_files(s)
        self.checkpoints.drop(session_id)
        shutil.rmtree(self.pages_dir(s), ignore_errors=True)
        self._mirror_removal(s.id, None, whole=True)
        for key in [k for k in self.degraded if k.split(":")[0] == session_id]:
            self.clear_degraded(key)

    def pages_dir(self, s: Session) -> Path:
        """The session's page store (recall on): kept across spills and restarts, removed with it."""
        return self.spill_dir / f"{s.id}.pages"

    # --- heap residency (engine thread) ---

    def heap_bytes(self) -> int:
        """Bytes one more resident heap costs."""
        return self.backend.heap_bytes(self.cfg)

    def resident_bytes(self) -> int:
        return sum(self.heap_bytes() for s in self.sessions() if s.cache is not None)

    def make_resident(self, s: Session) -> None:
        """Give the session a cache: restore it from disk, or allocate an empty heap."""
        if s.cache is not None:
            return
        if s.spill_path is not None:
            self.restore(s.id)
        else:
            assert not s.fed, "a session with history and no cache must have been spilled"
            # recall: the session's pages live beside its other files from the start
            extra = {"pages_dir": self.pages_dir(s)} if s.cfg.recall else {}
            s.cache = self.backend.new_cache(s.cfg, **extra)
            s.refresh(self.backend.stats(s.cache))

    def spill(self, session_id: str) -> Path:
        """Free the session's heap, saving it first unless the copy on disk is current (a scratch
        session's is never written: _release_scratch). Raises SpillFailed (the session stays
        resident) when the directory refuses the write."""
        s = self.get(session_id)
        if s.busy:
            raise SessionBusy(session_id)
        if s.cache is None:
            return s.spill_path or self.spill_dir
        if s.scratch:   # a cache for an editor's next completion: not worth a disk write
            self._release_scratch(s)
            return self.spill_dir
        if not s.saved:
            self.save(s)
        s.rollback_mark = None   # the file keeps no sliding layers' mark (RAM only): no rollback to it
        s.cache = None
        self.spills += 1
        s.refresh()
        return s.spill_path

    def save(self, s: Session) -> None:
        """Write the session's heap and tokens as a new generation and commit it (durable: in
        the index). The heap file names the page store's state of the same generation (written
        by the backend's save, heap/pages.py), so the index's rename is the one commit point of
        the heap, the tokens and the pages; the previous generation stays in force until then.
        Raises SpillFailed when the directory refuses a write (nothing of the turn is in force)."""
        self.commit_save(s, self.write_heap(s))

    def write_heap(self, s: Session) -> tuple[int, int]:
        """save's first half: the next generation's heap file, written and read back for its CRC;
        returns (generation, crc) for commit_save. It reads the session's cache and writes that
        file alone (nothing of the store), so another thread may run it while the session is busy
        and out of the batch (the engine's saver). On failure what it wrote is removed."""
        assert s.cache is not None
        gen = 0 if s.saved_gen is None else s.saved_gen + 1
        try:
            # a backend that writes several files (one per rank) makes them whole itself
            write = self.dir.write_by if getattr(self.backend, "writes_own_files", False) else self.dir.write_with
            write(self.dir.heap_path(s.id, gen), lambda path: self.backend.save_cache(s.cache, path))
            faults.step("save.heap")
            return gen, file_crc(self.dir.heap_path(s.id, gen))
        except BaseException as e:
            self._remove_gen(s.id, gen)
            if isinstance(e, OSError):   # reading the heap file back
                raise SpillFailed(self.spill_dir, e) from e
            raise

    def commit_save(self, s: Session, written: tuple[int, int]) -> None:
        """save's second half, after write_heap: the tokens, the index (the commit), then the
        previous generation's files removed."""
        gen, crc = written
        old = (s.spill_path, s.saved_gen, s.saved_tokens, s.dirty, s.heap_crc, s.saved_crc, s.saved_points,
               s.saved_turns, s.saved_unfed, s.saved_ends_in_reply, s.saved_stats)
        try:
            self.dir.write_tokens(s.id, gen, s.fed)
            faults.step("save.tokens")
            s.spill_path, s.saved_gen, s.saved_tokens, s.dirty = self.dir.heap_path(s.id, gen), gen, len(s.fed), False
            s.heap_crc, s.saved_crc = crc, zlib.crc32(s.fed.tobytes())
            s.saved_points = (s.rollback_floor, s.reply_start, s.cuttable)   # the heap's (the session is idle)
            s.saved_turns, s.saved_unfed, s.saved_ends_in_reply = s.turns, s.unfed_reply, s.ends_in_reply
            s.saved_stats = s.stats.to_dict(per_layer=False) if s.stats is not None else None
            self._commit()
            faults.step("save.index")
        except BaseException as e:
            (s.spill_path, s.saved_gen, s.saved_tokens, s.dirty, s.heap_crc, s.saved_crc, s.saved_points,
             s.saved_turns, s.saved_unfed, s.saved_ends_in_reply, s.saved_stats) = old
            self._remove_gen(s.id, gen)
            if isinstance(e, OSError):
                raise SpillFailed(self.spill_dir, e) from e
            raise
        self._remove_files(s, keep_gen=gen)   # the old generation: no longer in force
        commit_pages(s.cache, s.spill_path)    # nor the page store's states other than this one
        faults.step("save.prune")

    def restore(self, session_id: str) -> Session:
        """Load a spilled session's heap back (bit-identical to when it was saved). A copy that
        cannot be read (its CRC, its file, its page store's state) is moved aside and the heap
        rebuilt from the session's tokens; a session without tokens is dropped: SessionLost."""
        s = self.get(session_id)
        if s.cache is not None or s.spill_path is None:
            return s
        cache = None
        try:
            if s.heap_crc is not None and file_crc(s.spill_path) != s.heap_crc:
                raise ValueError("its checksum does not match the index")
            cache = self.backend.load_cache(s.cfg, s.spill_path)
            if self.backend.tokens_in_cache(cache) != len(s.fed):
                raise ValueError(f"heap holds {self.backend.tokens_in_cache(cache)} tokens, history {len(s.fed)}")
            s.cache, s.dirty = cache, False
            s.rollback_mark = None   # a mark lives in the cache object it was taken on, never on disk
            s.cfg = getattr(cache, "cfg", s.cfg)   # the heap as it was saved (settings may have changed)
        except Exception as e:
            if cache is not None:   # loaded, but not this session's: its page files closed first
                release_pages(cache)
            if getattr(e, "heap_file_intact", False):   # it failed elsewhere (another rank): try again later
                raise
            if not s.fed:
                self._lose(s, f"unreadable heap file: {type(e).__name__}: {e}")
            self._rebuild(s, f"{type(e).__name__}: {e}")
            cache = s.cache
        if not self.durable:                   # the copy only served this spill: free the disk
            self._remove_files(s)
            s.spill_path, s.saved_gen = None, None
        self.restores += 1
        s.refresh(self.backend.stats(cache))
        return s

    def _rebuild(self, s: Session, why: str) -> None:
        """The heap file or the page store's state is unreadable but the tokens are intact (checked
        against the index at startup): read them through a new heap again (the turns' recalls are
        not replayed: the heap is the one a single prefill of the history leaves), and save it."""
        log.warning("session %s: saved heap or pages unreadable (%s); rebuilding from its %d tokens",
                    s.id, why, len(s.fed))
        if s.spill_path is not None and s.spill_path.exists():
            self.dir.move_aside([s.spill_path], f"session {s.id}: unreadable heap file")
        extra = {"pages_dir": self.pages_dir(s)} if s.cfg.recall else {}
        cache = self.backend.new_cache(s.cfg, **extra)   # a new page store: the unreadable one is discarded
        t0, said = time.monotonic(), [time.monotonic()]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - said[0] >= 5 or done == total:
                said[0] = time.monotonic()
                log.info("session %s: rebuilding its heap: %d of %d tokens (%.0f s)", s.id, done, total,
                         said[0] - t0)

        self.backend.prefill(cache, list(s.fed), progress=progress)
        s.cache, s.dirty, s.heap_crc = cache, True, None
        self.rebuilt += 1
        if self.durable:
            try:
                self.save(s)
            except SpillFailed as e:
                log.error("session %s: rebuilt heap not saved: %s", s.id, e)

    def rollback(self, s: Session, fed_before: int) -> bool:
        """After a failed step the cache cannot be trusted: fall back to the copy on disk, or
        to empty when the run started on an empty session (the turn in flight is lost).
        False when neither exists."""
        s.busy = False
        if fed_before and s.spill_path is not None and not self._fed_extends_saved(s):
            try:   # cut since it was saved (--cache-reuse): the saved copy's own tokens
                s.fed = self.dir.read_tokens(s.id, s.saved_gen)
            except (OSError, ValueError) as e:
                log.error("session %s: its saved tokens are unreadable (%s)", s.id, e)
                return False
        if fed_before == 0 or (s.spill_path is not None and s.saved_tokens <= len(s.fed)):
            keep = 0 if fed_before == 0 else s.saved_tokens
            if keep == 0 and s.spill_path is not None:
                self._remove_files(s)
                s.spill_path, s.saved_gen, s.saved_tokens, s.saved_turns = None, None, 0, 0
            s.turns = s.saved_turns if keep else 0   # the turns of the copy it fell back to
            s.cache, s.dirty = None, False
            s.rollback_mark = None
            del s.fed[keep:]
            s.unfed_reply = s.saved_unfed if keep else ()   # (the copy it fell back to: its reply's)
            s.ends_in_reply = s.saved_ends_in_reply if keep else False
            # where the copy it fell back to rolls back to and its reply began (the failed run's are past its end)
            s.rollback_floor, s.reply_start, s.cuttable = (s.saved_points if keep and s.saved_points
                                                           else (None, None, False))
            s.refresh()
            return True
        return False

    @staticmethod
    def _fed_extends_saved(s: Session) -> bool:
        """Whether the session's tokens begin with those of its saved copy."""
        return s.saved_tokens <= len(s.fed) and (
            s.saved_crc is None or zlib.crc32(s.fed[:s.saved_tokens].tobytes()) == s.saved_crc)

    def enforce_limits(self, keep: Optional[Session] = None, spare: Optional[Session] = None) -> None:
        """Spill idle least-recently-used heaps beyond max_resident; drop the oldest idle
        sessions beyond max_sessions. `keep` is about to run and stays resident; `spare` (the
        session whose checkpoint it is being forked from) is left as it is this time. A heap the disk
        refuses to take (its turn unsaved: full, read-only) stays resident and the next is tried;
        SpillFailed when too many stay. Sessions that are never kept (ephemeral, scratch) do not
        count towards max_sessions, and a heap sized to one input (an embedding's) not towards
        max_resident: neither ever makes a kept session spill or go. An idle scratch session past
        max_resident is dropped, not spilled (spill)."""
        idle = sorted((s for s in self.sessions() if not s.busy and s is not keep and s is not spare),
                      key=lambda s: s.last_used)
        resident = [s for s in self.sessions() if (s.cache is not None or s is keep) and not s.sized]
        refused: Optional[SpillFailed] = None
        for s in idle:
            if len(resident) <= self.max_resident:
                break
            if s.cache is not None:
                try:
                    self.spill(s.id)
                except SpillFailed as e:
                    refused = e
                    continue
                resident.remove(s)
        if refused is not None and len(resident) > self.max_resident:
            raise refused
        kept = [s for s in idle if not (s.ephemeral or s.scratch)]
        count = sum(1 for s in self.sessions() if not (s.ephemeral or s.scratch))
        for s in kept:
            if count <= self.max_sessions:
                break
            self.delete(s.id)
            count -= 1

    def _release_scratch(self, s: Session) -> None:
        """A scratch session leaves RAM unwritten: deleted, or, where it holds a checkpoint (an
        editor's warm-up), emptied and kept beside it, so the editor's next completion still
        forks from there (match_session passes over a session with no tokens)."""
        if not self.checkpoints.of(s.id):
            self.delete(s.id)
            return
        release_pages(s.cache)
        s.cache = None
        s.truncate(0)
        s.rollback_floor = s.rollback_mark = s.reply_start = None
        s.refresh()

    def touch(self, s: Session) -> None:
        s.last_used = time.time()

    # --- persistence across restarts ---

    def persist_all(self, model_id: Optional[str] = None) -> int:
        """Save every idle session whose disk copy is stale and commit the index (shutdown);
        a session that cannot be saved is logged and skipped. Returns how many are on disk."""
        self.model_id = model_id or self.model_id
        for s in self.sessions():
            if s.scratch and not s.busy:   # never kept across a restart: its files go now
                self.delete(s.id)
        for s in self.sessions():
            if s.cache is not None and not s.busy and s.fed and not s.saved and not s.scratch:
                try:
                    self.save(s)
                except SpillFailed as e:
                    log.error("session %s not saved: %s", s.id, e)
        self._try_commit(force=True)
        return len(self._entries())

    def load_persisted(self, model_id: Optional[str] = None) -> int:
        """Register the sessions found in the directory (heaps load lazily, on demand). Never
        raises on the directory's content: what cannot be read is moved aside and logged."""
        self.model_id = model_id or self.model_id
        found = recover_sessions(self.dir, self.model_id, self.cfg, skip=set(self._sessions), lost=self._lost,
                                 model_key=self.model_key)
        with self._lock:
            for s in found:
                self._sessions[s.id] = s
        self._try_commit()
        return len(found)

    def _entries(self) -> list[dict]:
        # every session a client was told of (201, or its reply's first token), busy ones too: one
        # whose first turn is in flight comes back with no tokens (gen None), not as a 404
        return [{"id": s.id, "gen": s.saved_gen, "tokens": s.saved_tokens,
                 "crc": s.saved_crc if s.saved_crc is not None else zlib.crc32(s.fed[:s.saved_tokens].tobytes()),
                 "heap_crc": s.heap_crc, **points_entry(s.saved_points),
                 "created": s.created, "last_used": s.last_used, "turns": s.saved_turns,   # (its saved turn's)
                 **({"unfed": list(s.saved_unfed)} if s.saved_unfed else {}),   # its reply's last tokens, never read
                 **({"ends_in_reply": True} if s.saved_ends_in_reply else {}),
                 **({"stats": s.saved_stats} if s.saved_stats else {}),   # its heap's totals (a restart lists them)
                 "origin": s.origin, "title": s.title, "owner": s.owner}   # owner: the API key's digest
                for s in self.sessions() if not (s.ephemeral or s.scratch)]

    def _commit(self, force: bool = False) -> None:
        """Rewrite the index (durable stores, or forced): the generations it names are in force."""
        if self.durable or force:
            self.dir.write_index({"model": self.model_id, **({"model_key": self.model_key} if self.model_key else {}),
                                  "sessions": self._entries()})

    def _try_commit(self, force: bool = False) -> None:
        try:
            self._commit(force)
            faults.step("index")
        except SpillFailed as e:
            log.error("session index not updated: %s", e)

    def _lose(self, s: Session, reason: str) -> None:
        """A session whose saved copy is unreadable: move its files aside, forget it, raise."""
        self.dir.move_aside(sorted(self.spill_dir.glob(f"{s.id}.*")), f"session {s.id}: {reason}")
        with self._lock:
            self._sessions.pop(s.id, None)
        self._lost[s.id] = reason.split(":")[0]
        self._try_commit()
        raise SessionLost(s.id, self._lost[s.id])

    # --- snapshots (any thread) ---

    def infos(self) -> list[dict]:
        with self._lock:
            sessions = list(self._sessions.values())
        return [s.snapshot for s in sessions]

    def info(self, session_id: str, owner: Any = ANY_OWNER) -> dict:
        """The session's snapshot; SessionNotFound also when `owner` is given and another API
        key owns it (a key must not learn that another key's session exists)."""
        s = self._sessions.get(session_id)
        if s is None:
            self._not_found(session_id)
        if owner is not ANY_OWNER and s.owner != owner:
            raise SessionNotFound(session_id)
        return s.snapshot

    def infos_of(self, owner: Optional[str]) -> list[dict]:
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.owner == owner]
        return [s.snapshot for s in sessions]

    def close(self) -> None:
        """Forget every session; remove the spill directory when the store made it."""
        with self._lock:
            self._sessions.clear()
        if self._own_dir:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    def _remove_files(self, s: Session, keep_gen: Optional[int] = None) -> None:
        try:
            self.dir.remove(s.id, keep_gen)
        except OSError as e:
            log.warning("session %s: files not removed: %s", s.id, e)
        self._mirror_removal(s.id, keep_gen)

    def _mirror_removal(self, session_id: str, keep_gen: Optional[int], whole: bool = False) -> None:
        """A backend whose other ranks keep files of their own (--distributed) removes theirs too."""
        remove = getattr(self.backend, "remove_session_files", None)
        if remove is not None:
            try:
                remove(session_id, keep_gen, whole)
            except Exception as e:   # a lost rank: what it kept stays on its disk
                log.warning("session %s: the other ranks' files not removed: %s", session_id, e)

    def _remove_gen(self, session_id: str, gen: int) -> None:
        for path in (self.dir.heap_path(session_id, gen), self.dir.tokens_path(session_id, gen)):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

