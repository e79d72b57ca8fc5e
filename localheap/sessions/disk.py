"""The sessions directory: file names, atomic writes, and the index that commits them.

Each save of a session writes a new generation `{id}.{gen}.safetensors` + `{id}.{gen}.tokens`,
then rewrites `index.json`, which names the generation in force: the index is the commit
point, so a kill -9 at any moment leaves either the old generation or the new one in force,
never half of each. Every write goes to a temp file, is fsynced, renamed, and the directory
fsynced. Paths are built from validated ids and integer generations only, never read from
the index. Knows nothing about heaps or tensors: the backend writes the heap file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
import uuid
import zlib
from array import array
from pathlib import Path
from typing import Any, Callable, Optional

from ..heap.private import DIR_MODE, FILE_MODE, open_private, private_dir
from .errors import SpillFailed

log = logging.getLogger("localheap.sessions")

INDEX = "index.json"
ASIDE = "aside"                  # corrupt or foreign files are moved here, never deleted
TMP_SUFFIX = ".tmp"
SESSION_ID = re.compile(r"sess_[A-Za-z0-9_-]{1,64}")
SESSION_FILE = re.compile(r"(sess_[A-Za-z0-9_-]{1,64})(?:\.(\d{1,12}))?\.(safetensors|tokens)")
# a rank's shard of a heap saved by several ranks (--distributed), beside the generation's heap file
SHARD_FILE = re.compile(r"(sess_[A-Za-z0-9_-]{1,64})\.(\d{1,12})\.[a-z]+-rank\d+of\d+\.safetensors")


def valid_id(session_id: object) -> bool:
    return isinstance(session_id, str) and SESSION_ID.fullmatch(session_id) is not None


def new_id() -> str:
    return f"sess_{uuid.uuid4().hex[:20]}"


def read_token_file(path: Path) -> array:
    """A token file's int32 ids (a session's, a checkpoint's, a slot file's); ValueError when torn."""
    data = Path(path).read_bytes()
    if len(data) % 4:
        raise ValueError(f"token file of {len(data)} bytes is not a whole number of int32 ids")
    tokens = array("i")
    tokens.frombytes(data)
    return tokens


def file_crc(path: Path) -> int:
    """CRC-32 of a file's bytes (a saved heap's, kept in the index: a flipped byte is caught on restore)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync_fd(fd: int) -> None:
    """Flush an open file or directory to stable storage. On macOS fsync leaves data in the
    drive's cache; F_FULLFSYNC flushes it (what the laptops this serves need after a power loss)."""
    if hasattr(fcntl, "F_FULLFSYNC"):
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:   # some file systems refuse it: plain fsync then
            pass
    os.fsync(fd)


