"""A JSON-lines file that keeps what the server remembers for clients (the kept responses, the
conversations) across a restart or a crash: each change is a line appended and fsynced on a
thread of its own, in order, so the event loop never waits on the disk; read back at start (a
line a crash cut short ends the reading); rewritten atomically, whole, when it holds mostly
what is no longer kept. A write that fails is logged: the caller goes on in memory."""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from ..heap.private import open_private
from ..sessions.disk import fsync_fd

log = logging.getLogger("localheap.server")


class JsonLines:
    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what   # what: its records, in log messages ("responses")
        self.lines = 0                      # lines in the file
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"localheap-{what}")

    def load(self, apply: Callable[[dict], None]) -> bool:
        """apply(record) for each line, in order. False where a line did not read (a crash's torn
        tail, or one `apply` refused with ValueError, KeyError or TypeError): the reading ended
        there, and the caller should `rewrite` what it kept."""
        if not self.path.exists():
            return True
        try:
            data = self.path.read_bytes()
        except OSError as e:
            log.error("could not read %s: %s (starting with no kept %s)", self.path, e, self.what)
            return True
        lines = data.split(b"\n")
        complete = lines[:-1] if not data.endswith(b"\n") else lines
        whole = data.endswith(b"\n") or not lines[-1]
        for n, line in enumerate(complete, 1):
            if not line:
                continue
            try:
                apply(json.loads(line))
                self.lines += 1
            except (ValueError, KeyError, TypeError) as e:
                log.warning("%s line %d does not read (%s): the %s from there on are dropped", self.path, n, e,
                            self.what)
                return False
        return whole

    def append(self, record: dict) -> None:
        self.lines += 1
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        self._submit(self._write_line, line)

    def rewrite(self, records: list[dict], now: bool = False) -> None:
        """The file replaced by `records` (on the writer thread, after the writes queued; `now`: here)."""
        self.lines = len(records)
        if now:
            self._rewrite(records)
        else:
            self._submit(self._rewrite, records)

    def flush(self) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _submit(self, fn, arg) -> None:
        if self._writer is not None:   # (closed: the server is stopping)
            self._writer.submit(fn, arg)

    def _write_line(self, line: bytes) -> None:
        try:
            fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                os.write(fd, line)
                fsync_fd(fd)
            finally:
                os.close(fd)
        except OSError as e:
            log.error("could not write to %s: %s (%s are kept in memory meanwhile)", self.path, e, self.what)

    def _rewrite(self, records: list[dict]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = open_private(tmp)
            with os.fdopen(fd, "wb") as f:
                for r in records:
                    f.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.error("could not rewrite %s: %s (%s are kept in memory meanwhile)", self.path, e, self.what)


class FileBacked:
    """What a log kept in a JsonLines (`_file`; None: in memory only) offers the server: wait for
    its writes (tests, shutdown), and close it; and to the log, its changes written."""
    _file: Optional[JsonLines] = None

    def _records(self) -> list[dict]:
        """What the log keeps, as the lines of a file rewritten whole."""
        raise NotImplementedError

    def _live(self) -> int:
        """The lines what the log keeps takes (its `_records()`, not built)."""
        raise NotImplementedError

    def _write(self, record: dict) -> None:
        """A change made in memory, onto the file: a line appended, or the file rewritten from memory
        (which holds the change) once it would hold mostly what is gone."""
        if self._file is None:
            return
        if self._file.lines + 1 > 2 * self._live() + 64:
            self._file.rewrite(self._records())
        else:
            self._file.append(record)

    def submit(self, fn: Callable, arg) -> None:
        """fn(arg) on the log's writer thread, in order with its writes (nothing without a file)."""
        if self._file is not None:
            self._file._submit(fn, arg)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
