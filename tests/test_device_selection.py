"""The device selection rules (torch, MLX) keep exactly the slots the numpy specification keeps.

Same scores in, identical keep sets out, ties included (the older slot wins), for every
combination of sinks / recent / budget, and per policy through each backend's device scoring.
"""

import numpy as np
import pytest
import torch

from localheap.backends.torch.select import layer_scores as torch_layer_scores
from localheap.backends.torch.select import select_and_drop
from localheap.backends.torch.select import select_keep as torch_select
from localheap.heap import HeapConfig, LayerHeap, SlotView, select_keep

CASES = [  # (n, keep, sinks, recent)
    (1, 4, 4, 0), (10, 10, 2, 2), (11, 10, 2, 2), (300, 64, 4, 16), (300, 64, 0, 0), (300, 64, 64, 0),
    (300, 64, 0, 64), (257, 100, 4, 256 - 4 - 160), (700, 300, 4, 256), (40, 12, 8, 4), (40, 30, 30, 0),
]


def tied_scores(rng, shape, levels):
    """Scores drawn from a few values, so most comparisons are ties; some -0.0 next to 0.0."""
    scores = rng.integers(0, levels, shape).astype(np.float32) / 4.0
    scores[rng.random(shape) < 0.05] = -0.0
    return scores


def mlx_or_skip():
    return pytest.importorskip("mlx.core")


# the torch rules: a stable sort (off the CPU), the selection by kthvalue and masks, the C++ selection (the CPU's)
RULES = {"sort": dict(by_sort=True), "select": dict(by_sort=False, kernel=False), "kernel": dict(by_sort=False, kernel=True)}


def torch_rule(name: str) -> dict:
    if name == "kernel":
        from localheap.backends.torch import slab_cpu
        if slab_cpu.load(wait=True) is None:
            pytest.skip(f"slab kernel unavailable: {slab_cpu.unavailable()}")
    return RULES[name]


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("levels", [2, 5, 10_000])
@pytest.mark.parametrize("case", CASES)
def test_torch_rule_equals_numpy_rule(case, levels, rule):
    """Every torch rule (the sort, the default off the CPU; the selections, the CPU's) keeps the spec's slots;
    the kernel's dropped slots are the rest, in order, in float64 scores as in float32."""
    n, keep, sinks, recent = case
    rng = np.random.default_rng(levels * 1000 + n)
    scores = tied_scores(rng, (3, 2, n), levels)                       # [layers, heads, n]
    scores[0, 0, rng.random(n) < 0.1] = np.inf                         # pinned (recalled) slots
    got = torch_select(torch.from_numpy(scores), keep, sinks, recent, **torch_rule(rule)).numpy()
    want = np.stack([select_keep(s.astype(np.float64), keep, sinks, recent) for s in scores])
    assert got.dtype == np.int64 and np.array_equal(got, want)
    if rule == "kernel":
        for dtype in (torch.float32, torch.float64):
            kept, dropped = select_and_drop(torch.from_numpy(scores).to(dtype), keep, sinks, recent, **RULES[rule])
            assert np.array_equal(kept.numpy(), want)
            if dropped is not None:   # (None where every slot fits)
                assert np.array_equal(dropped.numpy(), np.stack([np.setdiff1d(np.arange(n), w) for w in want.reshape(-1, want.shape[-1])]).reshape(3, 2, -1))


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("keep", [60, 100, 150, 200, 280, 295])
def test_torch_rule_ranks_nan_scores_below_minus_inf_as_the_spec(keep, rule):
    """NaN scores (none should occur) rank last, below -inf, as the numpy spec's stable sort ranks them;
    the keep sizes put the cut among the numbers, the -inf, the ties with them and the NaN."""
    rng = np.random.default_rng(keep)
    scores = tied_scores(rng, (2, 2, 300), 5)
    scores[:, :, rng.random(300) < 0.3] = np.nan
    scores[:, :, rng.random(300) < 0.15] = -np.inf
    scores[:, 1, rng.random(300) < 0.1] = np.inf
    got = torch_select(torch.from_numpy(scores), keep, 4, 16, **torch_rule(rule)).numpy()
    want = np.stack([select_keep(s.astype(np.float64), keep, 4, 16) for s in scores])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("levels", [2, 5, 10_000])
