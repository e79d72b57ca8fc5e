"""Which pages a question recalls: score every page's summary against the question's queries.

Numpy only. Queries and summaries are pre-RoPE (position-free), so a page scores by
content wherever its tokens sat. Quest's bound: for one query q and a page whose keys
lie in the box [kmin, kmax] (element-wise), q.k <= sum_d max(q_d kmin_d, q_d kmax_d)
= q+ . kmax + q- . kmin; the mean-key alternative scores q . kmean. A page's score is
the best over the question's queries (any query head of the KV head's group).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

SUMMARIES = ("minmax", "mean")
WINDOW = 16      # span recall: tokens per vote bin; a chosen bin is recalled with WINDOW // 2 on each side
VOTERS = 32      # span recall: each layer's and KV head's best pages that vote


def score_pages(queries: np.ndarray, summary: tuple[np.ndarray, ...], how: str = "bound") -> np.ndarray:
    """queries: [H, Q, D] (the G query heads of KV head h stacked in Q); summary: (kmin, kmax)
    or (kmean,), each [N, H, D]. Returns [H, N]: each page's best score over the queries.

    how="zscore": each query's scores are first standardized over the pages (minus their mean,
    over their deviation), so a query that scores every page alike (a question's template words)
    cannot outrank one that singles a page out (the name asked about)."""
    q = queries.astype(np.float32)
    if len(summary) == 2:
        kmin, kmax = summary
        bound = (np.einsum("hqd,nhd->hqn", np.maximum(q, 0), kmax)
                 + np.einsum("hqd,nhd->hqn", np.minimum(q, 0), kmin))
    else:
        bound = np.einsum("hqd,nhd->hqn", q, summary[0])
    if not bound.shape[2]:
        return np.zeros((q.shape[0], 0), np.float32)
    if how == "zscore":
        bound = (bound - bound.mean(axis=2, keepdims=True)) / (bound.std(axis=2, keepdims=True) + 1e-6)
    return bound.max(axis=1)


def best_first(scores: np.ndarray, k: int) -> np.ndarray:
    """np.argsort(-scores, axis=-1, kind="stable")[..., :k] (best first, ties to the lower index),
    without sorting all N: the k-th best by a partition, then a stable sort of the candidates at
    least as good, which hold the first k in the same relative order. scores: [..., N]."""
    keys = -scores
    N = keys.shape[-1]
    if k >= N or k <= 0 or np.isnan(keys).any():
        return np.argsort(keys, axis=-1, kind="stable")[..., :k]
    kth = np.partition(keys, k - 1, axis=-1)[..., k - 1: k]
    out = np.empty((*keys.shape[:-1], k), np.int64)
    for row in np.ndindex(*keys.shape[:-1]):
        cand = np.flatnonzero(keys[row] <= kth[row])
        out[row] = cand[np.argsort(keys[row][cand], kind="stable")[:k]]
    return out


def select_pages(scores: np.ndarray, n_pages: int) -> np.ndarray:
    """scores: [H, N] -> indices [H, k] (k = min(n_pages, N)) of each head's best pages,
    ascending; ties go to the older page."""
    H, N = scores.shape
    k = min(n_pages, N)
    return np.sort(best_first(scores, k), axis=1)


def vote(scores: dict, read_positions: Callable, n_bins: int, bin_size: int = WINDOW,
         voters: int = VOTERS) -> np.ndarray:
    """Span recall, step one: where in the document the question points, by every layer and head.
    scores: {layer: [H, N]} page scores (z-scores: comparable across heads); read_positions(layer,
    idx) -> [n, H, P] token positions of those pages (-1 unknown). Each (layer, head)'s best
    `voters` pages give their positive score to the bins of `bin_size` tokens their tokens sit in
    (shared by the page's tokens). Returns votes [n_bins]."""
    votes = np.zeros(n_bins)
    for layer, z in scores.items():
        H, N = z.shape
        top = best_first(z, voters)                                        # [H, C]
        uniq, inv = np.unique(top, return_inverse=True)
        pos = read_positions(layer, uniq)                                  # [u, H, P]
        inv = inv.reshape(top.shape)
        C = top.shape[1]
        mine = pos[inv, np.arange(H)[:, None]]                             # [H, C, P]: each voter's page, its head's tokens
        weight = np.maximum(np.take_along_axis(z, top, axis=1).astype(np.float64), 0.0)   # [H, C]
        valid = mine >= 0
        if valid.any() and int(mine[valid].max()) // bin_size >= n_bins:
            raise IndexError(f"a page position past the {n_bins} vote bins")
        voter = np.broadcast_to(np.arange(H * C).reshape(H, C, 1), mine.shape)[valid]
        # (voter, bin) pairs sorted voter-major, bins ascending: the order the per-voter loop added them
        pair, cnt = np.unique(voter * n_bins + mine[valid] // bin_size, return_counts=True)
        who, b = pair // n_bins, pair % n_bins
        total = np.bincount(voter, minlength=H * C)
        np.add.at(votes, b, weight.reshape(-1)[who] * cnt / total[who])   # one by one, in order: the same sums
    return votes


def vote_order(votes: np.ndarray) -> np.ndarray:
    """np.argsort(-votes, kind="stable") for votes >= 0 (vote's): the bins with a vote, best first,
    then the bins without one in order, with one sort of the few that have a vote."""
    if np.isnan(votes).any():
        return np.argsort(-votes, kind="stable")
    voted = np.flatnonzero(votes > 0)
    return np.concatenate([voted[np.argsort(-votes[voted], kind="stable")], np.flatnonzero(votes <= 0)])


def pages_meeting(first: np.ndarray, last: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Indices (ascending) of the pages whose span [first, last] meets one of the windows
    [lo, hi): the windows merged into disjoint runs, then one search per page (a page meets the
    union iff the first run ending after its first position starts at or before its last)."""
    if not len(lo):
        return np.zeros(0, np.int64)
    srt = np.argsort(lo, kind="stable")
    lo, hi = lo[srt], np.maximum.accumulate(hi[srt])
    new = np.concatenate([[True], lo[1:] > hi[:-1]])                   # a gap before this window
    starts = lo[new]
    ends = np.concatenate([hi[np.flatnonzero(new)[1:] - 1], hi[-1:]])  # each run's end
    run = np.searchsorted(ends, first, side="right")                   # first run with end > first
    meets = run < len(ends)
    meets[meets] = starts[run[meets]] <= last[meets]
    return np.flatnonzero(meets)


def window_batch(want: int, bin_size: int = WINDOW) -> int:
    """Bins take_windows considers at once: enough windows for about twice `want` tokens."""
    return max(8, 2 * want // (2 * bin_size))


def take_windows(order: np.ndarray, want: int, spans: np.ndarray, read_positions: Callable,
                 tail_pos: np.ndarray, bin_size: int = WINDOW) -> list[tuple[np.ndarray, np.ndarray]]:
    """Span recall, step two, for one layer: walk the bins in `order` (best first) and take, per
    KV head, the evicted tokens inside each bin's window ([bin - margin, bin end + margin),
    margin = bin_size // 2; in position order) until the head has `want`. spans [N, H, 2] (first,
    last position of each live page, in RAM), read_positions(idx) -> [n, H, P] (asked only for
    pages whose span meets a window, batch after batch: memoize it, as paging.positions_reader
    does), tail_pos [H, t] (the partial page).
    Returns per head the taken tokens as (page indices, -1 for the tail; offsets), in rank order.
    A batch of windows at once: each token goes to the best-ranked window holding it (a token sits
    in at most three windows), each position once and none taken in an earlier batch; the tokens
    then in (window rank, position) order, which is the order walking the windows one by one takes."""
    H = spans.shape[1]
    margin = bin_size // 2
    srcs: list[list] = [[] for _ in range(H)]
    offs: list[list] = [[] for _ in range(H)]
    counts = [0] * H
    seen = [np.zeros(0, bool) for _ in range(H)]   # per head: positions taken (a bitmap, grown as needed)
    rank = np.full(int(order.max()) + 1 if len(order) else 0, np.iinfo(np.int64).max, np.int64)
    step = window_batch(want, bin_size)
    at = 0
    while at < len(order) and min(counts) < want:
        batch = order[at: at + step]
        at += step
        lo, hi = batch * bin_size - margin, (batch + 1) * bin_size + margin
        rank[batch] = np.arange(at - step, at - step + len(batch))
        # the pages where some head's own span meets a window (only those hold a window's token)
        cand = np.unique(np.concatenate([pages_meeting(spans[:, h, 0], spans[:, h, 1], lo, hi) for h in range(H)]))
        pages = read_positions(cand)                                        # [c, H, P]
        P = pages.shape[2]
        for h in range(H):
            if counts[h] >= want:
                continue
            # this batch's candidate tokens of head h, by position: (position, page or -1, offset)
            t = tail_pos[h]
            pos = np.concatenate([pages[:, h].reshape(-1), t])
            src = np.concatenate([np.repeat(cand, P), np.full(len(t), -1)])
            off = np.concatenate([np.tile(np.arange(P), len(cand)), np.arange(len(t))])
            srt = np.argsort(pos, kind="stable")
            pos, src, off = pos[srt], src[srt], off[srt]
            if len(pos) and pos[-1] >= len(seen[h]):
                seen[h] = np.concatenate([seen[h], np.zeros(int(pos[-1]) + 1 - len(seen[h]), bool)])
            best = np.full(len(pos), np.iinfo(np.int64).max, np.int64)   # the best window rank holding each token
            top = (pos + margin) // bin_size
            for b in (top, top - 1, top - 2):
                inside = (b >= 0) & (b < len(rank)) & (b * bin_size - margin <= pos) & (pos < (b + 1) * bin_size + margin)
                best[inside] = np.minimum(best[inside], rank[b[inside]])
            new = (pos >= 0) & (best < at)   # in one of this batch's windows (or an earlier one: seen)
            new[1:] &= pos[1:] != pos[:-1]   # each position once
            new[new] &= ~seen[h][pos[new]]
            sel = np.flatnonzero(new)
            sel = sel[np.argsort(best[sel], kind="stable")]   # by window rank, then position
            seen[h][pos[sel]] = True
            srcs[h].append(src[sel])
            offs[h].append(off[sel])
            counts[h] += len(sel)
    empty = np.zeros(0, np.int64)
    return [(np.concatenate(srcs[h])[:want] if srcs[h] else empty, np.concatenate(offs[h])[:want] if offs[h] else empty)
            for h in range(H)]


class PageWriter:
    """One background thread that runs page-out jobs in order; `drain()` waits for them.

    The engine thread hands over host arrays (one transfer per eviction event) and goes
    on; the writes, summaries and disk-budget drops happen here. A job's error is kept
    and raised at the next `drain()`, on the engine thread. The thread ends after IDLE_S
    without work, at `close()`, and at interpreter exit (joined: a daemon thread still
    waiting when the interpreter finalizes is killed inside the runtime).

    While its session decodes in the engine's batch on a CPU (`between_steps`), a page-out is
    queued as parts instead, a layer each, and the engine thread runs them between its steps
    (`run_parts`, a slice a step): on cores the batch keeps busy, the writer's work beside the
    steps stalled them as much as the same work inside one step (docs/serve_bench.md, "Ninth
    round"). Jobs and parts run one at a time, in the order they were queued.
    """

    IDLE_S = 5.0
    MAX_QUEUED = 4   # jobs waiting behind the running one before submit waits

    def __init__(self):
        self._jobs: deque[Callable[[], None]] = deque()
        # between_steps: the session decodes in the engine's batch on a CPU, and its page-outs are
        # left as parts (a layer each) that the engine thread runs between its steps (run_parts)
        self.between_steps = False
        self._parts: deque[Callable[[], None]] = deque()
        self._fresh = False   # parts queued since fresh_parts() last looked
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._ending: Optional[threading.Thread] = None   # the last thread that ended idle
        _WRITERS.add(self)

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the queued jobs and parts and end the thread (joined; a later submit starts a new one)."""
        self.release_parts()
        with self._cv:
            self._closed = True
            thread = self._thread or self._ending
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._cv:
            self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; with MAX_QUEUED jobs already waiting, first wait until one has run: the
        engine thread then lends its core to the writer, which runs at a low priority (a long
        document read, all cores busy, must not pile its evicted K/V up in RAM behind it)."""
        with self._cv:
            while len(self._jobs) >= self.MAX_QUEUED and self._thread is not None and self._thread.is_alive():
                self._cv.wait()
            self._queue_parts()   # parts queued before this job run before it
            self._jobs.append(job)
            self._start()

    def _start(self) -> None:   # holding self._cv: a thread for the queued jobs
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="localheap-pages", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def submit_parts(self, parts: list[Callable[[], None]]) -> None:
        """Queue one page-out as parts, in order, for run_parts (between the engine's steps) or drain."""
        with self._cv:
            self._parts.extend(parts)
            self._fresh = True

    def fresh_parts(self) -> bool:
        """Whether a page-out was queued as parts since the last call (the engine's step that just
        ran had this session's eviction event)."""
        fresh, self._fresh = self._fresh, False
        return fresh

    def run_parts(self, until: float = float("inf")) -> None:
        """Run queued parts on the calling thread (the engine's, after a decode step): at least one,
        then more while time.monotonic() < `until`. None while a job of the thread's waits or runs
        (the order stays the order they were queued in). A part's error is kept for drain()."""
        while self._parts:   # (read unlocked: none queued is the common case, after every step)
            with self._cv:
                if not self._parts or self._jobs or self._busy:
                    return
                part = self._parts.popleft()
                self._busy = True
            self._execute(part)
            if time.monotonic() >= until:
                return

    def _execute(self, work: Callable[[], None]) -> None:
        """A job or part popped with _busy set: run it; its error is kept for drain()."""
        try:
            work()
        except BaseException as e:   # noqa: BLE001 - handed to the engine thread at drain()
            with self._cv:
                self._error = self._error or e
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def release_parts(self) -> None:
        """The session left the batch: the parts still queued go to the thread, as one job."""
        with self._cv:
            self.between_steps = False
            if self._parts:
                self._queue_parts()
                self._start()

    def _queue_parts(self) -> None:   # holding self._cv
        if self._parts:
            parts = list(self._parts)
            self._parts.clear()

            def job() -> None:
                for part in parts:
                    part()

            self._jobs.append(job)

    def drain(self) -> None:
        """Wait for every job and part queued (the parts run here); a job's or part's error is raised."""
        while True:
            with self._cv:
                while self._jobs or self._busy:
                    self._cv.wait()
                if not self._parts:
                    err, self._error = self._error, None
                    break
            self.run_parts()
        if err is not None:
            raise err

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cv:
                while not self._jobs:
                    if self._closed or (not self._cv.wait(timeout=self.IDLE_S) and not self._jobs):
                        self._thread = None   # idle or closed: exit; the next submit starts a new thread
                        self._ending = threading.current_thread()   # (close joins it: it may still be ending)
                        return
                job = self._jobs.popleft()
                self._busy = True
            self._execute(job)
            del job   # what it holds (K/V, torch tensors) freed now, not when the thread ends: a
            # tensor's free takes the GIL again, and in an interpreter finalizing, a daemon thread
            # that asks for it is ended inside torch's C++ code, which aborts the process


_WRITERS: "weakref.WeakSet[PageWriter]" = weakref.WeakSet()

# threads that build an eviction event's pages, a layer each (PageStore.append_many), shared by every
# session's writer; LOCALHEAP_PAGE_BUILDERS sets how many (1: none, the writer builds them itself)
PAGE_BUILDERS = int(os.environ.get("LOCALHEAP_PAGE_BUILDERS", "0")) or min(8, os.cpu_count() or 1)
_builders: Optional[ThreadPoolExecutor] = None
_builders_lock = threading.Lock()


def page_builders() -> Optional[ThreadPoolExecutor]:
    """The process's page-building threads (at the writer's low priority), started on first use;
    None where PAGE_BUILDERS is 1."""
    global _builders
    if PAGE_BUILDERS <= 1:
        return None
    with _builders_lock:
        if _builders is None:
            _builders = ThreadPoolExecutor(PAGE_BUILDERS, thread_name_prefix="localheap-page-build",
                                           initializer=_lower_priority)
        return _builders

WRITER_NICE = int(os.environ.get("LOCALHEAP_WRITER_NICE", "19"))


def _lower_priority() -> None:
    """Linux: the calling thread's nice value raised by WRITER_NICE (19, the lowest priority, by
    default; `LOCALHEAP_WRITER_NICE` sets it, 0 leaves it). The writer then takes a core when the
    engine's threads leave one free, instead of halving the decode steps beside an eviction on a
    machine whose cores the engine uses (docs/serve_bench.md, "Sixth round"). It cannot starve a
    drain: the engine thread waiting on one leaves its core to the writer. Elsewhere (macOS) the
    thread keeps the process's priority."""
    if WRITER_NICE and sys.platform.startswith("linux"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
        except OSError:
            pass


@atexit.register
def _close_writers(timeout: float = 10.0) -> None:
    """Before the interpreter finalizes: every page thread finished and joined (at most `timeout`
    seconds in all: a stuck disk must not hold the exit for ever)."""
    deadline = time.monotonic() + timeout
    for writer in list(_WRITERS):
        writer.close(timeout=max(0.0, deadline - time.monotonic()))
