"""Selection and slot-table invariants (property-based)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localheap.heap import HeapConfig, HeapConfigError, LayerHeap, SlotView, max_pool1d, select_keep
from localheap.heap.config import POLICIES


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300), heads=st.integers(1, 4), sinks=st.integers(0, 8),
    recent=st.integers(0, 32), extra=st.integers(0, 64), seed=st.integers(0, 10_000),
)
def test_select_keep_properties(n, heads, sinks, recent, extra, seed):
    keep = sinks + recent + extra
    scores = np.random.default_rng(seed).standard_normal((heads, n))
    idx = select_keep(scores, keep, sinks, recent)
    assert idx.shape == (heads, min(n, keep))
    assert (np.diff(idx, axis=1) > 0).all(), "order preserved, no duplicates"
    for h in range(heads):
        kept = set(idx[h].tolist())
        assert set(range(min(sinks, n))) <= kept, "sinks never evicted"
        assert set(range(max(0, n - recent), n)) <= kept, "recent window never evicted"
        if n > keep:
            # every evicted candidate scores no higher than every kept candidate
            protected = set(range(min(sinks, n))) | set(range(max(0, n - recent), n))
            kept_free = [scores[h, i] for i in kept - protected]
            dropped = [scores[h, i] for i in set(range(n)) - kept]
            if kept_free and dropped:
                assert min(kept_free) >= max(dropped)


def test_select_keep_picks_heavy_hitters():
    scores = np.zeros((1, 20))
    scores[0, [7, 11]] = 5.0
    idx = select_keep(scores, keep=6, sinks=2, recent=2)
    assert idx.tolist() == [[0, 1, 7, 11, 18, 19]]


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES), positions=st.sampled_from(["compact", "absolute"]),
       budget=st.integers(4, 40), slack=st.integers(1, 16), steps=st.lists(st.integers(1, 16), min_size=1, max_size=40),
       seed=st.integers(0, 1000))
def test_layer_heap_stream_invariants(policy, positions, budget, slack, steps, seed):
    cfg = HeapConfig(budget=budget, sinks=3, recent=min(4, budget), slack=slack, policy=policy, positions=positions)
    heap = LayerHeap(cfg, n_kv_heads=2, budget=budget)
    rng = np.random.default_rng(seed)
    total = 0
    for n in steps:
        n = min(n, slack)
        if heap.needs_repack(n):
            pos = heap.view_positions()
            view = SlotView(positions=pos, attention=rng.random(pos.shape), counts=np.ones(pos.shape),
                            window=rng.random(pos.shape), geometry=rng.random(pos.shape))
            plan = heap.plan(view)
            if positions == "compact":
                assert (plan.deltas == np.arange(plan.keep)[None] - plan.keep_indices).all()
                assert (plan.deltas <= 0).all(), "survivors only move towards the front"
            else:
                assert plan.deltas is None
            heap.apply(plan)
        heap.append(n)
        total += n
        assert heap.resident <= heap.capacity == cfg.sinks + budget + slack
        pos = heap.view_positions()
        assert (np.diff(pos, axis=1) > 0).all(), "token order preserved in every head"
        sinks_seen = min(cfg.sinks, heap.seen)
        assert (pos[:, :sinks_seen] == np.arange(sinks_seen)).all(), "sinks never evicted"
        assert heap.seen == total
        assert heap.resident + heap.evicted == heap.seen
        expected = heap.resident if positions == "compact" else heap.seen
        assert heap.rope_offset() == expected


def test_streaming_policy_keeps_sinks_and_newest():
    cfg = HeapConfig(budget=6, sinks=2, recent=2, slack=4, policy="streaming")
    heap = LayerHeap(cfg, n_kv_heads=1, budget=6)
    heap.append(12)
    heap.apply(heap.plan(SlotView(positions=heap.view_positions())))
    assert heap.view_positions().tolist() == [[0, 1, 6, 7, 8, 9, 10, 11]]


def test_h2o_normalize_divides_by_counts():
    from localheap.heap.policies import H2O
    view = SlotView(positions=np.arange(3)[None], attention=np.array([[4.0, 2.0, 1.0]]),
                    counts=np.array([[4.0, 1.0, 1.0]]))
    assert H2O(normalize=True).score(view).tolist() == [[1.0, 2.0, 1.0]]
    assert H2O().score(view).tolist() == [[4.0, 2.0, 1.0]]


def test_policy_without_its_inputs_fails_loudly():
    heap = LayerHeap(HeapConfig(budget=4, sinks=0, recent=0, slack=2, policy="h2o"), 1, 4)
    heap.append(6)
    with pytest.raises(RuntimeError, match="attention mass"):
        heap.plan(SlotView(positions=heap.view_positions()))


def test_noise_floor_is_seeded_and_off_by_default():
    def kept(noise, seed):
        cfg = HeapConfig(budget=8, sinks=0, recent=0, slack=8, noise=noise, seed=seed, policy="h2o")
        heap = LayerHeap(cfg, 1, 8)
        heap.append(16)
        scores = np.linspace(0, 1, 16)[None]
        return heap.plan(SlotView(positions=heap.view_positions(), attention=scores)).keep_indices.tolist()
    assert kept(0.0, 0) == [list(range(8, 16))]
    assert kept(2.0, 1) == kept(2.0, 1)
    assert kept(2.0, 1) != kept(0.0, 1)


def test_max_pool1d():
    x = np.array([[0.0, 5.0, 0.0, 0.0, 0.0, 1.0]])
    assert max_pool1d(x, 3).tolist() == [[5.0, 5.0, 5.0, 0.0, 1.0, 1.0]]


def test_pyramid_budgets_keep_the_total():
    cfg = HeapConfig(budget=100, recent=10, profile="pyramid", pyramid_ratio=0.5)
    b = cfg.layer_budgets(8)
    assert sum(b) == 800 and b[0] > b[-1] and b == sorted(b, reverse=True)
    assert HeapConfig(budget=100, recent=10).layer_budgets(3) == [100, 100, 100]


@pytest.mark.parametrize("bad", [dict(policy="lru"), dict(positions="rope"), dict(budget=0),
                                 dict(recent=5000), dict(slack=0), dict(pool_kernel=4), dict(noise=-1)])
def test_bad_config_is_a_typed_error(bad):
    with pytest.raises(HeapConfigError):
        HeapConfig(**bad)


def test_overflow_is_refused():
    from localheap.heap import HeapOverflow
    heap = LayerHeap(HeapConfig(budget=4, sinks=0, recent=0, slack=2), 1, 4)
    heap.append(6)
    with pytest.raises(HeapOverflow):
        heap.append(1)