@pytest.mark.parametrize("case", CASES)
def test_mlx_rule_equals_numpy_rule(case, levels):
    mx = mlx_or_skip()
    from localheap.backends.mlx.select import select_keep as mlx_select

    n, keep, sinks, recent = case
    rng = np.random.default_rng(levels * 1000 + n)
    scores = tied_scores(rng, (3, 2, n), levels)
    got = np.array(mlx_select(mx.array(scores), keep, sinks, recent))
    want = np.stack([select_keep(s.astype(np.float64), keep, sinks, recent) for s in scores])
    assert np.array_equal(got, want)


def test_ties_go_to_the_older_slot():
    scores = np.zeros((1, 1, 12), dtype=np.float32)
    scores[0, 0, [3, 5, 7, 9]] = 1.0
    want = [[[0, 3, 5, 11]]]   # sinks 1, recent 1, two free slots: the two oldest of the tied four
    assert select_keep(scores[0].astype(np.float64), 4, 1, 1).tolist() == want[0]
    assert torch_select(torch.from_numpy(scores), 4, 1, 1).tolist() == want
    try:
        import mlx.core as mx
    except ImportError:
        return
    from localheap.backends.mlx.select import select_keep as mlx_select
    assert np.array(mlx_select(mx.array(scores), 4, 1, 1)).tolist() == want


class FakeLayer:
    """The buffers a HeapLayer exposes to scoring, filled with tie-prone values."""

    def __init__(self, cfg, heap, rng, xp):
        H, n = heap.n_kv_heads, heap.resident
        self.heap, self.device = heap, "cpu"
        self.raw = {name: tied_scores(rng, (H, heap.capacity), 6) for name in ("scores", "window")}
        self.raw["counts"] = rng.integers(0, 4, (H, heap.capacity)).astype(np.float32)
        self.raw["geometry"] = tied_scores(rng, (H, n), 6)
        for name in ("scores", "window", "counts"):
            setattr(self, name, xp(self.raw[name]))

    def _geometry_scores(self):
        return self.geometry


POLICY_CASES = [dict(policy="h2o"), dict(policy="h2o", h2o_normalize=True), dict(policy="snapkv"),
                dict(policy="snapkv", pool_kernel=1), dict(policy="geometry"), dict(policy="streaming"),
                dict(policy="random", seed=3)]


def numpy_keep(cfg, layer):
    n = layer.heap.resident
    view = SlotView(positions=layer.heap.view_positions(), attention=layer.raw["scores"][:, :n],
                    counts=layer.raw["counts"][:, :n], window=layer.raw["window"][:, :n],
                    geometry=layer.raw["geometry"])
    return layer.heap.plan(view).keep_indices


def filled_heap(cfg, n):
    heap = LayerHeap(cfg, n_kv_heads=2, budget=cfg.budget)
    heap.append(n)
    return heap


@pytest.mark.parametrize("kwargs", POLICY_CASES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_torch_policy_scores_rank_like_numpy(kwargs):
    cfg = HeapConfig(budget=40, sinks=4, recent=8, slack=24, **kwargs)
    want_layer = FakeLayer(cfg, filled_heap(cfg, 60), np.random.default_rng(7), np.asarray)
    got_layer = FakeLayer(cfg, filled_heap(cfg, 60), np.random.default_rng(7), torch.from_numpy)
    got_layer.geometry = torch.from_numpy(got_layer.raw["geometry"])
    want = numpy_keep(cfg, want_layer)
    scores = torch_layer_scores(got_layer)
    got = torch_select(scores[None], want_layer.heap.keep, cfg.sinks, cfg.recent)[0].numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kwargs", POLICY_CASES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_mlx_policy_scores_rank_like_numpy(kwargs):
    mx = mlx_or_skip()
    from localheap.backends.mlx.select import layer_scores as mlx_layer_scores
    from localheap.backends.mlx.select import select_keep as mlx_select

    if kwargs.get("h2o_normalize"):
        pytest.skip("MLX divides in float32 (no float64 on Metal): near-ties may rank differently")
    cfg = HeapConfig(budget=40, sinks=4, recent=8, slack=24, **kwargs)
    want_layer = FakeLayer(cfg, filled_heap(cfg, 60), np.random.default_rng(7), np.asarray)
    got_layer = FakeLayer(cfg, filled_heap(cfg, 60), np.random.default_rng(7), mx.array)
    got_layer.geometry = mx.array(got_layer.raw["geometry"])
    want = numpy_keep(cfg, want_layer)
    got = np.array(mlx_select(mlx_layer_scores(got_layer)[None], want_layer.heap.keep, cfg.sinks, cfg.recent)[0])
    assert np.array_equal(got, want)
