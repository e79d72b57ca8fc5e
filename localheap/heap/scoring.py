"""Page scores from summaries kept dimension-major, in the exact arithmetic of recall.score_pages.

score_pages (the reference) multiplies the queries [H, Q, D] into C-contiguous summaries
[N, H, D] with np.einsum. Numpy runs that einsum as one small dot product per output: its
`float_sum_of_products_contig_contig_outstride0_two` loop with 4 SIMD lanes (npyv: SSE on x86,
NEON on Arm), lane l accumulating the products of dims 16j+12+l, 16j+8+l, 16j+4+l, 16j+l for
each block j of 16 dims, then the dims left over 4 at a time, each step a multiply-add; then
(lane 0 + lane 1) + (lane 2 + lane 3). About 60 cycles per output, most of them waiting on the
chain of adds.

This kernel computes the same numbers per page, many pages at a time: summaries stored [H, D, N]
(dims in lane order), one einsum per lane with the pages innermost, whose loop
(`sum_of_products_stride0_contig_outcontig_two`) is the same npyv multiply-add applied to rows,
in the lane's own order, then the same two-level sum of the lanes. The z-score's mean and std
are numpy's own calls on rows of that bound (the reference's einsum output is C-contiguous
[H, Q, N] but for one query over several heads, which goes to the reference; a reduction along a
contiguous row gives the same bits whatever the rows around it), and the best over the queries is
a maximum, exact in any order. So every score equals score_pages' bit for bit; `lanes_exact` checks that on this numpy
build once per head size (a build whose einsum loops differ falls back to the reference), and
tests/test_page_scoring.py holds it on stores of real sizes.

A backend may register a compiled scorer of the same arithmetic (`use_native`; the torch backend's
CPU module, backends/torch/slab_cpu.page_bounds: AVX2 without fused multiply-adds, 16 pages a block
in registers, the heads and blocks over the threads). It scores once it gave score_pages' bits on the
same check (`native_exact`), and numpy scores wherever it is not built or disagrees.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import numpy as np

from .recall import score_pages

log = logging.getLogger("localheap.pages")
LANES = 4          # npyv float32 lanes of numpy's baseline SIMD (SSE / NEON): what the einsum loop uses
QUERY_BLOCK = 8    # queries scored at once (their [block, N] bounds stay in the CPU's cache)
PAGE_CHUNK = 4096  # pages per lane einsum (a lane's row of the block stays in L1)


@functools.lru_cache(maxsize=None)
def lane_order(head_dim: int) -> np.ndarray:
    """The dims in the order score_pages' einsum accumulates them: lane 0's, then lane 1's, ...
    Returns [D] (a permutation); `lane_bounds(D)` cuts it into the lanes."""
    full = head_dim // (4 * LANES) * (4 * LANES)
    order = []
    for lane in range(LANES):
        order += [16 * j + 4 * i + lane for j in range(head_dim // 16) for i in (3, 2, 1, 0)]
        order += list(range(full + lane, head_dim, LANES))
    return np.array(order, np.int64)


@functools.lru_cache(maxsize=None)
def lane_bounds(head_dim: int) -> tuple[int, ...]:
    """Where each lane's dims start and end in lane_order(head_dim): LANES + 1 offsets."""
    full = head_dim // (4 * LANES) * (4 * LANES)
    sizes = [full // LANES + len(range(full + lane, head_dim, LANES)) for lane in range(LANES)]
    return tuple(int(x) for x in np.cumsum([0] + sizes))


def _lane_dots(q: np.ndarray, k: np.ndarray, out: np.ndarray, lanes: np.ndarray, chunk: int) -> None:
    """out [w, N] = einsum('qd,nd->qn') of q [w, D] and k [D, N], both with dims in lane order,
    as score_pages' einsum rounds it, `chunk` pages at a time. lanes: scratch [LANES, >= w, >= min(N, chunk)]."""
    cut = lane_bounds(q.shape[1])
    w, N = out.shape
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        acc = lanes[:, :w, : e - s]
        for lane in range(LANES):
            a, b = cut[lane], cut[lane + 1]
            np.einsum("qd,dn->qn", q[:, a:b], k[a:b, s:e], out=acc[lane])
        o = out[:, s:e]
        np.add(acc[0], acc[1], out=o)
        np.add(acc[2], acc[3], out=acc[2])
        np.add(o, acc[2], out=o)


def _scores_lanes(q: np.ndarray, summary_t: tuple[np.ndarray, ...], how: str, chunk: int = PAGE_CHUNK) -> np.ndarray:
    """The kernel: q [H, Q, D] float32, summary_t (kmin, kmax) or (kmean,), each [H, D, N]
    float32 with dims in lane order. Returns [H, N] (score_pages' numbers)."""
    H, Q, D = q.shape
    N = summary_t[0].shape[2]
    perm = lane_order(D)
    if len(summary_t) == 2:
        parts = [(np.maximum(q, 0)[..., perm], summary_t[1]), (np.minimum(q, 0)[..., perm], summary_t[0])]
    else:
        parts = [(q[..., perm], summary_t[0])]
    best = np.empty((H, N), np.float32)
    w0 = min(QUERY_BLOCK, Q)
    bound, other = np.empty((w0, N), np.float32), np.empty((w0, N), np.float32)
    lanes = np.empty((LANES, w0, min(N, chunk)), np.float32)
    for h in range(H):
        for s in range(0, Q, QUERY_BLOCK):
            e = min(Q, s + QUERY_BLOCK)
            b = bound[: e - s]
            for i, (qs, k) in enumerate(parts):
                _lane_dots(qs[h, s:e], k[h], b if i == 0 else other[: e - s], lanes, chunk)
            if len(parts) == 2:
                np.add(b, other[: e - s], out=b)             # q+ . kmax + q- . kmin
            if how == "zscore":
                mean = b.mean(axis=1, keepdims=True)
                std = b.std(axis=1, keepdims=True, mean=mean)  # numpy computes the same mean inside
                np.subtract(b, mean, out=b)
                np.divide(b, std + 1e-6, out=b)
            if s == 0:
                np.max(b, axis=0, out=best[h])
            else:
                np.maximum(best[h], b.max(axis=0), out=best[h])
    return best


def _agrees(head_dim: int, scorer: Callable, halves: bool = False) -> Optional[bool]:
    """Whether scorer(q, summary_t, how, chunk) gives score_pages' bits for this head size, checked
    on random queries and summaries (zeros and both signs; a query block and a page chunk left over;
    both summaries and both scores; rows longer than numpy's reduction buffer). None: the scorer
    had no answer (a native kernel not built yet)."""
    rng = np.random.default_rng(head_dim)
    for H, Q, N, chunk, cases in ((2, QUERY_BLOCK + 1, 300, 128, (("minmax", "zscore"), ("minmax", "bound"),
                                                                    ("mean", "bound"))),
                                  (1, 2, 8192 + 37, PAGE_CHUNK, (("minmax", "zscore"),))):
        q = rng.standard_normal((H, Q, head_dim)).astype(np.float32)
        q[rng.random(q.shape) < 0.1] = 0
        kmin = rng.standard_normal((N, H, head_dim)).astype(np.float16).astype(np.float32)
        kmax = (kmin + np.abs(rng.standard_normal((N, H, head_dim)))).astype(np.float16).astype(np.float32)   # as stored
        for summary, how in cases:
            summary = (kmin, kmax) if summary == "minmax" else (kmin,)
            by_dim = tuple(np.ascontiguousarray(s.transpose(1, 2, 0)[:, lane_order(head_dim)]) for s in summary)
            want = score_pages(q, summary, how)
            for given in (by_dim, tuple(a.astype(np.float16) for a in by_dim)) if halves else (by_dim,):
                got = scorer(q, given, how, chunk)   # halves: the same summaries as the store keeps them too
                if got is None:
                    return None
                if not np.array_equal(want, got):
                    return False
    return True


@functools.lru_cache(maxsize=None)
def lanes_exact(head_dim: int) -> bool:
    """Whether the kernel gives score_pages' bits on this numpy build for this head size (_agrees)."""
    if not _agrees(head_dim, _scores_lanes):
        log.warning("page scoring: this numpy's einsum rounds differently from the lane kernel "
                    "(head_dim %d); scoring pages with the reference einsum", head_dim)
        return False
    return True


# A compiled scorer of _scores_lanes' arithmetic, registered by a backend that has one (the torch
# backend's CPU module, backends/torch/slab_cpu.bounds_pages): (qs, ks, lane cuts) -> the bounds
# [H, Q, N], None while it is not built. It answers for a head size once it gave score_pages' bits.
_NATIVE: Optional[Callable] = None
_native_ready: Callable[[], Optional[bool]] = lambda: True   # True: built, None: building, False: never here
_native_verdicts: dict[int, bool] = {}


def use_native(kernel: Optional[Callable], ready: Optional[Callable[[], Optional[bool]]] = None) -> None:
    """Register a compiled scorer (None: none); `ready()` says whether it is built (True), still
    building (None) or cannot be here (False)."""
    global _NATIVE, _native_ready
    _NATIVE = kernel
    _native_ready = ready or (lambda: True)
    _native_verdicts.clear()


def _scores_native(q: np.ndarray, summary_t: tuple[np.ndarray, ...], how: str, chunk: int = 0) -> Optional[np.ndarray]:
    """_scores_lanes' numbers with the bounds from the native kernel (all heads and queries in one
    call, the threads sharing them), the z-score and the best over the queries in numpy as there."""
    D = q.shape[2]
    perm = lane_order(D)
    if len(summary_t) == 2:
        qs, ks = [np.maximum(q, 0)[..., perm], np.minimum(q, 0)[..., perm]], [summary_t[1], summary_t[0]]
    else:
        qs, ks = [q[..., perm]], [summary_t[0]]
    b = _NATIVE(qs, ks, lane_bounds(D))                   # [H, Q, N]: q+ . kmax + q- . kmin
    if b is None:
        return None
    if how == "zscore":
        mean = b.mean(axis=2, keepdims=True)
        std = b.std(axis=2, keepdims=True, mean=mean)
        np.subtract(b, mean, out=b)
        np.divide(b, std + 1e-6, out=b)
    return b.max(axis=1)


def native_exact(head_dim: int) -> bool:
    """Whether the registered native scorer answers for this head size: built, and agreeing."""
    if _NATIVE is None:
        return False
    verdict = _native_verdicts.get(head_dim)
    if verdict is None:
        ready = _native_ready()
        if not ready:   # building (asked again at the next question) or never
            return False
        verdict = _agrees(head_dim, _scores_native, halves=True)
        if verdict is None:   # not built yet: asked again at the next question
            return False
        _native_verdicts[head_dim] = verdict
        if not verdict:
            log.warning("page scoring: the native scorer differs from the reference (head_dim %d); "
                        "scoring pages with numpy", head_dim)
    return verdict


def score_pages_by_dim(queries: np.ndarray, summary_t: tuple[np.ndarray, ...], how: str = "bound") -> np.ndarray:
    """score_pages(queries, summary, how) for summaries given dimension-major: summary_t is
    (kmin, kmax) or (kmean,), each [H, D, N] float32 (or float16, as the store keeps them: widened
    here unless the compiled scorer reads them) with dims in lane_order(D) (PageStore's
    summaries_by_dim). queries: [H, Q, D]. Returns [H, N], the same numbers as score_pages on
    the C-contiguous [N, H, D] summaries (the lane kernel where lanes_exact, else the reference)."""
    q = queries.astype(np.float32)
    H, _, D = q.shape
    N = summary_t[0].shape[2]
    if N == 0:
        return np.zeros((H, 0), np.float32)
    # One query over several heads: numpy's einsum lays the reference's bound out [Q, N, H], and its
    # mean and std then sum each row in another order (and the einsum is 1/Q of the usual cost).
    lanes = q.shape[1] > 1 or H == 1
    if lanes and native_exact(D):
        got = _scores_native(q, summary_t, how)
        if got is not None:
            return got
    summary_t = tuple(a.astype(np.float32, copy=False) for a in summary_t)   # the store's float16, for numpy
    if lanes and lanes_exact(D):
        return _scores_lanes(q, summary_t, how)
    inverse = np.argsort(lane_order(D))
    return score_pages(q, tuple(np.ascontiguousarray(s[:, inverse].transpose(2, 0, 1)) for s in summary_t), how)
