"""The page store: evicted K/V on disk, a small summary per page and KV head in RAM.

Numpy only; it knows nothing about models or devices. Keys arrive pre-RoPE (the backend
un-rotates them), so a page can be recalled at any position. One file per layer of
fixed-size records (one record = one page of `page_size` tokens of every KV head of
that layer); a record carries a CRC of its header and summaries and one of its payload,
so a torn write is ignored on load. `checkpoint(version)` fsyncs the files and writes,
atomically, a state file `state.<version>.npz`: the partial pages still in RAM and the sequence
number every valid record is below. The state is not in force by itself: the heap file of the
save names its version, and the session index names the heap file, so the index's commit is the
one commit point of a turn (README: session persistence). A store is opened at the state its
heap file names; records at or past that state's sequence number (written by a turn that never
committed) are tombstoned, and the other state files (older turns, or one never committed) are
removed; `committed(version)` removes them after a commit. A record that fails its data check
when read is tombstoned and counted (`corrupt`); `read(strict=True)` raises PageCorrupt then,
so recall picks again without it. Past `disk_budget` bytes the lowest-value
pages are dropped (tombstoned, their record slots reused), and counted.

A page the disk refuses (full, read-only, the directory removed under the store) is not
kept: it is counted as failed and `fault` says why, until a write succeeds again. A removed
directory takes its pages with it (counted as lost); the store starts over in a new one.

A checkpoint of the session (to fork from) is `link_tree`: hard links of the store's files.
That is safe because the store never rewrites a record a checkpoint can see: it appends
(records at or past the checkpoint's sequence number are not valid there), reuses only
tombstoned slots, writes each state file once under a new name, and before a drop, the one write into a
valid record, it takes its own copy of a layer file that has other links. A fork opens a
`copy_tree` of the checkpoint's store (the parent may still append into the linked files).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import sys
import threading
import weakref
import zlib
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from .. import faults
from .pagecodec import FORMATS, decode, encode, payload_fields, payload_names
from .scoring import lane_order
from .private import FILE_MODE, open_private, private_dir, write_private

log = logging.getLogger("localheap.pages")
MAGIC = 0x4C48_5047   # "LHPG"
META = "meta.json"    # the state of a store written before versioned states (read, never written)
TAIL = "tail.npz"
STATE = re.compile(r"state\.(\d{1,12})\.npz")
LATEST = "latest"     # open at the newest state file there (tests, and heap files older than versions)


def state_name(version: int) -> str:
    return f"state.{int(version)}.npz"


class PageCorrupt(ValueError):
    """Records that failed their data check when read (now tombstoned): pick again without them."""

    def __init__(self, n: int):
        super().__init__(f"{n} page records failed their check and were tombstoned")
        self.n = n


class CorruptPageState(ValueError):
    """The state a heap file names is missing or unreadable: the session is rebuilt from its tokens."""


@dataclass(frozen=True)
class PageGeometry:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    page_size: int = 32
    fmt: str = "f16"

    def __post_init__(self) -> None:
        assert self.fmt in FORMATS, self.fmt
        assert self.page_size >= 1


def record_dtype(g: PageGeometry) -> np.dtype:
    """One page of one layer: header, positions and summaries (CRC'd together), then the payload."""
    H, P, D = g.n_kv_heads, g.page_size, g.head_dim
    return np.dtype([
        ("magic", "<u4"), ("crc_meta", "<u4"), ("crc_data", "<u4"), ("pad", "<u4"),
        ("seq", "<u8"), ("value", "<f4"), ("n", "<u4"),
        ("positions", "<i8", (H, P)),        # original token positions, per KV head
        ("kmin", "<f2", (H, D)), ("kmax", "<f2", (H, D)), ("kmean", "<f2", (H, D)),   # pre-RoPE keys
        *payload_fields(g.fmt, H, P, D),
    ])


_META_FIELDS = ("seq", "value", "n", "positions", "kmin", "kmax", "kmean")


def _crc(rec: np.ndarray, fields) -> int:
    crc = 0
    for f in fields:
        crc = zlib.crc32(np.ascontiguousarray(rec[f]).tobytes(), crc)
    return crc


def _byte_run(dtype: np.dtype, fields) -> slice:
    """Where `fields` lie in a record of `dtype`, as one slice of its bytes: they must be contiguous
    and in order, so that one crc32 over the slice is _crc over the fields (crc32 chains)."""
    start = dtype.fields[fields[0]][1]
    end = start
    for f in fields:
        assert dtype.fields[f][1] == end, f"{f} is not next to the field before it"
        end += dtype[f].itemsize
    return slice(start, end)


SUMMARY_FIELDS = {"minmax": ("kmin", "kmax"), "mean": ("kmean",)}


def page_summaries(k: np.ndarray) -> tuple[np.ndarray, ...]:
    """Keys [H, m, P, D] of m pages -> (kmin, kmax, kmean) float32 [m, H, D]: numpy's reductions
    over each page's P tokens, the float16 widened exactly first (the reference)."""
    k32 = k.astype(np.float32, copy=False)
    return tuple(reduce(k32, axis=2).transpose(1, 0, 2) for reduce in (np.min, np.max, np.mean))


# Compiled summaries registered by a backend that has them (the torch backend's CPU module,
# backends/torch/slab_cpu.summarize_pages): page_summaries' values in one pass over the keys, with no
# float32 copy of them (an event of the 8B shape widens 134 MB of float16 keys to 268 MB otherwise).
# None while not built. They answer for a dtype and page shape once they gave page_summaries' bits.
_SUMMARIES: Optional[Callable] = None
_summaries_ready: Callable[[], Optional[bool]] = lambda: True
_summaries_verdicts: dict[tuple, bool] = {}
_summaries_lock = threading.Lock()


def use_summaries(kernel: Optional[Callable], ready: Optional[Callable[[], Optional[bool]]] = None) -> None:
    """Register compiled page summaries (None: numpy's); `ready()`: built (True), still building
    (None) or not to be had here (False)."""
    global _SUMMARIES, _summaries_ready
    _SUMMARIES = kernel
    _summaries_ready = ready or (lambda: True)
    _summaries_verdicts.clear()


def summaries(k: np.ndarray) -> tuple[np.ndarray, ...]:
    """page_summaries(k), from the registered kernel where it answers for k's dtype and shape."""
    if _SUMMARIES is not None and k.dtype in (np.float16, np.float32) and _summaries_agree(k.dtype, *k.shape[2:]):
        out = _SUMMARIES(k)
        if out is not None:
            return out
    return page_summaries(k)


def _summaries_agree(dtype: np.dtype, P: int, D: int) -> bool:
    """Whether the registered kernel gives page_summaries' bits for pages of P tokens x D in `dtype`
    (checked once, on random keys with repeated values; False while it is not built)."""
    key = (np.dtype(dtype).str, P, D)
    verdict = _summaries_verdicts.get(key)
    if verdict is not None:
        return verdict
    with _summaries_lock:
        if key in _summaries_verdicts:
            return _summaries_verdicts[key]
        if not _summaries_ready():
            return False   # building (asked again at the next page-out) or never here
        rng = np.random.default_rng(P * 1009 + D)
        k = (rng.standard_normal((3, 5, P, D)) * rng.choice([1e-3, 1.0, 300.0], (3, 5, 1, 1))).astype(dtype)
        k[0, 0] = k[0, 0, :1]                                          # a page of one repeated token
        k[1, 1] = np.round(k[1, 1] / 4)                                # ties, zeros of both signs
        k[1, 2] = np.where(rng.random((P, D)) < 0.5, 0.0, -0.0)         # nothing but zeros
        k[2, 3] = rng.standard_normal((P, D)) * np.exp2(rng.integers(-12, 10, (P, D)))   # sums that round
        got = _SUMMARIES(k)
        if got is None:
            return False
        want = page_summaries(k)
        verdict = all(np.array_equal(np.asarray(a).view(np.uint32), np.ascontiguousarray(b).view(np.uint32))
                      for a, b in zip(got, want))
        if not verdict:
            log.warning("page summaries: the compiled kernel differs from numpy's reductions (%s, %d x %d); "
                        "numpy builds the pages", np.dtype(dtype).name, P, D)
        _summaries_verdicts[key] = verdict
        return verdict


def _join(tail: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The partial page followed by incoming tokens (axis 1), one copy. An empty tail takes the
    incoming dtype (float16 K/V from the wire stay float16: the f16 format stores them as they
    are); otherwise the wider of the two (float16 -> float32 is exact)."""
    dtype = x.dtype if tail.shape[1] == 0 else np.result_type(tail.dtype, x.dtype)
    return np.concatenate([tail, x], axis=1, dtype=dtype)


def cut_positions(pos: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Positions inside `spans` ([k, 2] ascending [start, stop)) at their places in the spans joined
    end to end; -1 for the others (and for -1)."""
    pos = np.asarray(pos, np.int64)
    starts, stops = spans[:, 0], spans[:, 1]
    offsets = np.concatenate([[0], np.cumsum(stops - starts)[:-1]])
    i = np.searchsorted(starts, pos, side="right") - 1
    j = np.maximum(i, 0)
    inside = (i >= 0) & (pos < stops[j]) & (pos >= 0)
    return np.where(inside, offsets[j] + pos - starts[j], -1)


def hull_through(lo: np.ndarray, hi: np.ndarray, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans [first, last] (arrays alike) mapped through a cut to `spans`: (first, last, has), the
    hull of the places the kept positions among them take (has: some position inside is kept; a
    page's own tokens are among the positions of its span, so the hull holds theirs)."""
    starts, stops = spans[:, 0], spans[:, 1]
    # the first kept position at or after lo: lo itself inside a span, else the next span's start
    i = np.searchsorted(stops, lo, side="right")                 # first span ending after lo
    first = np.where(i < len(starts), np.maximum(lo, starts[np.minimum(i, len(starts) - 1)]), -1)
    # the last kept position at or before hi: hi itself inside a span, else the previous span's end - 1
    k = np.searchsorted(starts, hi, side="right") - 1            # last span starting at or before hi
    last = np.where(k >= 0, np.minimum(hi, stops[np.maximum(k, 0)] - 1), -1)
    has = (lo >= 0) & (first >= 0) & (last >= 0) & (first <= last)
    return cut_positions(np.where(has, first, 0), spans), cut_positions(np.where(has, last, 0), spans), has


def page_span(pos: np.ndarray) -> np.ndarray:
    """[..., H, P] positions (-1: none) -> [..., H, 2] (first, last) of each head's; (-1, -1) for a
    head with none (a batch of pages at once: [k, H, P] -> [k, H, 2])."""
    valid = pos >= 0
    first = np.where(valid, pos, np.iinfo(np.int64).max).min(axis=-1)
    last = np.where(valid, pos, -1).max(axis=-1)
    return np.stack([np.where(valid.any(axis=-1), first, -1), last], axis=-1)


class _Layer:
    """RAM side of one layer's file: summaries of the live records, the partial page, free slots."""

    def __init__(self, g: PageGeometry, fields: tuple[str, ...]):
        H, D, P = g.n_kv_heads, g.head_dim, g.page_size
        # [H, D, slots] each, the dims in the page scorer's order (scoring.lane_order): a question
        # reads every live page's summary dimension-major, without a transpose
        self.sums = {f: np.zeros((H, D, 0), np.float16) for f in fields}
        self.dims = lane_order(D)
        self.span = np.zeros((0, H, 2), np.int64)      # [slots, H, (first, last position)]; (-1, -1): none
        self.seq = np.zeros(0, np.int64)               # [slots]: each record's sequence number
        self.live = np.zeros(0, bool)                  # [slots]
        self.value = np.zeros(0, np.float32)
        self.free: list[int] = []
        # the partial page: tokens evicted but not yet a full page
        self.tail_pos = np.zeros((H, 0), np.int64)
        self.tail_k = np.zeros((H, 0, D), np.float32)
        self.tail_v = np.zeros((H, 0, D), np.float32)
        self.tail_value = np.zeros((H, 0), np.float32)
        self.P = P

    def grow(self, slots: int) -> None:
        n = len(self.live)
        if slots <= n:
            return
        extra = max(slots - n, n // 8, 64)   # geometric, so RAM stays within 1/8 of the live pages
        pad = lambda a: np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])   # noqa: E731
        self.sums = {f: np.concatenate([a, np.zeros((*a.shape[:2], extra), a.dtype)], axis=2)
                     for f, a in self.sums.items()}
        self.live, self.value, self.span, self.seq = pad(self.live), pad(self.value), pad(self.span), pad(self.seq)
        self.free.extend(range(n + extra - 1, n - 1, -1))   # lowest slot popped first
        self.free.sort(reverse=True)

    def keep_tail(self, pos: np.ndarray, keep: np.ndarray) -> None:
        """The partial page's tokens where `keep` [H, t], at positions `pos` [H, t], in order; each
        KV head cut to the fewest any keeps."""
        t = int(keep.sum(axis=1).min())
        idx = np.stack([np.flatnonzero(row)[:t] for row in keep])   # [H, t]
        self.tail_pos, self.tail_value = np.take_along_axis(pos, idx, 1), np.take_along_axis(self.tail_value, idx, 1)
        self.tail_k, self.tail_v = (np.take_along_axis(a, idx[..., None], 1) for a in (self.tail_k, self.tail_v))

    def put_summaries(self, slots, recs: np.ndarray) -> None:
        """The summaries ([H, D] each) of records `recs` [k] into the RAM columns of `slots` [k]."""
        for f, a in self.sums.items():
            a[:, :, slots] = recs[f][:, :, self.dims].transpose(1, 2, 0)


class PageStore:
    """Pages of evicted tokens for one session (all layers), in `root`."""

    def __init__(self, root: Path, geometry: PageGeometry, disk_budget: int = 0, summary: str = "minmax",
                 max_pages: int = 0, state: Union[int, str, None] = LATEST):
        """`summary`: which key summaries stay in RAM for scoring (minmax: 2 x D per page and KV
        head, mean: D); every record on disk carries all three. `max_pages` (all layers; 0: no
        bound) bounds the pages whose summaries RAM holds, as `disk_budget` bounds the disk.
        `state`: the version to open at (raises CorruptPageState when it is missing or
        unreadable); None: a new store (whatever `root` holds is discarded); LATEST: the newest."""
        self.root = Path(root)
        self.g = geometry
        self.disk_budget = disk_budget          # bytes; 0 = unbounded
        self.file_budget: Optional[int] = None  # bytes the layer files may hold; None: disk_budget (--disk-total
                                                # sets its own: live pages and files are bounded apart there)
        self.max_pages = max_pages              # pages, all layers; 0 = unbounded
        self.dtype = record_dtype(geometry)
        self.record_bytes = self.dtype.itemsize
        self._meta_run = _byte_run(self.dtype, _META_FIELDS)
        self._data_run = _byte_run(self.dtype, payload_names(geometry.fmt))
        names = ("magic", "crc_meta", *_META_FIELDS)   # a record's header .. summaries, without the payload
        self.header_dtype = np.dtype({"names": list(names), "formats": [self.dtype.fields[n][0] for n in names],
                                      "offsets": [self.dtype.fields[n][1] for n in names],
                                      "itemsize": self.dtype.fields["kmean"][1] + self.dtype["kmean"].itemsize})
        assert sum(self.dtype[f].itemsize for f in _META_FIELDS) == \
            self.header_dtype.itemsize - self.dtype.fields[_META_FIELDS[0]][1], "CRC'd header fields not contiguous"
        self.summary = summary
        self.layers = [_Layer(geometry, SUMMARY_FIELDS[summary]) for _ in range(geometry.n_layers)]
        self.seq = 0                # next record's sequence number
        self.dropped = 0            # pages dropped for the disk budget, ever
        self.reclaimed = 0          # of those, dropped to give space back to other sessions (--disk-total)
        self.written = 0            # pages written, ever
        self._appending = threading.RLock()   # stats (any thread) never see a page past the budget mid-append
        self.failed = 0             # pages the disk refused (not kept), ever
        self.lost = 0               # pages lost with a directory removed under the store
        self.corrupt = 0            # records that failed their check (tombstoned), since opened
        self.version: Optional[int] = None   # the state version opened or last written
        # the session's cuts (--cache-reuse), oldest first: (the first sequence number after it, the
        # spans kept [k, 2]). A record keeps the positions it was written with; one older than a cut
        # reads through it (cut_positions), so its tokens come back at the shorter history's places
        self.cuts: list[tuple[int, np.ndarray]] = []
        self.fault: Optional[str] = None   # why page-out fails now (None: it works)
        self._fds: list[int] = []
        self._closed = False
        weakref.finalize(self, _close_all, self._fds)
        try:
            self._open(os.O_RDWR | os.O_CREAT)
        except OSError as e:   # a full or read-only disk: serve without pages, retry at the next write
            self._refused(e)
            return
        try:
            self._load(state)
        except BaseException:
            self.close()
            raise

    def _open(self, flags: int, parents: bool = True) -> None:
        """Open (creating the directory) every layer's file into self._fds, or none of them."""
        try:
            private_dir(self.root, parents=parents)
            for i in range(self.g.n_layers):
                self._fds.append(open_private(self._file(i), flags))
        except OSError:
            _close_all(self._fds)
            raise

    def _ready(self, layer: Optional[int] = None) -> None:
        """The files are there to write into (raises OSError if not): a directory, or a layer's
        file (`layer`'s; None: every one's), removed or replaced under the store loses its pages,
        and the store starts over in a new one."""
        if self._fds and self.root.is_dir() and self._open_files_there(layer):
            return
        assert not self._closed, "write into a closed page store"
        if self._fds:   # (a layer's file removed under it: what it writes would go to no file; started over)
            self._forget()
        else:   # never opened: whatever a state there names was never loaded into this store
            _remove_states(self.root)
        self._open(os.O_RDWR | os.O_CREAT | os.O_TRUNC, parents=False)   # a removed sessions dir stays removed

    def _open_files_there(self, layer: Optional[int]) -> bool:
        """Whether the layer's file (None: every layer's) is still the file open here: not where it
        was removed (a checkpoint's hard link may keep it alive) or replaced under the store."""
        for i in range(len(self._fds)) if layer is None else (layer,):
            try:
                there = os.stat(self._file(i))
            except FileNotFoundError:
                return False
            here = os.fstat(self._fds[i])
            if (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino):
                return False
        return True

    def _forget(self) -> None:
        """The directory is gone: its records with it. Every slot is free again (the tails, in RAM, stay)."""
        _close_all(self._fds)
        self.lost += self.pages
        self.fault = f"page store directory {self.root} (or a file in it) was removed; {self.pages} pages lost"
        for L in self.layers:
            L.live[:] = False
            L.free = list(range(len(L.live) - 1, -1, -1))

    def _refused(self, e: OSError) -> None:
        self.fault = f"page-out failed: {e.strerror or e}"

    def _file(self, layer: int) -> Path:
        return self.root / f"layer{layer:03d}.pages"

    # -- writing --------------------------------------------------------------------
    def append(self, layer: int, positions: np.ndarray, keys: np.ndarray, values: np.ndarray,
               value: Optional[np.ndarray] = None) -> int:
        """Evicted tokens of one layer: positions [H, n]; keys (pre-RoPE), values [H, n, D];
        value [H, n] (the policy's score at eviction, for the disk budget). Full pages are
        written; the rest waits in RAM. Returns how many pages were written."""
        return self.append_many([(layer, positions, keys, values, value)])

    def append_many(self, jobs: Sequence[tuple], pool: Optional[Executor] = None) -> int:
        """One eviction event's layers: each job is `append`'s arguments for one layer, the layers
        distinct. The same records, files and RAM side as one `append` per job in order. With
        `pool`, the pages are built (summaries, payload and its checksum: most of a page-out's CPU)
        on its threads, a layer each; the writes run here, in job order, as `append` runs them.
        A layer whose pages fail to build raises once the others are written. Returns how many
        pages were written."""
        layers = [job[0] for job in jobs]
        assert len(set(layers)) == len(layers), "one job per layer"
        with self._appending:
            built = self._build_all(jobs, pool if len(jobs) > 1 else None)
            written, error = 0, None
            for layer, pages in zip(layers, built):
                if isinstance(pages, BaseException):
                    error = error or pages
                    continue
                n = 0 if pages is None else self._write_pages(layer, *pages)
                if n:
                    written += n
                    self.enforce_budget()
            if error is not None:
                raise error
            return written

    def _build_all(self, jobs: Sequence[tuple], pool: Optional[Executor]) -> list:
        """_build of every job (its result, or the exception it raised), on `pool`'s threads where
        there is one that takes work (at interpreter exit it takes none: here then)."""
        def build(job):
            try:
                return self._build(*job)
            except Exception as e:   # noqa: BLE001 - raised by append_many after the others' writes
                return e

        futures = []
        for job in jobs:
            try:
                futures.append(None if pool is None else pool.submit(build, job))
            except RuntimeError:   # the pool is shut down
                futures.append(None)
        return [build(job) if f is None else f.result() for f, job in zip(futures, jobs)]

    def _build(self, layer: int, positions: np.ndarray, keys: np.ndarray, values: np.ndarray,
               value: Optional[np.ndarray] = None) -> Optional[tuple]:
        """The full pages one layer's evicted tokens complete, as (records, spans) from _records
        (None if none); the rest joins the layer's partial page. Touches that layer's tail alone."""
        L = self.layers[layer]
        value = np.zeros(positions.shape, np.float32) if value is None else value
        incoming = (positions, keys, values, value)
        tails = (L.tail_pos, L.tail_k, L.tail_v, L.tail_value)
        m = (L.tail_pos.shape[1] + positions.shape[1]) // self.g.page_size   # full pages: built together
        cut, pages = 0, None
        if m:
            cut = m * self.g.page_size - L.tail_pos.shape[1]   # the incoming tokens that complete them
            # the partial page and the incoming tokens in one copy each
            pages = self._records(*(_join(t, x[:, :cut]) for t, x in zip(tails, incoming)))
            tails = tuple(t[:, :0] for t in tails)
        L.tail_pos, L.tail_k, L.tail_v, L.tail_value = (_join(t, x[:, cut:]) for t, x in zip(tails, incoming))
        return pages

    def _records(self, pos: np.ndarray, k: np.ndarray, v: np.ndarray, value: np.ndarray) -> tuple:
        """m full pages (pos, value [H, m P]; k, v [H, m P, D]) as m records, all but their seq and
        header checksum (set as each is written: _seal), and their spans [m, H, 2]. Each page's summaries and
        payload are what building that page alone gives (the same reductions over the same P
        tokens, tested bit for bit). The summaries come from `summaries` over the [H, m, P, D] view
        of the keys (a registered kernel's, or numpy's reductions: the same bits) as [m, H, D]."""
        H, n = pos.shape
        P = self.g.page_size
        m = n // P
        pos = pos.reshape(H, m, P)
        k, v = k.reshape(H, m, P, -1), v.reshape(H, m, P, -1)
        recs = np.zeros(m, self.dtype)
        recs["magic"], recs["n"] = MAGIC, P
        recs["value"] = value.reshape(H, m, P).max(axis=(0, 2))
        recs["positions"] = pos.transpose(1, 0, 2)
        if self.g.fmt == "int8":   # quantized from float32, whatever came in
            k, v = k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
        recs["kmin"], recs["kmax"], recs["kmean"] = summaries(k)                      # [m, H, D] each
        encode(recs, self.g.fmt, k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3))   # float16 in: copied as is
        raw = recs.view(np.uint8).reshape(m, -1)
        recs["crc_data"] = [zlib.crc32(raw[j, self._data_run]) for j in range(m)]
        return recs, np.stack([pos.min(axis=2), pos.max(axis=2)], axis=2).transpose(1, 0, 2)

    def _write_pages(self, layer: int, recs: np.ndarray, spans: np.ndarray) -> int:
        """Write _records' pages into the lowest free slots, in order: each run of consecutive slots
        in one write (an eviction event's pages are mostly one run), then their RAM side at once.
        A run the disk refuses is written again page by page (_write), so that each page it
        refuses is counted and left out as when every page had its own write."""
        try:
            self._ready(layer)
        except OSError:
            return sum(self._write(layer, recs[j: j + 1], spans[j: j + 1]) for j in range(len(recs)))
        L = self.layers[layer]
        m = len(recs)
        self._keep_files_in_budget(layer, m)
        if len(L.free) < m:
            L.grow(len(L.live) + m - len(L.free))
        slots = np.array([L.free.pop() for _ in range(m)], np.int64)
        self._seal(recs)
        cuts = [0, *(np.flatnonzero(np.diff(slots) != 1) + 1).tolist(), m]
        written = 0
        for a, b in zip(cuts[:-1], cuts[1:]):
            try:
                self._pwrite(layer, recs[a:b].view(np.uint8), int(slots[a]) * self.record_bytes)
            except OSError:
                L.free.extend(slots[a:].tolist())   # this run and the rest, page by page
                L.free.sort(reverse=True)
                return written + sum(self._write(layer, recs[j: j + 1], spans[j: j + 1]) for j in range(a, m))
            self._landed(L, slots[a:b], recs[a:b], spans[a:b])
            written += b - a
        return written

    def _keep_files_in_budget(self, layer: int, m: int) -> None:
        """Before `m` pages go into `layer`'s lowest free slots: where they would grow its file (past its
        holes) beyond what the disk budget leaves the files, that layer's own lowest-value pages go first,
        their slots taken instead. (enforce_budget bounds the live pages, any layer's going first; the
        slots it frees in one layer cannot take another's pages, and a file never shrinks while open:
        one layer's file grew to its own high-water mark, the files 1.4x the bound.)"""
        bound = self.disk_budget if self.file_budget is None else self.file_budget
        if not bound:
            return
        L = self.layers[layer]
        size = os.fstat(self._fds[layer]).st_size // self.record_bytes
        holes = len(L.free) - bisect.bisect_right(L.free, -size, key=lambda s: -s)   # (free: highest first)
        grow = m - holes
        if grow <= 0:   # its holes take them (the other files' sizes are not read)
            return
        over = self.file_bytes // self.record_bytes + grow - bound // self.record_bytes
        if over <= 0:
            return
        live = np.flatnonzero(L.live)
        for slot in live[np.argsort(L.value[live], kind="stable")][:min(over, grow)]:
            try:
                self._drop(layer, int(slot))
            except OSError as e:
                self._refused(e)
                return

    def _write(self, layer: int, rec: np.ndarray, span: np.ndarray) -> bool:
        """Write one page (rec, span: one-record arrays from _records); a page the disk refuses is
        counted and left out (see `fault`)."""
        try:
            self._ready(layer)
        except OSError as e:
            self.failed += 1
            self._refused(e)
            return False
        L = self.layers[layer]
        if not L.free:
            L.grow(len(L.live) + 1)
        slot = L.free.pop()
        self._seal(rec)
        try:
            self._pwrite(layer, rec.view(np.uint8), slot * self.record_bytes)
        except OSError as e:
            L.free.append(slot)
            L.free.sort(reverse=True)
            self.failed += 1
            self._refused(e)
            try:   # a partly written record must not pass for a page on reopen
                self._pwrite(layer, np.zeros(4, np.uint8).tobytes(), slot * self.record_bytes)
            except OSError:
                pass
            return False
        self._landed(L, np.array([slot]), rec, span)
        return True

    def _seal(self, recs: np.ndarray) -> None:
        """Number records [k] from the store's next sequence number and set their header checksum
        (_crc over the fields, as one run of bytes; _records set the payload's)."""
        recs["seq"] = self.seq + np.arange(len(recs))
        raw = recs.view(np.uint8).reshape(len(recs), -1)
        recs["crc_meta"] = [zlib.crc32(raw[j, self._meta_run]) for j in range(len(recs))]

    def _landed(self, L: _Layer, slots: np.ndarray, recs: np.ndarray, spans: np.ndarray) -> None:
        """Records [k] are on disk in `slots`: their RAM side, the summaries read back from the
        records so that a reopened store scores identically."""
        self.fault = None   # page-out works (again)
        for _ in range(len(slots)):
            faults.step("pages.write")
        L.put_summaries(slots, recs)
        L.live[slots], L.value[slots], L.span[slots], L.seq[slots] = True, recs["value"], spans, recs["seq"]
        self.seq += len(slots)
        self.written += len(slots)

    def _pwrite(self, layer: int, data: bytes, offset: int) -> None:
        """Every write into a layer file goes through here (a short write is an error)."""
        if os.pwrite(self._fds[layer], data, offset) != len(data):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write)")

    @property
    def page_limit(self) -> Optional[int]:
        """Most live pages (all layers) the disk budget and max_pages allow; None: no bound
        (a disk budget under one record allows none)."""
        limits = ([self.disk_budget // self.record_bytes] if self.disk_budget else []) + \
                 ([self.max_pages] if self.max_pages else [])
        return min(limits) if limits else None

    def enforce_budget(self) -> int:
        """Drop the lowest-value live pages (any layer) until the store fits the disk budget and max_pages."""
        limit = self.page_limit
        if limit is None:
            return 0
        excess = self.pages - limit
        if excess <= 0:
            return 0
        return self.drop_lowest(excess)

    def drop_lowest(self, n: int, reclaim: bool = False) -> int:
        """Drop the `n` lowest-value live pages (any layer); `reclaim`: for another session's
        room (--disk-total), counted apart. Returns how many were dropped: fewer when the disk
        refuses the tombstone (then `fault` says why)."""
        cands = [(layer, slot) for layer, L in enumerate(self.layers) for slot in np.flatnonzero(L.live)]
        values = np.array([self.layers[layer].value[slot] for layer, slot in cands])
        done = 0
        for i in np.argsort(values, kind="stable")[:n]:
            try:
                self._drop(*cands[i])
            except OSError as e:   # e.g. no room for the copy a checkpoint's link needs
                self._refused(e)
                break
            done += 1
            self.reclaimed += reclaim
        return done

    def forget_from(self, seen: int) -> int:
        """The session rewound to its first `seen` tokens (backends/slots.HeapRollback.rewind): no page
        may bring back a token at or past `seen` (a later token takes its position). Its pages are
        tombstoned (the older tokens sharing a page with one go too) and the partial pages lose such
        tokens, each KV head cut to the fewest any keeps. Not counted as dropped; raises OSError
        when the disk refuses a tombstone (the pages before it are gone). Returns the pages forgotten."""
        gone = 0
        with self._appending:
            for layer, L in enumerate(self.layers):
                live = np.flatnonzero(L.live)
                for slot in live[L.span[live, :, 1].max(axis=1, initial=-1) >= seen]:
                    self._tombstone(layer, int(slot))
                    gone += 1
                keep = L.tail_pos < seen
                if not keep.all():
                    L.keep_tail(L.tail_pos, keep)
        return gone

    def cut(self, spans: Sequence[tuple[int, int]]) -> int:
        """The session was cut to `spans` (backends/slots.HeapRollback.cut; queued writes done): its
        pages' tokens inside them take their places in the spans joined end to end, the others are
        forgotten. Records stay as written (a checkpoint may link them): the cut is kept in the
        state (`cuts`), and positions read from a record older than it pass through it. In RAM, each
        page's span is mapped (the kept tokens' hull); a page that keeps no token is tombstoned, and
        the partial page loses the cut tokens (each KV head cut to the fewest any keeps). Raises
        OSError when the disk refuses a tombstone: the store is then as it was but for the pages
        tombstoned before (which kept none of the spans' tokens). Returns the pages forgotten."""
        spans = np.asarray(spans, np.int64).reshape(-1, 2)
        gone = 0
        with self._appending:
            mapped = []
            for layer, L in enumerate(self.layers):   # the pages that keep nothing go first (a refusal
                live = np.flatnonzero(L.live)          # there leaves the store in the old frame)
                lo, hi, has = hull_through(L.span[live, :, 0], L.span[live, :, 1], spans)
                for slot in live[~has.any(axis=1)]:
                    self._tombstone(layer, int(slot))
                    gone += 1
                mapped.append((live, lo, hi, has))
            self.cuts.append((self.seq, spans))
            for L, (live, lo, hi, has) in zip(self.layers, mapped):
                L.span[live, :, 0], L.span[live, :, 1] = np.where(has, lo, -1), np.where(has, hi, -1)
                if L.tail_pos.size:
                    pos = cut_positions(L.tail_pos, spans)
                    L.keep_tail(pos, pos >= 0)
            self._prune_cuts()
        return gone

    def _prune_cuts(self) -> None:
        """Cuts no live record is older than are no longer read through."""
        oldest = min((int(L.seq[L.live].min()) for L in self.layers if L.live.any()), default=self.seq)
        self.cuts = [(at, spans) for at, spans in self.cuts if at > oldest]

    def map_positions(self, positions: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """Positions read from records (any shape; `seqs` their records' sequence numbers, broadcast
        to it) at their places now: through every cut made after the record was written; -1 for a
        token a cut dropped (and for -1)."""
        if not self.cuts:
            return positions
        out = np.array(positions, np.int64)
        seqs = np.broadcast_to(seqs, out.shape)
        for at, spans in self.cuts:
            older = seqs < at
            if older.any():
                out[older] = cut_positions(out[older], spans)
        return out

    def _drop(self, layer: int, slot: int) -> None:
        self._tombstone(layer, slot)
        self.dropped += 1

    def _tombstone(self, layer: int, slot: int) -> None:
        L = self.layers[layer]
        if os.fstat(self._fds[layer]).st_nlink > 1:
            self._own(layer)   # a checkpoint links this file: it keeps the page
        self._pwrite(layer, np.zeros(4, np.uint8).tobytes(), int(slot) * self.record_bytes)   # magic = 0
        L.live[slot] = False
        L.free.append(int(slot))
        L.free.sort(reverse=True)

    def _own(self, layer: int) -> None:
        """Replace a layer file other links share with this store's own copy (the links keep theirs)."""
        path = self._file(layer)
        tmp = path.with_name(path.name + ".own")
        tmp.unlink(missing_ok=True)   # a crash's leftover
        clone_file(path, tmp)
        fd = os.open(tmp, os.O_RDWR)
        os.replace(tmp, path)
        os.close(self._fds[layer])
        self._fds[layer] = fd   # the same list the finalizer holds

    def checkpoint(self, version: Optional[int] = None) -> int:
        """Write the store as it is now as state `version` (default: the one after the last):
        fsync the layer files, then the state file, atomically. Not in force until a heap file
        that names it is committed; raises OSError when the disk refuses. Returns the version."""
        self._ready()
        for fd in self._fds:
            os.fsync(fd)
        version = (self.version + 1 if self.version is not None else 0) if version is None else int(version)
        _write_state(self.root / state_name(version), self._state_meta(), self._tails())
        self.version = version
        faults.step("pages.state")
        return version

    def committed(self, version: int) -> None:
        """State `version` is in force (its heap file committed): the other state files go."""
        try:
            _remove_states(self.root, keep=version)
        except OSError as e:   # left for the next commit, or the next open
            log.warning("page store %s: stale state files not removed: %s", self.root, e)

    def snapshot(self, dst: Path, version: int) -> None:
        """A checkpoint of the store as it is now in `dst` (to fork from): hard links of the layer
        files (fsynced first) and its own state file. The live store's state files are untouched."""
        self._ready()
        for fd in self._fds:
            os.fsync(fd)
        dst = Path(dst)
        if dst.exists():
            shutil.rmtree(dst)
        private_dir(dst)
        for i in range(self.g.n_layers):
            try:
                os.link(self._file(i), dst / self._file(i).name)
            except OSError:   # a filesystem without hard links
                shutil.copyfile(self._file(i), dst / self._file(i).name)
                os.chmod(dst / self._file(i).name, FILE_MODE)
        _write_state(dst / state_name(version), self._state_meta(), self._tails())
        faults.step("checkpoint.pages")

    def _state_meta(self) -> dict:
        return {"geometry": asdict(self.g), "seq": self.seq, "dropped": self.dropped, "written": self.written,
                "reclaimed": self.reclaimed, "cuts": [[at, spans.tolist()] for at, spans in self.cuts]}

    def _tails(self) -> dict:
        tails = {}
        for i, L in enumerate(self.layers):
            tails.update({f"{i}.pos": L.tail_pos, f"{i}.k": L.tail_k, f"{i}.v": L.tail_v, f"{i}.value": L.tail_value})
        return tails

    # -- reading --------------------------------------------------------------------
    def summaries(self, layer: int) -> tuple[np.ndarray, ...]:
        """(slots [N], then kmin, kmax [N, H, D] (minmax) or kmean [N, H, D] (mean)) of the live
        pages, float32, C-contiguous (what recall.score_pages scores)."""
        slots, *by_dim = self.summaries_by_dim(layer)
        inverse = np.argsort(self.layers[layer].dims)
        return (slots, *(np.ascontiguousarray(a[:, inverse].transpose(2, 0, 1)) for a in by_dim))

    def summaries_by_dim(self, layer: int, widen: bool = True) -> tuple[np.ndarray, ...]:
        """(slots [N], then kmin, kmax (minmax) or kmean (mean), each [H, D, N] float32 with the
        dims in scoring.lane_order) of the live pages: what scoring.score_pages_by_dim scores.
        `widen=False`: as stored, float16 (a view of the store's buffer where the live pages are
        its first slots: read it before the store appends again)."""
        L = self.layers[layer]
        slots = np.flatnonzero(L.live)
        n = len(slots)
        whole = n == 0 or slots[-1] == n - 1   # the live pages are slots 0 .. n-1: a slice, no gather
        raw = ((a[:, :, :n] if whole else a.take(slots, axis=2)) for a in (L.sums[f] for f in SUMMARY_FIELDS[self.summary]))
        return (slots, *((a.astype(np.float32) for a in raw) if widen else raw))

    def spans(self, layer: int, slots: np.ndarray) -> np.ndarray:
        """[n, H, 2]: each page's first and last token position per KV head (kept in RAM)."""
        return self.layers[layer].span[slots]

    def positions(self, layer: int, slots: np.ndarray) -> np.ndarray:
        """[n, H, P] token positions of the given pages, read from the records' headers only (the
        payload stays on disk); a torn record's positions come back as -1, and a live one is
        tombstoned, logged and counted (`corrupt`), as read() does."""
        head, n = self.header_dtype, len(slots)
        out = np.full((n, self.g.n_kv_heads, self.g.page_size), -1, np.int64)
        if not n:
            return out
        # One pread per page into one buffer, then the checks and the positions for all pages at once.
        # The CRC'd fields (seq .. kmean) are one contiguous run of bytes in the record, so one crc32
        # over that run is _crc(rec, _META_FIELDS) (test_pages checks the two agree).
        size, fd, rb = head.itemsize, self._fds[layer], self.record_bytes
        raw = bytearray(n * size)
        view = memoryview(raw)
        full = np.zeros(n, bool)
        for i, slot in enumerate(slots.tolist() if isinstance(slots, np.ndarray) else slots):
            full[i] = os.preadv(fd, [view[i * size: (i + 1) * size]], int(slot) * rb) == size
        recs = np.frombuffer(raw, head)
        lo = self.dtype.fields[_META_FIELDS[0]][1]
        crc = np.fromiter((zlib.crc32(view[i * size + lo: (i + 1) * size]) for i in range(n)), np.uint32, n)
        ok = full & (recs["magic"] == MAGIC) & (crc == recs["crc_meta"])
        out[ok] = self.map_positions(recs["positions"][ok], recs["seq"][ok][:, None, None])
        if not ok.all():   # a live page whose header fails its check is corrupt, as read() finds it
            live = self.layers[layer].live
            self._condemn(layer, [int(x) for x in np.asarray(slots)[~ok] if live[int(x)]])
        return out

    def tail(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The layer's partial page (evicted, not yet written): positions [H, t], keys, values [H, t, D]."""
        L = self.layers[layer]
        return L.tail_pos, L.tail_k.astype(np.float32, copy=False), L.tail_v.astype(np.float32, copy=False)

    def read(self, layer: int, slots: np.ndarray, strict: bool = False) -> np.ndarray:
        """Records of the given slots. One that fails its check (torn, overwritten, bit rot) comes
        back with magic 0; a live one is tombstoned, logged and counted (`corrupt`), and with
        `strict` PageCorrupt is raised after the whole read (pick again: it is gone from the summaries)."""
        rb, fd = self.record_bytes, self._fds[layer]
        out = np.empty(len(slots), self.dtype)
        raw = out.view(np.uint8).reshape(len(slots), rb)   # each record read in place, no copy
        bad = []
        for i, slot in enumerate(slots):
            rec = raw[i]
            if not (os.preadv(fd, [rec], int(slot) * rb) == rb and out[i]["magic"] == MAGIC
                    and zlib.crc32(rec[self._meta_run]) == out[i]["crc_meta"]
                    and zlib.crc32(rec[self._data_run]) == out[i]["crc_data"]):   # _crc over the fields, in one run
                rec[:] = 0
                if self.layers[layer].live[int(slot)]:
                    bad.append(int(slot))
        self._condemn(layer, bad)
        if bad and strict:
            raise PageCorrupt(len(bad))
        return out

    def _condemn(self, layer: int, bad: list[int]) -> None:
        """Live pages whose records failed their check: tombstoned, counted (`corrupt`), logged."""
        if not bad:
            return
        with self._appending:
            for slot in bad:
                self.corrupt += 1
                try:
                    self._tombstone(layer, slot)
                except OSError:   # the disk refuses the tombstone: forgotten in RAM at least
                    self.layers[layer].live[slot] = False
        log.warning("page store %s: layer %d: %d records failed their check; tombstoned", self.root, layer, len(bad))

    def load(self, layer: int, page_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """page_slots [H, k] (per KV head) -> positions [H, k*P], keys, values [H, k*P, D] float32,
        each head's tokens in position order. Head h gets head h's part of its pages."""
        H, k = page_slots.shape
        uniq, inv = np.unique(page_slots, return_inverse=True)
        recs = self.read(layer, uniq, strict=True)
        keys, values = decode(recs, self.g.fmt)                 # [u, H, P, D]
        inv = inv.reshape(H, k)
        heads = np.arange(H)[:, None]
        pos = self.map_positions(recs["positions"][inv, heads], recs["seq"][inv][..., None])   # [H, k, P]
        ks, vs = keys[inv, heads], values[inv, heads]           # [H, k, P, D]
        P, D = self.g.page_size, self.g.head_dim
        pos, ks, vs = pos.reshape(H, k * P), ks.reshape(H, k * P, D), vs.reshape(H, k * P, D)
        order = np.argsort(pos, axis=1, kind="stable")
        # a cut's dropped tokens (-1) sort first: each head keeps its last tokens, as many as every head has
        order = order[:, k * P - int((pos >= 0).sum(axis=1).min()):]
        return (np.take_along_axis(pos, order, 1), np.take_along_axis(ks, order[..., None], 1),
                np.take_along_axis(vs, order[..., None], 1))

    # -- accounting -----------------------------------------------------------------
    @property
    def pages(self) -> int:
        return int(sum(L.live.sum() for L in self.layers))

    @property
    def tokens(self) -> int:
        """Tokens whose pages are live (per layer: a page holds page_size tokens of one layer)."""
        return self.pages * self.g.page_size // max(1, self.g.n_layers)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the live records (freed slots are reused before a file grows)."""
        return self.pages * self.record_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of layer files a checkpoint also links: the store copies one before it drops a page in it."""
        try:
            return sum(st.st_size for st in map(os.fstat, list(self._fds)) if st.st_nlink > 1)
        except OSError:
            return 0

    @property
    def state_bytes(self) -> int:
        """Most a commit's new state file takes while the last one still exists: the last one's size,
        grown by at most a partial page per layer."""
        try:
            last = max((e.stat().st_size for e in os.scandir(self.root) if STATE.fullmatch(e.name)), default=0)
        except OSError:
            last = 0
        return last + self.g.n_layers * self.record_bytes

    @property
    def file_bytes(self) -> int:
        """Bytes the layer files take (dropped slots included: reused, never given back while open)."""
        try:
            return sum(os.fstat(fd).st_size for fd in list(self._fds))
        except OSError:   # a file swapped by the writer thread this instant: count the live records
            return self.disk_bytes

    @property
    def summary_bytes(self) -> int:
        """RAM of the summaries and the page spans (their allocated slots)."""
        return int(sum(a.nbytes for L in self.layers for a in L.sums.values()) + sum(L.span.nbytes for L in self.layers))

    def disk_bytes_per_token(self) -> float:
        """Per token, all layers: one record holds page_size tokens of one layer."""
        return self.g.n_layers * self.record_bytes / self.g.page_size

    def summary_bytes_per_token(self) -> float:
        """RAM for the summaries (f16) and page spans per token on disk, all layers."""
        per_page = (len(SUMMARY_FIELDS[self.summary]) * self.g.head_dim * 2 + 16) * self.g.n_kv_heads
        return self.g.n_layers * per_page / self.g.page_size

    def stats(self) -> dict:
        with self._appending:
            return self._stats()

    def _stats(self) -> dict:
        return {"pages": self.pages, "pages_written": self.written, "pages_dropped": self.dropped,
                "pages_reclaimed": self.reclaimed, "pages_failed": self.failed, "pages_lost": self.lost,
                "pages_corrupt": self.corrupt,
                "degraded": self.fault, "tokens_on_disk": self.tokens,
                "disk_bytes": self.disk_bytes, "summary_bytes": self.summary_bytes,
                "disk_bytes_per_token": round(self.disk_bytes_per_token(), 1),
                "summary_bytes_per_token": round(self.summary_bytes_per_token(), 1),
                "page_size": self.g.page_size, "format": self.g.fmt,
                "tokens_limit": (self.page_limit or 0) * self.g.page_size // max(1, self.g.n_layers)}

    def close(self) -> None:
        self._closed = True
        _close_all(self._fds)   # the same list the finalizer holds

    def move_to(self, root: Path) -> None:
        """Move the store's directory (e.g. from a temp dir to the session's) and reopen its files."""
        root = Path(root)
        if root.resolve() == self.root.resolve():
            return
        self.close()
        if root.exists():
            shutil.rmtree(root)
        private_dir(root.parent)
        shutil.move(str(self.root), str(root))
        self.root = root
        self._fds.extend(os.open(self._file(i), os.O_RDWR) for i in range(self.g.n_layers))

    # -- reopening ------------------------------------------------------------------
    def _headers(self, layer: int, n: int) -> np.ndarray:
        """The headers of the layer's first `n` records [n] (header_dtype), read through a map of
        the file: the payloads (about nine tenths of a record) are neither read nor copied."""
        if not n:
            return np.zeros(0, self.header_dtype)
        mapped = np.memmap(self._file(layer), np.uint8, mode="r", shape=(n * self.record_bytes,))
        return np.array(np.ndarray((n,), self.header_dtype, buffer=mapped, strides=(self.record_bytes,)))

    def _load(self, state: Union[int, str, None]) -> None:
        """Open at `state` (see __init__); records past it are tombstoned, other states removed."""
        if state == LATEST:
            state = newest_state(self.root)
        if state is None:   # a new store, or one never checkpointed: nothing here belongs to a saved heap
            for fd in self._fds:
                os.ftruncate(fd, 0)
            _remove_states(self.root)
            return
        meta, tails = read_state(self.root, state)
        if PageGeometry(**meta["geometry"]) != self.g:
            raise CorruptPageState(f"page store geometry changed: {meta['geometry']} != {asdict(self.g)}")
        H, D, P = self.g.n_kv_heads, self.g.head_dim, self.g.page_size
        for i in range(self.g.n_layers):
            t = tails[f"{i}.pos"].shape[-1] if f"{i}.pos" in tails else -1
            shapes = {f"{i}.pos": (H, t), f"{i}.k": (H, t, D), f"{i}.v": (H, t, D), f"{i}.value": (H, t)}
            if not 0 <= t < P or any(k not in tails or tails[k].shape != v for k, v in shapes.items()):
                raise CorruptPageState(f"page store state {state}: layer {i}'s partial page is malformed")
        self.seq, self.dropped, self.written = int(meta["seq"]), int(meta["dropped"]), int(meta["written"])
        self.reclaimed = int(meta.get("reclaimed", 0))
        self.cuts = [(int(at), np.asarray(spans, np.int64).reshape(-1, 2)) for at, spans in meta.get("cuts", [])]
        for i, L in enumerate(self.layers):
            size = os.fstat(self._fds[i]).st_size
            n = size // self.record_bytes                      # a torn last record is ignored
            recs = self._headers(i, n)
            L.grow(n)
            # all of a layer's records at once: the header checksums (_crc over the fields is one
            # crc32 over their run of bytes), positions, spans and summaries, as a read does (load)
            ok = (recs["magic"] == MAGIC) & (recs["seq"] < self.seq)
            if n:
                raw = recs.view(np.uint8).reshape(n, -1)
                cand = np.flatnonzero(ok)
                crc = np.fromiter((zlib.crc32(raw[j, self._meta_run]) for j in cand), np.uint32, len(cand))
                bad = cand[crc != recs["crc_meta"][cand]]
                self.corrupt += len(bad)
                ok[bad] = False
            ok[_copies(recs["seq"], ok)] = False   # an interrupted compaction's copies: tombstoned below
            slots = np.flatnonzero(ok)
            pos = self.map_positions(recs["positions"][slots], recs["seq"][slots][:, None, None])
            gone = (pos < 0).all(axis=(1, 2))   # every token cut (a store whose cut's tombstones did not land)
            ok[slots[gone]] = False
            slots, pos = slots[~gone], pos[~gone]
            if len(slots):
                L.put_summaries(slots, recs[slots])
                L.live[slots], L.value[slots], L.seq[slots] = True, recs["value"][slots], recs["seq"][slots]
                L.span[slots] = page_span(pos)
            L.free = sorted((int(s) for s in np.flatnonzero(~L.live[: len(L.live)])), reverse=True)
            # records written after the state (a turn that never committed, or a parent's appends a fork copied)
            # are tombstoned, or a later state's larger sequence number would take them for valid; and the file's
            # tail past its last live record (what a turn a crash cut short wrote: a long document's reading may
            # leave gigabytes no count sees) is cut off. A checkpoint taken after this state (a document's, just
            # before its turn's save, which a crash or a full disk kept from committing) links the file and
            # holds those records live: the store takes its own copy first, the checkpoint keeps the file.
            dead = np.flatnonzero((recs["magic"][:n] == MAGIC) & ~L.live[:n])
            live = np.flatnonzero(L.live[:n])
            end = int(live[-1]) + 1 if len(live) else 0
            st = os.fstat(self._fds[i])
            if (len(dead) or st.st_size > end * self.record_bytes) and st.st_nlink > 1:
                self._own(i)
            if st.st_size > end * self.record_bytes:
                os.ftruncate(self._fds[i], end * self.record_bytes)
            for slot in dead[dead < end]:
                os.pwrite(self._fds[i], np.zeros(4, np.uint8).tobytes(), int(slot) * self.record_bytes)
        if self.corrupt:
            log.warning("page store %s: %d records failed their check on open; tombstoned", self.root, self.corrupt)
        for i, L in enumerate(self.layers):
            L.tail_pos, L.tail_k, L.tail_v = (tails[f"{i}.pos"].astype(np.int64), tails[f"{i}.k"].astype(np.float32),
                                              tails[f"{i}.v"].astype(np.float32))
            L.tail_value = tails[f"{i}.value"].astype(np.float32)
        self.version = state if isinstance(state, int) else None
        if isinstance(state, int):
            self.committed(state)


def newest_state(root: Path) -> Union[int, str, None]:
    """The newest state version in `root`; META for a store written before versions; None: none."""
    versions = state_versions(root)
    if versions:
        return max(versions)
    return META if (Path(root) / META).exists() else None


def state_versions(root: Path) -> list[int]:
    try:
        return [int(m.group(1)) for f in os.listdir(root) if (m := STATE.fullmatch(f))]
    except OSError:
        return []


def read_state(root: Path, state: Union[int, str]) -> tuple[dict, dict]:
    """(meta, tails) of state `state` in `root` (META: the unversioned layout). Raises
    CorruptPageState when it is missing or unreadable (a zip member's CRC is checked on read)."""
    root = Path(root)
    try:
        if state == META:
            meta = json.loads((root / META).read_text())
            with np.load(root / TAIL) as z:
                tails = {k: z[k] for k in z.files}
        else:
            with np.load(root / state_name(int(state))) as z:
                tails = {k: z[k] for k in z.files}
            meta = json.loads(tails.pop("meta").tobytes().decode())
        if not isinstance(meta, dict) or not isinstance(meta.get("geometry"), dict):
            raise ValueError("no geometry")
        for key in ("seq", "dropped", "written"):
            int(meta[key])
        return meta, tails
    except CorruptPageState:
        raise
    except Exception as e:   # missing, truncated, bit rot: whatever the bytes make numpy or zip raise
        raise CorruptPageState(f"page store state {state} in {root}: {type(e).__name__}: {e}") from e


def _write_state(path: Path, meta: dict, tails: dict) -> None:
    blob = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    _atomic(path, lambda f: np.savez(f, meta=blob, **tails))


def _remove_states(root: Path, keep: Optional[int] = None) -> None:
    """Remove the state files in `root` but version `keep`, and leftovers of interrupted writes."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for f in names:
        m = STATE.fullmatch(f)
        if (m is not None and int(m.group(1)) != keep) or f.endswith((".tmp", ".own")) or f in (META, TAIL):
            (Path(root) / f).unlink(missing_ok=True)


def prune_store(root: Path, keep: Optional[int]) -> None:
    """At startup, for a store whose session committed state `keep` (None: no saved turn): the
    other states go (a newer one was never committed); with none, the whole store goes."""
    root = Path(root)
    if keep is None or not (root / state_name(keep)).exists():
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
        return   # a missing state: opening it rebuilds the session (or a store older than versions)
    _remove_states(root, keep=keep)


def compact_store(root: Path, drop_bytes: int, state: Union[int, str, None] = LATEST) -> tuple[int, int]:
    """A closed (not open anywhere) store's lowest-value pages, at least `drop_bytes` of them, removed, and each layer
    file compacted in place to its valid records (what a reopen keeps), so the space comes back
    without the directory ever holding more than it did (--disk-total: a rewrite beside the old
    file would double it for a moment). A layer file other links share (a checkpoint's) is left as
    it is: compacting it would free nothing. `state`: the version in force (its session's
    committed one; None: no saved turn). Returns (pages dropped, bytes freed)."""
    root = Path(root)
    if state == LATEST:
        state = newest_state(root)
    elif state is not None and not (root / state_name(state)).exists() and newest_state(root) == META:
        state = META   # a heap file older than versioned states
    if state is None:   # never checkpointed: a reopen keeps nothing of it
        freed = sum(f.stat().st_size for f in root.glob("layer*.pages"))
        for f in root.glob("layer*.pages"):
            os.truncate(f, 0)
        return 0, freed
    meta, tails = read_state(root, state)
    g = PageGeometry(**meta["geometry"])
    dtype = record_dtype(g)
    files = [root / f"layer{i:03d}.pages" for i in range(g.n_layers)]
    recs, valid = [], []
    for f in files:
        n = f.stat().st_size // dtype.itemsize if f.exists() else 0
        r = np.memmap(f, dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
        ok = (r["magic"] == MAGIC) & (r["seq"] < meta["seq"])
        for i in np.flatnonzero(ok):
            ok[i] = _crc(r[i], _META_FIELDS) == r[i]["crc_meta"]
        ok[_copies(r["seq"], ok)] = False
        recs.append(r)
        valid.append(ok)
    shared = [f.exists() and f.stat().st_nlink > 1 for f in files]
    cands = [(i, j) for i, ok in enumerate(valid) if not shared[i] for j in np.flatnonzero(ok)]
    values = np.array([recs[i][j]["value"] for i, j in cands], np.float32)
    dropped = 0
    drop = -(-max(0, drop_bytes) // dtype.itemsize)
    for c in np.argsort(values, kind="stable")[:drop]:
        i, j = cands[c]
        valid[i][j] = False
        dropped += 1
    if dropped:   # counted before any file loses them: a compaction cut short by a kill still counts them
        meta["dropped"] += dropped
        meta["reclaimed"] = meta.get("reclaimed", 0) + dropped
        if state == META:
            _atomic(root / META, lambda out: out.write(json.dumps(meta).encode()))
        else:
            _write_state(root / state_name(state), meta, tails)
    freed = 0
    for f, r, ok, linked in zip(files, recs, valid, shared):
        if linked or ok.all():
            continue
        before = f.stat().st_size
        _compact_file(f, r, ok)
        freed += before - f.stat().st_size
    del recs
    return dropped, freed


def link_tree(src: Path, dst: Path, state: Union[int, str, None] = None) -> None:
    """A checkpoint of the store in `src` (checkpointed just before) as hard links in `dst`
    (`state`: only that state file goes with it; None: every one)."""
    _tree(src, dst, os.link, state)


def copy_tree(src: Path, dst: Path, state: Union[int, str, None] = None) -> None:
    """The store in `src` copied to `dst` (replacing it), for a fork to open and write: cloned
    where the filesystem can (APFS, btrfs, XFS: no bytes copied until either side writes)."""
    _tree(src, dst, clone_file, state)


FICLONE = 0x40049409   # Linux ioctl: dst shares src's extents, copy-on-write


def clone_file(src: Path, dst: Path) -> None:
    """Copy `src` to `dst`, as a copy-on-write clone where the filesystem supports one."""
    if sys.platform == "darwin" and _clonefile(src, dst):
        return
    if sys.platform.startswith("linux"):
        with open(src, "rb") as fs, write_private(dst) as fd:
            try:
                fcntl.ioctl(fd.fileno(), FICLONE, fs.fileno())
                return
            except OSError:   # ext4, tmpfs, ...: a plain copy below
                pass
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o600)


def _clonefile(src: Path, dst: Path) -> bool:
    """macOS clonefile(2) (APFS); False where it is refused (another filesystem, or no libc)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.clonefile(os.fsencode(src), os.fsencode(dst), 0) == 0
    except (OSError, AttributeError):
        return False


def _tree(src: Path, dst: Path, put, state: Union[int, str, None] = None) -> None:
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    private_dir(dst)
    states = {META, TAIL} if state in (None, META, LATEST) else set()
    states |= {f.name for f in src.iterdir() if STATE.fullmatch(f.name)} if state in (None, LATEST) else set()
    if isinstance(state, int):
        states.add(state_name(state))
    for f in src.iterdir():
        if f.name in states or f.suffix == ".pages":
            try:
                put(f, dst / f.name)
            except OSError:   # a filesystem without hard links
                shutil.copyfile(f, dst / f.name)
                os.chmod(dst / f.name, 0o600)


def _close_all(fds: list) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


def _copies(seq: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Slots of valid records whose sequence number a later slot's valid record also holds: the
    copies an interrupted compaction left (_compact_file). The later one, never written to, stays."""
    slots = np.flatnonzero(ok)
    _, from_end = np.unique(seq[slots][::-1], return_index=True)   # each number's last slot, counted from the end
    return np.setdiff1d(slots, slots[len(slots) - 1 - from_end])


def _compact_file(path: Path, recs: np.ndarray, ok: np.ndarray) -> None:
    """Compact a layer file in place to its `ok` records: each one past the first ok.sum() slots
    is copied into a free slot below, then the file is cut there. A crash before the cut leaves
    the moved records twice, both valid and with the same sequence number: a reopen keeps the
    later one (_copies), so nothing is lost and nothing counts twice; the file never grows."""
    n = int(ok.sum())
    holes, movers = np.flatnonzero(~ok[:n]), np.flatnonzero(ok[n:]) + n
    assert len(holes) == len(movers)
    size = recs.dtype.itemsize
    fd = os.open(path, os.O_RDWR)
    try:
        for hole, mover in zip(holes, movers):
            os.pwrite(fd, recs[mover: mover + 1].tobytes(), int(hole) * size)
        os.fsync(fd)   # the copies durable before the originals go
        os.ftruncate(fd, n * size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with write_private(tmp) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)   # the rename itself durable (a power loss, not only kill -9)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
