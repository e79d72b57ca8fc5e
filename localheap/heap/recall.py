"""Which pages a question recalls: score every page's summary against the question's queries.

Numpy only. Queries and summaries are pre-RoPE (position-free), so a page scores by
content wherever its tokens sat. Quest's bound: for one query q and a page whose keys
lie in the box [kmin, kmax] (element-wise), q.k <= sum_d max(q_d kmin_d, q_d kmax_d)
= q+ . kmax + q- . kmin; the mean-key alternative scores q . kmean. A page's score is
the best over the question's queries (any query head of the KV head's group).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional

import numpy as np

SUMMARIES = ("minmax", "mean")


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


def select_pages(scores: np.ndarray, n_pages: int) -> np.ndarray:
    """scores: [H, N] -> indices [H, k] (k = min(n_pages, N)) of each head's best pages,
    ascending; ties go to the older page."""
    H, N = scores.shape
    k = min(n_pages, N)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.sort(order, axis=1)


class PageWriter:
    """One background thread that runs page-out jobs in order; `drain()` waits for them.

    The engine thread hands over host arrays (one transfer per eviction event) and goes
    on; the writes, summaries and disk-budget drops happen here. A job's error is kept
    and raised at the next `drain()`, on the engine thread.
    """

    def __init__(self):
        self._jobs: deque[Callable[[], None]] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._jobs.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="localheap-pages", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def drain(self) -> None:
        with self._cv:
            while self._jobs or self._busy:
                self._cv.wait()
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    if not self._cv.wait(timeout=5.0) and not self._jobs:
                        self._thread = None   # idle: exit; the next submit starts a new thread
                        return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except BaseException as e:   # noqa: BLE001 - handed to the engine thread at drain()
                with self._cv:
                    self._error = self._error or e
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
