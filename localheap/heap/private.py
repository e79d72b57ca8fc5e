"""Files and directories only their owner can read (saved sessions decode to conversation text):
directories 0700, files 0600, whatever the process's umask. Every writer under the sessions
directory creates through these."""

from __future__ import annotations

import errno
import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path, parents: bool = True) -> None:
    """Create `path` (and, with `parents`, its missing parents) 0700; an existing one is left as it is."""
    path = Path(path)
    if path.is_dir():
        return
    if parents and not path.parent.is_dir():
        private_dir(path.parent)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not path.is_dir():   # a file (or a link to one) where the directory should be: say that
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None
        return
    os.chmod(path, DIR_MODE)   # mkdir's mode passes through the umask


def open_private(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """os.open with the file made 0600 (a file it creates, and one it opens)."""
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_private(path: Path):
    """A binary file object writing `path` from scratch, 0600."""
    return os.fdopen(open_private(path), "wb")
