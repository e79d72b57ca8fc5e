"""llama-server's slot files (POST /slots/ID?action=save|restore, serve --slot-save-path): a
session's state at a point, as one file a client names, to be read back into a new session later
(after a restart, on another server serving the same model).

The file is an uncompressed tar: `localheap-slot.json` first (what it holds and for which model),
then a checkpoint as sessions/checkpoints.py lays one out: `<n>.tokens` (int32 ids),
`<n>.pages/` (the page store, recall on) and `<n>.safetensors` (the backend's heap file, whose
metadata names the pages beside it). A save writes a hidden temp file beside the target, fsyncs it
and renames it over the target: a save that fails leaves the file of that name as it was. A
restore takes only those names, as plain files and directories (no links, nothing outside the
directory it extracts to), and the heap file last, which marks the extraction whole (as it marks a
checkpoint whole).

No engine state here: the engine thread checkpoints and links (engine/slotstate.py); writing
and reading these files runs on another thread.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import time
import uuid
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..heap.private import FILE_MODE, private_dir
from .disk import read_token_file

MANIFEST = "localheap-slot.json"
FORMAT = "localheap-slot"
VERSION = 1
TMP_TAG = ".localheap-tmp"   # a save's temp file: `.<name>.<random>.localheap-tmp`, removed at start
MAX_NAME_BYTES = 255
_BAD_CHARS = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|\ufeff]')
_MEMBER = re.compile(r"(\d{1,12})\.(tokens|safetensors|pages(/.+)?)")


class SlotFileError(ValueError):
    """A file name, or a slot file, that cannot be used (a client's error: 400)."""


@dataclass
class SlotFile:
    """What a slot file's manifest says."""
    tokens: int
    model: str
    backend: str
    saved_at: float
    owner: Optional[str] = None   # the API key's id that saved it (None: a server without keys)


def check_name(filename: object) -> str:
    """A file name inside --slot-save-path, as llama-server takes one: a single name, no path."""
    if not isinstance(filename, str) or not filename:
        raise SlotFileError("filename is required: a file name inside the server's --slot-save-path")
    try:
        size = len(filename.encode("utf-8"))
    except UnicodeEncodeError:
        raise SlotFileError("Invalid filename: not valid UTF-8") from None
    if (size > MAX_NAME_BYTES or _BAD_CHARS.search(filename) or filename != filename.strip()
            or filename.endswith(".") or filename.startswith(".") or filename.endswith(TMP_TAG)):
        raise SlotFileError("Invalid filename: one file name (no path, no leading dot, no trailing dot or "
                            "space, no control or reserved characters, at most 255 bytes)")
    return filename


def prepare_dir(root: Path) -> Path:
    """The slot directory, made if missing, without the temp files of saves a crash interrupted."""
    root = Path(root).expanduser()
    private_dir(root)
    for leftover in root.glob(f".*{TMP_TAG}"):
        leftover.unlink(missing_ok=True)
    return root


def write(root: Path, filename: str, staged: Optional[Path], n: int, model: str, backend: str,
          owner: Optional[str] = None) -> int:
    """Write the slot file `root/filename` from a checkpoint's files linked into `staged` (None:
    an empty slot, the manifest alone), as `owner`'s (an API key's id). Returns the file's bytes.
    Atomic: on any failure the file of that name is as it was and the temp file is gone. A file
    of that name another key saved is not replaced (SlotFileError)."""
    target = Path(root) / check_name(filename)
    if target.is_file() and _owner_of(target) not in (owner, _NOT_OURS):
        raise SlotFileError(f"{filename!r} is another API key's slot file: choose another name")
    tmp = target.with_name(f".{filename}.{uuid.uuid4().hex[:8]}{TMP_TAG}")
    manifest = json.dumps({"format": FORMAT, "version": VERSION, "tokens": n, "model": model,
                           "backend": backend, "saved_at": time.time(), "owner": owner}).encode()
    try:
        private_dir(target.parent)   # (removed while the server ran: made again)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
                info = tarfile.TarInfo(MANIFEST)
                info.size, info.mtime, info.mode = len(manifest), int(time.time()), FILE_MODE
                tar.addfile(info, io.BytesIO(manifest))
                if staged is not None:
                    for name in (f"{n}.tokens", f"{n}.pages", f"{n}.safetensors"):   # the heap file last
                        if (staged / name).exists():
                            tar.add(staged / name, arcname=name, recursive=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target.stat().st_size


def read(root: Path, filename: str, into: Path, model: str, backend: str, vocab: Optional[int],
         owner: Optional[str] = None) -> tuple[SlotFile, int, Optional[Path], array]:
    """Extract the slot file `root/filename` into the empty directory `into`: (its manifest, its
    bytes, the heap file's path there (None for an empty slot), its tokens). SlotFileError when it
    is missing, is not a slot file, was saved for another model or backend, or by another API key than
    `owner` (as if it were missing: a key must not learn what another saved); what was extracted
    is removed."""
    path = Path(root) / check_name(filename)
    missing = SlotFileError(f"no slot file {filename!r} in the server's --slot-save-path")
    if not path.is_file():
        raise missing
    size = path.stat().st_size
    try:
        with tarfile.open(path, mode="r:") as tar:
            first, meta = _head(tar, filename)
            if meta.owner != owner:
                raise missing
            if meta.model != model or meta.backend != backend:
                raise SlotFileError(f"{filename!r} was saved by a server running {meta.model} on {meta.backend}; "
                                    f"this one runs {model} on {backend}")
            if meta.tokens == 0:
                return meta, size, None, array("i")
            private_dir(into)
            heap = None
            for member in tar:
                if member.name == MANIFEST and member is first:   # (the iteration starts at the first again)
                    continue
                m = _MEMBER.fullmatch(member.name)
                if m is None or int(m.group(1)) != meta.tokens or not (member.isfile() or member.isdir()):
                    raise SlotFileError(f"{filename!r} holds {member.name!r}, which no slot file holds")
                if heap is not None:
                    raise SlotFileError(f"{filename!r} holds {member.name!r} after its heap file")
                tar.extract(member, into, set_attrs=False, filter="data")
                if m.group(2) == "safetensors":
                    heap = into / member.name
            if heap is None or not (into / f"{meta.tokens}.tokens").is_file():
                raise SlotFileError(f"{filename!r} is incomplete: no heap file or no tokens")
            try:
                tokens = read_token_file(into / f"{meta.tokens}.tokens")
            except ValueError as e:
                raise SlotFileError(f"{filename!r}: {e}") from None
            if len(tokens) != meta.tokens:
                raise SlotFileError(f"{filename!r} holds {len(tokens)} tokens where its manifest says {meta.tokens}")
            if vocab is not None and (min(tokens) < 0 or max(tokens) >= vocab):   # (not empty: tokens > 0)
                raise SlotFileError(f"{filename!r} holds token ids outside this model's vocabulary")
            return meta, size, heap, tokens
    except (tarfile.TarError, OSError, UnicodeDecodeError) as e:
        shutil.rmtree(into, ignore_errors=True)
        raise SlotFileError(f"{filename!r} cannot be read as a slot file: {e}") from e
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise


_NOT_OURS = object()   # a file of that name that is no slot file (the client's to replace, as llama-server would)


def _owner_of(path: Path):
    """The owner a slot file's manifest names; _NOT_OURS for a file that is no slot file."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            return _head(tar, path.name)[1].owner
    except (tarfile.TarError, OSError, SlotFileError, UnicodeDecodeError):
        return _NOT_OURS


def _head(tar: tarfile.TarFile, filename: str) -> tuple[tarfile.TarInfo, SlotFile]:
    """A slot file's first member, its manifest, read; SlotFileError for a file that is no slot file."""
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isfile() or first.size > 1 << 16:
        raise SlotFileError(f"{filename!r} is not a localheap slot file")
    return first, _manifest(tar.extractfile(first).read(), filename)


def _manifest(raw: bytes, filename: str) -> SlotFile:
    try:
        meta = json.loads(raw)
        if meta.get("format") != FORMAT:
            raise ValueError("not a slot file")
        if meta.get("version") != VERSION:
            raise SlotFileError(f"{filename!r} is a slot file of version {meta.get('version')}; this server reads "
                                f"version {VERSION}")
        n = meta["tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError("a token count that is no count")
        who = meta.get("owner")
        return SlotFile(n, str(meta["model"]), str(meta["backend"]), float(meta.get("saved_at", 0)),
                        who if isinstance(who, str) else None)
    except SlotFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SlotFileError(f"{filename!r} is not a localheap slot file ({e})") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:   # some filesystems refuse a directory fsync: the rename stands
        pass
    finally:
        os.close(fd)
