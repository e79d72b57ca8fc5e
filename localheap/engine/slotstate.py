"""llama-server's slot save, restore and erase, on the engine thread (Engine.call). A slot runs
one request at a time and remembers the session of the last one it ran (slots.py); these act on
that session. The files themselves are written and read on another thread
(sessions/slotfiles.py); here are the parts that touch sessions and heaps:

- save: the session checkpointed at its tokens (as POST /v1/sessions/ID/checkpoint does), the
  checkpoint's files hard-linked into a staging folder of their own (the checkpoint may be
  dropped while the file is written), for slotfiles.write; then the staging folder removed.
- restore: a new session of the caller's, holding what the file held: its checkpoint (extracted
  into a staging folder, then moved into the session's checkpoint folder) registered as the
  session's first, and its heap loaded,
  so that the next prompt that extends its tokens continues it, and one that parts from them
  forks from that checkpoint, as with any session here.
- erase: the slot's session deleted (its heap and files); a web UI conversation is let go by
  the slot, never deleted by it.

A slot answers for the caller's sessions only (API keys): another key's session is as if the
slot held nothing.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

from ..heap.pages import link_tree
from ..heap.private import private_dir
from ..sessions.checkpoints import Checkpoint
from ..sessions.diskbudget import dir_bytes
from ..sessions.session import token_array
from . import branching

STAGING = ".slot-staging"   # under the checkpoints folder: an unknown name there is removed at start


class SlotBusy(RuntimeError):
    """The slot runs a request (its caller may wait for it to end)."""


def _slot(engine: Any, id_slot: int):
    slot = engine.slots.slots[engine.slots.check(id_slot)]
    if slot.run is not None:
        raise SlotBusy(f"slot {id_slot} is busy")
    return slot


def held(engine: Any, id_slot: int, who: Optional[str]):
    """The session the idle slot last ran, if the caller owns it and it still holds tokens."""
    slot = _slot(engine, id_slot)
    last = slot.last or {}
    sid = last.get("session_id")
    if sid is None or sid not in engine.store:
        return None
    s = engine.store.get(sid)
    return s if s.fed and s.owner == who else None


def stage_save(engine: Any, id_slot: int, who: Optional[str]) -> tuple[int, Optional[Path]]:
    """(tokens, staging folder) for slotfiles.write: the slot's session checkpointed and its
    checkpoint's files linked into a folder of their own; (0, None) for a slot holding nothing."""
    s = held(engine, id_slot, who)
    if s is None:
        return 0, None
    c = engine.checkpoint_session(s.id)
    staged = engine.store.checkpoints.root / STAGING / uuid.uuid4().hex
    try:
        private_dir(staged)
        pages = c.path.with_suffix(".pages")
        if pages.is_dir():
            link_tree(pages, staged / pages.name)
        for src in (c.path.with_suffix(".tokens"), c.path):
            try:
                os.link(src, staged / src.name)
            except OSError:   # a filesystem without hard links
                shutil.copyfile(src, staged / src.name)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return c.n, staged


def unstage(staged: Optional[Path]) -> None:
    if staged is not None:
        shutil.rmtree(staged, ignore_errors=True)


def restore_target(engine: Any) -> Path:
    """An empty staging folder a slot file is extracted into (off the engine thread); removed at the
    next start if a crash leaves it."""
    return engine.store.checkpoints.root / STAGING / uuid.uuid4().hex


def restore(engine: Any, id_slot: int, who: Optional[str], heap: Path, tokens, title: str):
    """The checkpoint extracted beside `heap` (restore_target's folder; its `tokens`, read there) made
    a new session's first checkpoint, its heap loaded, the session held by the slot. Its files are moved out of the
    staging folder first, the heap file last (what is left there is the caller's to remove). On
    failure the session and its files are removed."""
    from ..sessions.disk import new_id

    store = engine.store
    _slot(engine, id_slot)
    sid = new_id()
    folder = store.checkpoints.root / sid
    s = None
    try:
        private_dir(folder)
        for name in (heap.with_suffix(".tokens").name, heap.with_suffix(".pages").name, heap.name):
            if (heap.parent / name).exists():
                os.rename(heap.parent / name, folder / name)
        path = folder / heap.name
        s = store.create(session_id=sid, owner=who, title=title)
        store.enforce_limits(keep=s)
        engine.admission.admit_heap(s)
        store.disk.room_for(dir_bytes(path.with_suffix(".pages")) + store.heap_bytes(), s)   # the live copy
        c = store.checkpoints.adopt(s, Checkpoint(s.id, token_array(tokens), path))
        branching.fork_into(store, s, c, inherit=False)
        if store.durable:   # in the index with its tokens now, as a finished turn is
            store.save(s)
    except BaseException:
        if s is not None and s.id in store:
            store.delete(s.id)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    store.touch(s)
    engine.slots.hold(id_slot, s, who)
    return s


def erase(engine: Any, id_slot: int, who: Optional[str]) -> int:
    """Tokens the slot's session held, now forgotten (0: it held nothing of the caller's)."""
    s = held(engine, id_slot, who)
    slot = engine.slots.slots[id_slot]
    if s is None:
        if (slot.last or {}).get("owner") == who:   # (its session gone or empty; another key's hold stays)
            slot.last = None
        return 0
    slot.last = None
    if s.origin == "web":   # the web UI's conversations are the user's: the slot only lets go of them
        return 0
    n = len(s.fed)
    engine.delete_session(s.id)
    return n


def let_go(engine: Any, id_slot: int) -> None:
    """The idle slot holds nothing now (its session stays as it is)."""
    _slot(engine, id_slot).last = None
