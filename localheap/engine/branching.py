"""Sessions that branch: rolled back to a common prefix, forked from a checkpoint, and the
checkpoints themselves (taken after a document is read, or on request). Engine thread only.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from ..sessions import RollbackRefused, Session, SessionBusy, SessionStore, SpillFailed
from ..sessions.checkpoints import Checkpoint
from ..sessions.diskbudget import dir_bytes
from ..sessions.session import token_array

log = logging.getLogger("localheap.engine")


class NoCheckpoint(ValueError):
    """A fork asked for a point no checkpoint covers (a user error: 400)."""


def settle(backend: Any, s: Session, reply_start: Optional[int] = None) -> None:
    """After a run or a branch: where the session can roll back to, and where its reply began."""
    floor = getattr(backend, "rollback_floor", None)
    s.rollback_floor = floor(s.cache) if floor is not None and s.cache is not None else None
    mark = getattr(backend, "rollback_mark", None)
    s.rollback_mark = mark(s.cache) if mark is not None and s.cache is not None else None
    cuttable = getattr(backend, "cuttable", None)
    s.cuttable = bool(cuttable(s.cache)) if cuttable is not None and s.cache is not None else False
    s.cut_at_reply = s.cuttable and not getattr(s.cache, "only_heap_layers", True)   # sliding layers beside the heap
    s.reply_start = len(s.fed) if reply_start is None else reply_start


def _change_cache(change, s: Session, store: Optional[SessionStore], what: str) -> None:
    """Run `change` (a rollback or a cut of the session's cache). RollbackRefused: the cache is as it
    was, counted and raised. Any other error: the cache cannot be trusted, so the session falls back
    to its saved copy, or is dropped without one, and the error is raised."""
    try:
        change()
    except RollbackRefused:
        if store is not None:
            store.rollbacks_refused += 1
        raise   # the cache is as it was
    except Exception:
        if store is not None and not store.rollback(s, fed_before=len(s.fed)):
            log.error("session %s dropped: %s failed and it has no saved copy", s.id, what)
            store.delete(s.id)
        raise


def roll_back(backend: Any, s: Session, tokens: int, store: Optional[SessionStore] = None) -> None:
    """Forget the session's tokens after the first `tokens` (see match.py). When that fails the
    cache cannot be trusted (--distributed: a rank's heap may be cut back and another's not): the
    session falls back to its saved copy, or is dropped without one, and the error is raised;
    RollbackRefused leaves the cache and the session as they were."""
    if tokens < len(s.fed):
        rewinds = getattr(s.cache, "rewinds", 0)

        def truncate() -> None:
            floor = backend.rollback_floor(s.cache)   # the heap's own, which a stale s.rollback_floor may not be
            if tokens < floor and tokens != backend.rollback_mark(s.cache):
                raise RollbackRefused(f"the heap rolls back to {floor} tokens at the fewest, not {tokens}")
            backend.truncate(s.cache, tokens)

        _change_cache(truncate, s, store, "a rollback")
        rewound = getattr(s.cache, "rewinds", 0) > rewinds
        if rewound:
            log.info("session %s rewound from %d to %d tokens (its reply had evicted)", s.id, len(s.fed), tokens)
        if store is not None:
            store.rollbacks += 1
            store.rewinds += rewound
        s.truncate(tokens)
    assert backend.tokens_in_cache(s.cache) == len(s.fed)
    settle(backend, s)


def cut(backend: Any, s: Session, spans: list, store: Optional[SessionStore] = None) -> None:
    """Keep only the session's tokens in `spans` (a client resent its history with old messages
    trimmed: match.trimmed_spans). Failures as in roll_back."""
    def cut_cache() -> None:
        if not backend.cuttable(s.cache):   # (s.cuttable was read from an index: the heap says)
            raise RollbackRefused("this heap cannot be cut")
        backend.cut(s.cache, spans)

    _change_cache(cut_cache, s, store, "a cut")
    before = len(s.fed)
    s.cut(spans)
    log.info("session %s cut from %d to %d tokens (a history with messages trimmed)", s.id, before, len(s.fed))
    if store is not None:
        store.cuts += 1
    assert backend.tokens_in_cache(s.cache) == len(s.fed)
    settle(backend, s)


def new_branch(store: SessionStore, source_id: str, scratch: bool = False) -> Session:
    """An empty session for a fork of `source_id`, owned by the same API key where keys own sessions."""
    return store.create(owner=store.get(source_id).owner if source_id in store else None, scratch=scratch)


def fork_into(store: SessionStore, s: Session, c: Checkpoint, inherit: bool = True, strict: bool = True) -> None:
    """Fill the new, empty session `s` with checkpoint `c` (its heap, tokens and, with `inherit`,
    the earlier checkpoints of c's session; without, c is already one of s's own). Where the disk
    refuses the fork's own copy, `strict` (a fork asked for) raises SpillFailed; otherwise (a
    request that reuses the checkpoint) its tokens are read again, as where the disk has room the
    checkpoint would have given them, and the checkpoint is kept."""
    assert not s.fed and s.cache is None
    pages_dir = store.pages_dir(s)
    try:
        cache = store.checkpoints.load(c, s.cfg, pages_dir=pages_dir)
    except Exception as e:   # an unreadable checkpoint: its tokens are the truth, read them again
        refused = _refused_write(e, pages_dir)   # (the fork's own copy could not be written: c is fine)
        if refused:
            shutil.rmtree(pages_dir, ignore_errors=True)
            if strict:
                raise SpillFailed(store.spill_dir, e) from e
            log.warning("checkpoint %s: the disk refused a fork its copy (%s); its %d tokens read again", c.path,
                        e, c.n)
        else:
            log.warning("checkpoint %s unreadable (%s: %s); removed, and its %d tokens read again", c.path,
                        type(e).__name__, e, c.n)
            store.checkpoints.discard(c)
        cache = store.backend.new_cache(s.cfg, **({"pages_dir": store.pages_dir(s)} if s.cfg.recall else {}))
        store.backend.prefill(cache, list(c.tokens))
        store.rebuilt += 1
    s.cache, s.fed, s.dirty = cache, token_array(c.tokens), True
    s.cfg = getattr(cache, "cfg", s.cfg)
    if inherit:
        try:
            store.checkpoints.inherit(c, s)
        except SpillFailed as e:
            if strict:
                raise
            log.warning("session %s: the checkpoints it forked from not linked (%s)", s.id, e)
    settle(store.backend, s)
    s.refresh(store.backend.stats(cache))


def _refused_write(e: BaseException, written: Path) -> bool:
    """Whether `e` is a write refused (full, read-only), or a folder or permission failure at the
    path it names first when that is under `written` (the fork's page store, which a checkpoint's
    load copies into): not a failure to read the checkpoint's own files (a copy names both paths
    on any error, a read error too: decided by the error, not by the second path)."""
    if not isinstance(e, OSError):
        return False
    if _disk_refused(e):
        return True
    return e.errno in (errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR) and e.filename is not None \
        and Path(os.fsdecode(e.filename)).is_relative_to(written)


def _disk_refused(e: BaseException) -> bool:
    """Whether `e` is the disk refusing a write: full, over quota, read-only (or the store saying so)."""
    return isinstance(e, SpillFailed) or isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def checkpoint(store: SessionStore, session_id: str) -> Checkpoint:
    """Checkpoint an idle session at its current tokens (a spilled one is restored first)."""
    s = store.get(session_id)
    if s.busy:
        raise SessionBusy(session_id)
    if not s.fed:
        raise NoCheckpoint(f"session {session_id!r} holds no tokens yet: nothing to checkpoint")
    store.make_resident(s)
    store.disk.room_for(store.heap_bytes() + 4 * len(s.fed), s)   # --disk-total (its pages are hard links)
    c = store.checkpoints.save(s)
    s.refresh()
    return c


def checkpoint_quietly(store: SessionStore, s: Session) -> None:
    """The automatic checkpoint after a document: a failure is logged, the request still succeeds.
    Under --disk-total it is made only where it fits as the directory is (nothing is taken back
    from other sessions for it); where it does not, it is left out."""
    try:
        # its heap and tokens (its pages are hard links), and the turn's own save that follows it
        if not store.disk.fits(2 * (store.heap_bytes() + 4 * len(s.fed))):
            log.info("session %s: the document's checkpoint left out: it does not fit under --disk-total", s.id)
            return
        store.checkpoints.save(s)
        s.refresh()
    except Exception as e:
        if _disk_refused(e):   # expected there (the turn's own save says saved: false): no traceback
            log.warning("session %s: the document's checkpoint left out: %s", s.id, e)
        else:
            log.exception("checkpointing session %s failed", s.id)


def fork(store: SessionStore, session_id: str, tokens: Optional[int], admit_heap) -> Session:
    """A new session from `session_id`'s latest checkpoint at or before `tokens` (None: its
    current state, checkpointed now). `admit_heap(session)` asks the RAM governor first."""
    source = store.get(session_id)
    if tokens is None:
        c = checkpoint(store, session_id)
    else:
        c = store.checkpoints.nearest(session_id, tokens)
        if c is None:
            raise NoCheckpoint(f"session {session_id!r} has no checkpoint at or before {tokens} tokens "
                               f"(checkpoints: {source.checkpoints or 'none'}); POST /v1/sessions/"
                               f"{session_id}/checkpoint takes one")
    s = new_branch(store, session_id)
    try:
        store.enforce_limits(keep=s)
        admit_heap(s)
        store.disk.room_for(dir_bytes(c.path.with_suffix(".pages")) + store.heap_bytes(), s, source)   # its copy
        fork_into(store, s, c)
    except Exception:
        store.delete(s.id)
        raise
    if c.n == len(source.fed) and c.tokens == source.fed:   # its current state: it ends as the source
        s.ends_in_reply, s.unfed_reply = source.ends_in_reply, source.unfed_reply   # does (a reply's end never read)
    store.touch(s)
    return s
