"""SessionStore: sessions by id, heaps allocated lazily, least recently used ones spilled to disk.

Mutating methods run on the engine thread only (it owns the backend); `infos()` and `info()`
read published snapshots and are safe from any thread.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from ..heap import HeapConfig
from .errors import SessionBusy, SessionNotFound
from .session import Session, token_array

log = logging.getLogger("localheap.sessions")
INDEX = "index.json"


class SessionStore:
    def __init__(self, backend: Any, cfg: HeapConfig, spill_dir: Optional[Path] = None,
                 max_resident: int = 8, max_sessions: int = 256):
        assert max_resident >= 1 and max_sessions >= max_resident
        self.backend = backend
        self.cfg = cfg
        self._own_dir = spill_dir is None
        self.spill_dir = Path(spill_dir or tempfile.mkdtemp(prefix="localheap-sessions-"))
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.max_resident = max_resident
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()   # guards the dict against readers on other threads
        self.spills = 0
        self.restores = 0

    # --- lookup (engine thread) ---

    def create(self, session_id: Optional[str] = None, owner: Optional[str] = None) -> Session:
        s = Session(id=session_id or f"sess_{uuid.uuid4().hex[:20]}", cfg=self.cfg, owner=owner)
        s.refresh()
        with self._lock:
            assert s.id not in self._sessions
            self._sessions[s.id] = s
        return s

    def get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionNotFound(session_id)
        return s

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
        s.cache = None
        self._remove_files(s)

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
            s.cache = self.backend.new_cache(s.cfg)
            s.refresh(self.backend.stats(s.cache))

    def spill(self, session_id: str) -> Path:
        """Save the session's heap and token history to disk and free its heap."""
        s = self.get(session_id)
        if s.busy:
            raise SessionBusy(session_id)
        if s.cache is None:
            return s.spill_path or self.spill_dir
        path = self.spill_dir / f"{s.id}.safetensors"
        self.backend.save_cache(s.cache, path)
        with open(path.with_suffix(".tokens"), "wb") as f:
            s.fed.tofile(f)
        s.spill_path, s.cache = path, None
        self.spills += 1
        s.refresh()
        return path

    def restore(self, session_id: str) -> Session:
        """Load a spilled session's heap back (bit-identical to when it was spilled)."""
        s = self.get(session_id)
        if s.cache is not None or s.spill_path is None:
            return s
        cache = self.backend.load_cache(s.cfg, s.spill_path)
        tokens = token_array()
        tokens.frombytes(s.spill_path.with_suffix(".tokens").read_bytes())
        assert tokens == s.fed and self.backend.tokens_in_cache(cache) == len(s.fed)
        s.cache = cache
        s.cfg = getattr(cache, "cfg", s.cfg)   # the heap as it was saved (settings may have changed)
        self._remove_files(s)
        s.spill_path = None
        self.restores += 1
        s.refresh(self.backend.stats(cache))
        return s

    def enforce_limits(self, keep: Optional[Session] = None) -> None:
        """Spill idle least-recently-used heaps beyond max_resident; drop the oldest idle
        sessions beyond max_sessions. `keep` is about to run and stays resident."""
        idle = sorted((s for s in self.sessions() if not s.busy and s is not keep), key=lambda s: s.last_used)
        resident = [s for s in self.sessions() if s.cache is not None or s is keep]
        for s in idle:
            if len(resident) <= self.max_resident:
                break
            if s.cache is not None:
                self.spill(s.id)
                resident.remove(s)
        for s in idle:
            if len(self) <= self.max_sessions:
                break
            self.delete(s.id)

    def touch(self, s: Session) -> None:
        s.last_used = time.time()

    # --- persistence across restarts (engine stopped or not yet started) ---

    def persist_all(self, model_id: str) -> int:
        """Save every session to the spill directory with an index; returns how many."""
        for s in self.sessions():
            if s.cache is not None and not s.busy:
                self.spill(s.id)
        entries = [{"id": s.id, "created": s.created, "last_used": s.last_used, "turns": s.turns,
                    "tokens": len(s.fed), "owner": s.owner, "file": s.spill_path.name if s.spill_path is not None else None}
                   for s in self.sessions() if s.spill_path is not None or not s.fed]
        index = {"model": model_id, "sessions": entries}
        tmp = self.spill_dir / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.spill_dir / INDEX)
        return len(entries)

    def load_persisted(self, model_id: str) -> int:
        """Register the sessions a previous run saved here (heaps load lazily, on demand)."""
        path = self.spill_dir / INDEX
        if not path.exists():
            return 0
        try:
            index = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable session index %s: %s", path, e)
            return 0
        if index.get("model") != model_id:
            log.warning("sessions in %s belong to model %r, not %r: not loaded", self.spill_dir, index.get("model"), model_id)
            return 0
        loaded = 0
        for e in index.get("sessions", []):
            if e["id"] in self._sessions:
                continue
            heap_file, fed = None, token_array()
            if e["file"] is not None:     # None: a session created but never fed
                heap_file = self.spill_dir / e["file"]
                tokens_file = heap_file.with_suffix(".tokens")
                if not heap_file.exists() or not tokens_file.exists():
                    log.warning("session %s: files missing in %s; skipped", e["id"], self.spill_dir)
                    continue
                fed.frombytes(tokens_file.read_bytes())
            if len(fed) != e["tokens"]:
                log.warning("session %s: token file does not match its index; skipped", e["id"])
                continue
            s = Session(id=e["id"], cfg=self.cfg, fed=fed, spill_path=heap_file, created=e["created"],
                        last_used=e["last_used"], turns=e["turns"], owner=e.get("owner"))
            s.refresh()
            with self._lock:
                self._sessions[s.id] = s
            loaded += 1
        (self.spill_dir / INDEX).unlink()   # rewritten at the next shutdown
        return loaded

    # --- snapshots (any thread) ---

    def infos(self) -> list[dict]:
        with self._lock:
            sessions = list(self._sessions.values())
        return [s.snapshot for s in sessions]

    def info(self, session_id: str, owner: Optional[str] = None) -> dict:
        """The session's snapshot; SessionNotFound also when another key owns it."""
        s = self._sessions.get(session_id)
        if s is None or s.owner != owner:
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

    def _remove_files(self, s: Session) -> None:
        if s.spill_path is not None:
            s.spill_path.unlink(missing_ok=True)
            s.spill_path.with_suffix(".tokens").unlink(missing_ok=True)

