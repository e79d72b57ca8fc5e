"""The dimension-major page scorer (heap/scoring.py) gives recall.score_pages' numbers bit for bit,
so a question recalls exactly the windows it recalled before (numpy only)."""

import numpy as np
import pytest

from localheap.heap import scoring
from localheap.heap.pages import PageGeometry, PageStore
from localheap.heap.recall import score_pages


def random_scoring_case(rng, H, Q, N, D):
    q = rng.standard_normal((H, Q, D)).astype(np.float32)
    q[rng.random(q.shape) < 0.2] = 0                       # exact zeros, as a ReLU'd query has
    kmin = rng.standard_normal((N, H, D)).astype(np.float16).astype(np.float32)
    kmax = kmin + np.abs(rng.standard_normal((N, H, D)) * 3).astype(np.float16).astype(np.float32)
    kmax[: N // 7] = kmax[0]                               # pages that tie
    return q, kmin, kmax


def by_dim(summary, D):
    return tuple(np.ascontiguousarray(s.transpose(1, 2, 0)[:, scoring.lane_order(D)]) for s in summary)


@pytest.mark.parametrize("D,Q,N", [(32, 64, 9000), (32, 2, 37), (64, 9, 2000), (128, 16, 1500), (20, 11, 500)])
def test_lane_kernel_gives_the_einsum_scores_bit_for_bit(D, Q, N):
    """The kernel itself (not the dispatcher, which would hide a wrong kernel behind its fallback),
    against score_pages: both summaries, both scores; more pages than a page chunk and numpy's
    reduction buffer, a query block left over, head sizes not a multiple of 16."""
    rng = np.random.default_rng(D * 1000 + N)
    q, kmin, kmax = random_scoring_case(rng, 2, Q, N, D)
    for summary in ((kmin, kmax), (kmax,)):
        for how in ("bound", "zscore"):
            want = score_pages(q, summary, how)
            got = scoring._scores_lanes(q, by_dim(summary, D), how)
            assert got.dtype == want.dtype == np.float32
            np.testing.assert_array_equal(got, want, err_msg=f"{len(summary)} summaries, {how}")
    assert scoring.lanes_exact(D)   # so the dispatcher runs the kernel on this numpy


@pytest.mark.parametrize("H,Q", [(2, 1), (1, 1), (3, 5)])
def test_the_dispatcher_scores_what_the_reference_scores(H, Q):
    """score_pages_by_dim on every shape, one query over several heads included (its reference
    bound is laid out [Q, N, H], whose mean sums in another order: that one goes to the reference)."""
    D = 32
    rng = np.random.default_rng(H * 10 + Q)
    q, kmin, kmax = random_scoring_case(rng, H, Q, 1000, D)
    for summary in ((kmin, kmax), (kmax,)):
        for how in ("bound", "zscore"):
            np.testing.assert_array_equal(scoring.score_pages_by_dim(q, by_dim(summary, D), how),
                                          score_pages(q, summary, how))
    assert scoring.score_pages_by_dim(q, by_dim((kmin[:0], kmax[:0]), D), "zscore").shape == (H, 0)


def test_a_kernel_that_rounds_otherwise_is_caught_and_the_reference_scores(monkeypatch):
    """Dims summed in plain order round differently from the einsum: the one-time check says so and
    score_pages_by_dim falls back to the reference (the same numbers, the slow way)."""
    D = 32
    rng = np.random.default_rng(5)
    q, kmin, kmax = random_scoring_case(rng, 2, 9, 700, D)
    monkeypatch.setattr(scoring, "lane_order", lambda head_dim: np.arange(head_dim))
    monkeypatch.setattr(scoring, "_NATIVE", None)   # a compiled scorer (the torch backend's) would answer first
    scoring.lanes_exact.cache_clear()
    try:
        summary_t = by_dim((kmin, kmax), D)     # the store's layout follows lane_order
        assert not np.array_equal(scoring._scores_lanes(q, summary_t, "zscore"), score_pages(q, (kmin, kmax), "zscore"))
        assert not scoring.lanes_exact(D)
        np.testing.assert_array_equal(scoring.score_pages_by_dim(q, summary_t, "zscore"),
                                      score_pages(q, (kmin, kmax), "zscore"))
    finally:
        scoring.lanes_exact.cache_clear()


def fixed_store(tmp_path, rng, H=2, D=32, P=8, pages=1500):
    """One layer of `pages` pages whose tokens were evicted in a shuffled order (wide page spans,
    as a long document's), a few dropped so the live slots have holes, and a partial page."""
    s = PageStore(tmp_path / "pages", PageGeometry(1, H, D, P, "f16"), summary="minmax")
    n = pages * P + P // 2
    pos = np.stack([rng.permutation(n) for _ in range(H)])
    k = (rng.standard_normal((H, n, D)) * rng.uniform(0.2, 3, (H, 1, D))).astype(np.float32)
    s.append(0, pos, k, rng.standard_normal((H, n, D)).astype(np.float32), rng.random((H, n)).astype(np.float32))
    s.drop_lowest(pages // 50)
    return s


def test_picks_on_a_fixed_store_are_the_reference_picks(tmp_path):
    """Span and page recall on a fixed store pick the same tokens (positions, keys, values) with the
    dimension-major scorer as with score_pages on the [N, H, D] summaries, and the scores are equal."""
    from localheap.backends import paging
    from localheap.heap import HeapConfig
    from types import SimpleNamespace

    rng = np.random.default_rng(11)
    s = fixed_store(tmp_path, rng)
    slots, *summary = s.summaries(0)
    slots_t, *summary_t = s.summaries_by_dim(0)
    np.testing.assert_array_equal(slots, slots_t)
    assert len(slots) < slots[-1] + 1                               # holes: the gather path
    queries = {0: (rng.standard_normal((2, 64, 32)) * 2).astype(np.float32)}
    for how in ("zscore", "bound"):
        np.testing.assert_array_equal(scoring.score_pages_by_dim(queries[0], tuple(summary_t), how),
                                      score_pages(queries[0], tuple(summary), how))

    def picks(select, reference):
        cfg = HeapConfig(recall_select=select)
        cache = SimpleNamespace(cfg=cfg, heap_layers=[SimpleNamespace(heap=SimpleNamespace(layer=0, recall_slots=512))])
        pick = paging.pick_spans if select == "spans" else paging.pick_pages
        if not reference:
            return pick(cache, s, queries)
        real, score = s.summaries_by_dim, paging.score_pages_by_dim
        s.summaries_by_dim, paging.score_pages_by_dim = lambda layer, **kw: (slots, *summary), score_pages
        try:
            return pick(cache, s, queries)
        finally:
            s.summaries_by_dim, paging.score_pages_by_dim = real, score

    for select in ("spans", "pages"):
        got, want = picks(select, False), picks(select, True)
        assert got.keys() == want.keys() == {0}
        assert got[0][0].shape[1] > 0
        for a, b in zip(got[0], want[0]):
            np.testing.assert_array_equal(a, b, err_msg=select)
    s.close()


def test_best_first_is_the_stable_argsort_prefix():
    """vote's and select_pages' top pages by a partition: the first k of np.argsort(-scores,
    kind="stable"), ties (many, signed zeros among them) to the lower index, NaN rows included."""
    from localheap.heap.recall import best_first

    rng = np.random.default_rng(2)
    for trial in range(200):
        H, N = int(rng.integers(1, 4)), int(rng.integers(1, 300))
        scores = np.round(rng.standard_normal((H, N)), int(rng.integers(0, 3))).astype(np.float32)
        scores[rng.random(scores.shape) < 0.1] = -0.0
        if trial % 7 == 0:
            scores[0, rng.integers(0, N)] = np.nan
        for k in (1, 5, 32, N, N + 3):
            np.testing.assert_array_equal(best_first(scores, k), np.argsort(-scores, axis=1, kind="stable")[:, :k])


def vote_by_voter(scores, read_positions, n_bins, bin_size, voters):
    """vote as it was written first: voter by voter (the reference for the vectorized sums)."""
    from localheap.heap.recall import best_first

    votes = np.zeros(n_bins)
    for layer, z in scores.items():
        H, N = z.shape
        top = best_first(z, voters)
        uniq, inv = np.unique(top, return_inverse=True)
        pos = read_positions(layer, uniq)
        inv = inv.reshape(top.shape)
        for h in range(H):
            for c in range(top.shape[1]):
                p = pos[inv[h, c], h]
                p = p[p >= 0]
                if not len(p):
                    continue
                b, cnt = np.unique(p // bin_size, return_counts=True)
                votes[b] += max(float(z[h, top[h, c]]), 0.0) * cnt / cnt.sum()
    return votes


def test_vote_adds_what_the_voter_by_voter_loop_adds():
    """The span vote's sums bit for bit, in the loop's order: pages whose tokens straddle bins,
    unknown (-1) positions, empty pages, negative, tied and signed-zero scores, several layers."""
    from localheap.heap.recall import vote

    rng = np.random.default_rng(4)
    for trial in range(150):
        H, P, bin_size = int(rng.integers(1, 4)), int(rng.choice([4, 16, 32])), int(rng.choice([8, 16]))
        n_tokens = int(rng.integers(P, 3000))
        scores, pages = {}, {}
        for layer in range(int(rng.integers(1, 4))):
            N = int(rng.integers(1, 80))
            z = np.round(rng.standard_normal((H, N)), int(rng.integers(0, 3))).astype(np.float32)
            z[rng.random(z.shape) < 0.1] = -0.0
            scores[layer] = z
            start = rng.integers(0, n_tokens - P + 1, (N, H))[..., None]
            pos = start + np.sort(rng.integers(0, 3 * P, (N, H, P)), axis=-1)
            pos[rng.random(pos.shape) < 0.1] = -1
            pos[rng.random((N, H)) < 0.05] = -1     # a page with none of this head's tokens known
            pages[layer] = pos.astype(np.int64)
        read = lambda layer, idx: pages[layer][idx]   # noqa: E731
        n_bins = (n_tokens + 3 * P) // bin_size + 2
        voters = int(rng.choice([1, 5, 32]))
        got = vote(scores, read, n_bins, bin_size, voters)
        np.testing.assert_array_equal(got, vote_by_voter(scores, read, n_bins, bin_size, voters), err_msg=str(trial))
    with pytest.raises(IndexError):
        vote({0: np.ones((1, 1), np.float32)}, lambda layer, idx: np.full((1, 1, 4), 100), 3, 16, 1)


def test_vote_order_is_the_stable_argsort():
    from localheap.heap.recall import vote_order

    rng = np.random.default_rng(3)
    for trial in range(100):
        votes = np.zeros(int(rng.integers(1, 500)))
        hit = rng.random(len(votes)) < 0.05
        votes[hit] = np.round(rng.random(hit.sum()) * 4, 1)      # ties among the voted bins
        if trial % 9 == 0:
            votes[0] = np.nan
        np.testing.assert_array_equal(vote_order(votes), np.argsort(-votes, kind="stable"))


def test_pages_meeting_is_the_page_by_window_test():
    """take_windows' candidate pages: the spans [first, last] that meet any window [lo, hi),
    windows overlapping, adjacent, nested or apart, in any order."""
    from localheap.heap.recall import pages_meeting

    rng = np.random.default_rng(4)
    for trial in range(300):
        N, B = int(rng.integers(1, 200)), int(rng.integers(0, 20))
        first = rng.integers(0, 1000, N)
        last = first + rng.integers(0, int(rng.choice([2, 40, 400])), N)
        lo = rng.integers(-10, 1000, B) // 8 * 8
        hi = lo + rng.choice([8, 16, 32], B)
        want = np.flatnonzero(((first[None] < hi[:, None]) & (last[None] >= lo[:, None])).any(axis=0))
        np.testing.assert_array_equal(pages_meeting(first, last, lo, hi), want)


def take_windows_by_token(order, want, spans, read_positions, tail_pos, bin_size):
    """take_windows as it was written first: token by token (the reference for the vectorized walk)."""
    H = spans.shape[1]
    margin = bin_size // 2
    first, last = spans[:, :, 0].min(axis=1), spans[:, :, 1].max(axis=1)
    taken, seen = [[] for _ in range(H)], [set() for _ in range(H)]
    step, at = max(8, 2 * want // (2 * bin_size)), 0
    while at < len(order) and min(map(len, taken)) < want:
        batch = order[at: at + step]
        at += step
        lo, hi = batch * bin_size - margin, (batch + 1) * bin_size + margin
        cand = np.flatnonzero(((first[None] < hi[:, None]) & (last[None] >= lo[:, None])).any(axis=0))
        pages = read_positions(cand)
        P = pages.shape[2]
        for h in range(H):
            if len(taken[h]) >= want:
                continue
            t = tail_pos[h]
            pos = np.concatenate([pages[:, h].reshape(-1), t])
            src = np.concatenate([np.repeat(cand, P), np.full(len(t), -1)])
            off = np.concatenate([np.tile(np.arange(P), len(cand)), np.arange(len(t))])
            srt = np.argsort(pos, kind="stable")
            pos, src, off = pos[srt], src[srt], off[srt]
            for a, b in zip(lo.tolist(), hi.tolist()):
                if len(taken[h]) >= want:
                    break
                i0, i1 = np.searchsorted(pos, [max(0, a), b])
                for k in range(i0, i1):
                    p = int(pos[k])
                    if p not in seen[h]:
                        seen[h].add(p)
                        taken[h].append((int(src[k]), int(off[k])))
    return [t[:want] for t in taken]


def test_take_windows_takes_what_the_token_by_token_walk_takes():
    """Random documents: pages with wide spans, a position in two pages, unknown positions (-1, a
    torn header), a partial page, bins in any order, small and large wants."""
    from localheap.heap.recall import take_windows

    rng = np.random.default_rng(8)
    for trial in range(60):
        H, P, bin_size = int(rng.integers(1, 4)), 8, 16
        n = int(rng.integers(1, 60)) * P
        pos = np.stack([rng.permutation(n * 2)[:n] for _ in range(H)])
        pos[0, : P // 2] = pos[0, P: P + P // 2] if n > P else pos[0, : P // 2]   # duplicates across pages
        pages = pos.reshape(H, -1, P).transpose(1, 0, 2).copy()                  # [N, H, P]
        if trial % 3 == 0:
            pages[0, 0, :2] = -1
        spans = np.stack([pages.max(axis=2) * 0 + np.where(pages >= 0, pages, 10**9).min(axis=2),
                          pages.max(axis=2)], axis=2)
        tail = np.stack([rng.permutation(n * 2)[:3] + n * 2 for _ in range(H)])
        order = rng.permutation(n * 2 // bin_size + 2)
        for want in (1, 20, 64, 300):
            read = lambda idx: pages[idx]  # noqa: E731
            got = [list(zip(s.tolist(), o.tolist())) for s, o in take_windows(order, want, spans, read, tail, bin_size)]
            assert got == take_windows_by_token(order, want, spans, read, tail, bin_size), (trial, want)