def _fsync(path: Path) -> None:
    """fsync_fd of the file or directory at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


class SessionDir:
    """One sessions directory (0700, files 0600). Writes raise SpillFailed naming the directory."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.identity: Optional[tuple[int, int]] = None   # (device, inode) of the directory written to
        # the server's lock taken again in a directory made anew where this one was (serve sets it):
        # returns the open lock file (held while it lives), raises where another server holds it
        self.relock: Optional[Callable[[], Any]] = None
        self.locks: list = []
        self._identity_lock = threading.Lock()   # (the saver thread and the engine thread both write)

    def _same(self) -> None:
        """Before a write: the directory is the one this store writes to. One made anew where it was
        (removed, then made again) is taken only once the server's lock is taken in it, and only
        while it holds no index: one made by hand is taken; one another server started on it made
        meanwhile (its sessions in its index) is never written, while that server runs or after."""
        with self._identity_lock:
            self._same_locked()

    def _same_locked(self) -> None:
        st = os.stat(self.root)
        found = (st.st_dev, st.st_ino)
        if self.identity is not None and found != self.identity and self.relock is not None:
            lock = self.relock()
            if (self.root / INDEX).exists():
                if lock is not None:
                    lock.close()
                raise FileExistsError(f"{self.root} was made again by another server while this one ran (it holds "
                                      f"that one's sessions): restart this server to read them")
            if lock is not None:
                self.locks.append(lock)
        self.identity = found

    def check(self) -> None:
        """Create the directory if needed and prove it writable (raises SpillFailed)."""
        try:
            if self.root.exists() and not self.root.is_dir():
                raise NotADirectoryError(f"{self.root} is not a directory")
            private_dir(self.root)
            self._same()
            if self.root.stat().st_mode & 0o077:
                os.chmod(self.root, DIR_MODE)   # saved sessions decode to conversation text
            self.write_bytes(self.root / ".write-check", b"ok")
            (self.root / ".write-check").unlink()
        except SpillFailed:
            raise
        except OSError as e:
            raise SpillFailed(self.root, e) from e

    # --- names ---

    def heap_path(self, session_id: str, gen: int) -> Path:
        assert valid_id(session_id) and gen >= 0, session_id
        return self.root / f"{session_id}.{gen}.safetensors"

    def tokens_path(self, session_id: str, gen: int) -> Path:
        return self.heap_path(session_id, gen).with_suffix(".tokens")

    # --- atomic writes ---

    def write_with(self, path: Path, write: Callable[[Path], None]) -> None:
        """write(tmp) fills a temp file beside `path`; then fsync, rename, fsync the directory."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            if not self.root.is_dir():   # vanished, or a file in its place: say so, not "File exists"
                raise NotADirectoryError(f"{self.root} is missing or not a directory")
            self._same()
            write(tmp)
            os.chmod(tmp, FILE_MODE)
            _fsync(tmp)
            os.replace(tmp, path)
            _fsync(path.parent)
        except Exception as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise SpillFailed(self.root, e) from e

    def write_by(self, path: Path, write: Callable[[Path], None]) -> None:
        """write(path) writes `path` atomically itself (and files beside it); then fsync the directory."""
        try:
            if not self.root.is_dir():
                raise NotADirectoryError(f"{self.root} is missing or not a directory")
            self._same()
            write(path)
            os.chmod(path, 0o600)
            _fsync(path.parent)
        except Exception as e:
            raise SpillFailed(self.root, e) from e

    def write_bytes(self, path: Path, data: bytes) -> None:
        def write(tmp: Path) -> None:
            fd = open_private(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        self.write_with(path, write)

    def write_tokens(self, session_id: str, gen: int, tokens: array) -> None:
        self.write_bytes(self.tokens_path(session_id, gen), tokens.tobytes())

    def write_index(self, index: dict) -> None:
        self.write_bytes(self.root / INDEX, json.dumps(index, indent=1).encode())

    # --- reading and recovery ---

    def read_index(self) -> Optional[dict]:
        """The index, or None when there is none; a corrupt one is moved aside (logged)."""
        path = self.root / INDEX
        if not path.exists():
            return None
        try:
            index = json.loads(path.read_bytes())
            if not isinstance(index, dict) or not isinstance(index.get("sessions", []), list):
                raise ValueError("not a session index")
            return index
        except (OSError, ValueError) as e:
            self.move_aside([path], f"unreadable session index ({e})")
            return None

    def scan(self) -> dict[str, dict[int, set[str]]]:
        """Session files by id and generation ({id: {gen: {"safetensors", "tokens"}}}); temp
        files left by a crash are removed, and files of the old one-generation layout renamed."""
        found: dict[str, dict[int, set[str]]] = {}
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.name.endswith(TMP_SUFFIX) or ".tmp." in entry.name:
                log.info("removing temp file %s left by an interrupted write", entry.path)
                Path(entry.path).unlink(missing_ok=True)
                continue
            m = SESSION_FILE.fullmatch(entry.name)
            if m is None:
                continue
            sid, gen, kind = m.group(1), int(m.group(2) or 0), m.group(3)
            if m.group(2) is None:   # written by a version without generations
                os.replace(entry.path, self.root / f"{sid}.0.{kind}")
            found.setdefault(sid, {}).setdefault(gen, set()).add(kind)
        return found

    def read_tokens(self, session_id: str, gen: int) -> array:
        return read_token_file(self.tokens_path(session_id, gen))

    def remove(self, session_id: str, keep_gen: Optional[int] = None) -> None:
        """Remove a session's files, all of them or all but generation keep_gen."""
        assert valid_id(session_id), session_id
        for path in self.root.glob(f"{session_id}.*"):
            m = SESSION_FILE.fullmatch(path.name) or SHARD_FILE.fullmatch(path.name)
            if m is None or m.group(1) != session_id:
                continue
            if keep_gen is None or int(m.group(2) or 0) != keep_gen:
                path.unlink(missing_ok=True)

    def move_aside(self, paths: list[Path], reason: str) -> Optional[Path]:
        """Move files into aside/ (kept for a post-mortem), log why; never raises."""
        aside = self.root / ASIDE
        stamp = time.strftime("%Y%m%d-%H%M%S")
        try:
            private_dir(aside)
            for p in paths:
                if p.exists():
                    os.replace(p, aside / f"{p.name}.{stamp}")
                    if (aside / f"{p.name}.{stamp}").is_file():
                        os.chmod(aside / f"{p.name}.{stamp}", FILE_MODE)   # kept for a post-mortem: private
            log.warning("%s: moved %s to %s", reason, ", ".join(p.name for p in paths), aside)
            return aside
        except OSError as e:
            log.error("%s; could not move %s aside: %s", reason, ", ".join(map(str, paths)), e)
            return None
