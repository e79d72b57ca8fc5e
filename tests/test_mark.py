"""Rolling a session back past an eviction: the point the next turn comes back to when the chat
template rewrites the reply (Qwen3 drops its reasoning, gpt-oss ends a final answer with <|end|>),
or where a client edited a message. Heap layers come back by a rewind: the tokens after the point
forgotten, the older ones they hold kept (backends/slots.HeapRollback). A sliding window cannot
bring back what it dropped, so a cache with sliding layers (gemma3, gpt-oss) keeps their state at
its mark, where a turn's prompt was read, and rolls back to that point only."""

import numpy as np
import pytest

from localheap.generation import SamplingParams
from localheap.heap import HeapConfig, LayerHeap, RepackPlan, SlotView
from localheap.sessions import RollbackRefused

CFG = HeapConfig(budget=1024, slack=64, recent=64)


def _backend(kind, path):
    if kind == "torch":
        torch = pytest.importorskip("torch")
        from localheap.backends.torch import TorchBackend
        from localheap.backends.torch.generate import generate_steps

        backend = TorchBackend.load(path, device="cpu", dtype=torch.float32)
        return backend, lambda cache, ids, n: [(t, np.asarray(lg.float().cpu())) for t, lg in
                                               generate_steps(backend.model, cache, ids, SamplingParams(max_tokens=n))]
    pytest.importorskip("mlx.core")
    from localheap.backends.mlx import MLXBackend
    from localheap.backends.mlx.generate import generate_steps as mlx_steps

    backend = MLXBackend.load(path)
    return backend, lambda cache, ids, n: [(t, np.array(lp)) for t, lp in
                                           mlx_steps(backend.model, cache, ids, SamplingParams(max_tokens=n))]


@pytest.mark.parametrize("kind", ["torch", "mlx"])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text"])
def test_rolled_back_to_the_mark_the_next_turn_is_as_if_the_reply_never_was(model_dirs, torch_one_thread, kind, family):
    backend, steps = _backend(kind, model_dirs(family))
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    first, second = ids[:150], ids[150:230]   # both far longer than the sliding window (32)

    def turn_one(cache):
        backend.prefill(cache, first[:-1])
        cache.mark()   # the engine marks here: the prompt read but for its last token
        return steps(cache, first[-1:], 40)   # the reply (its last token sampled, not fed)

    rolled = backend.new_cache(CFG)
    reply = turn_one(rolled)
    assert backend.tokens_in_cache(rolled) == len(first) + 39
    mark = backend.rollback_mark(rolled)
    assert mark == len(first) - 1 and backend.rollback_floor(rolled) > mark
    with pytest.raises(AssertionError):   # between the mark and the end: the window's past is gone
        backend.truncate(rolled, mark + 5)
    backend.truncate(rolled, mark)
    assert backend.tokens_in_cache(rolled) == mark
    backend.prefill(rolled, [first[-1]] + second[:-1])
    got = steps(rolled, second[-1:], 40)

    fresh = backend.new_cache(CFG)
    backend.prefill(fresh, first[:-1])
    backend.prefill(fresh, [first[-1]] + second[:-1])
    want = steps(fresh, second[-1:], 40)
    assert [t for t, _ in got] == [t for t, _ in want] != [t for t, _ in reply]
    for i, ((_, a), (_, b)) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"logits differ at step {i}"


def test_only_heap_layers_need_no_mark(model_dirs, torch_one_thread):
    torch = pytest.importorskip("torch")
    from localheap.backends.torch import TorchBackend

    backend = TorchBackend.load(model_dirs("llama"), device="cpu", dtype=torch.float32)
    cache = backend.new_cache(CFG)
    backend.prefill(cache, list(range(5, 60)))
    cache.mark()
    backend.prefill(cache, list(range(60, 70)))
    assert backend.rollback_mark(cache) is None and backend.rollback_floor(cache) == 0


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_mark_taken_between_decode_steps(model_dirs, torch_one_thread, kind):
    """A turn of one token marks right after the last reply's decode steps: the sliding layers' arrays are
    the ones those steps write into (mlx-lm's rotating cache writes in place), so the mark is a copy."""
    backend, steps = _backend(kind, model_dirs("gpt_oss"))
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    prompt, other = ids[:150], ids[160]

    def reply(cache):
        backend.prefill(cache, prompt[:-1])
        return steps(cache, prompt[-1:], 10)

    rolled = backend.new_cache(CFG)
    first = reply(rolled)
    rolled.mark()
    steps(rolled, [first[-1][0]], 30)   # a reply after a one-token turn: 30 steps past the mark
    backend.truncate(rolled, backend.rollback_mark(rolled))
    got = steps(rolled, [other], 20)
    fresh = backend.new_cache(CFG)
    assert [t for t, _ in reply(fresh)] == [t for t, _ in first]
    want = steps(fresh, [other], 20)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))


# -- rewinds: the reply evicted, the heap layers forget it past their latest repack ---------------

SMALL = dict(budget=64, sinks=4, recent=8, slack=32, policy="h2o")


def heads_evicted_apart() -> LayerHeap:
    """A two-head heap of 90 tokens after an eviction in which head 0 dropped 40-59 and head 1 its
    oldest unprotected ones, then 20 more (positions 90-109)."""
    cfg = HeapConfig(**SMALL)
    heap = LayerHeap(cfg, n_kv_heads=2, budget=cfg.budget)
    heap.append(90)
    scores = np.tile(np.arange(90.0), (2, 1))
    scores[0, 40:60] = -1
    heap.apply(heap.plan(SlotView(positions=heap.view_positions(), attention=scores)))
    heap.append(20)
    return heap


def test_a_rewind_keeps_each_heads_older_slots_cut_to_the_fewest_by_score():
    heap = heads_evicted_apart()   # the reply: positions 90-109
    n = heap.resident
    scores = np.tile(np.arange(n, dtype=float), (2, 1))
    heap.apply(RepackPlan(keep_indices=np.stack([np.r_[0:4, 10:n], np.r_[0:4, 6:n - 4]]), deltas=None))
    before = [(heap.positions[h, :heap.resident] < 90).sum() for h in range(2)]
    assert before[0] != before[1], "the heads hold different numbers of older tokens"
    scores = np.tile(-np.arange(heap.resident, dtype=float), (2, 1))   # the oldest are worth most
    plan, dropped = heap.rewind_plan(90, scores)
    kept = np.take_along_axis(heap.positions[:, :heap.resident], plan.keep_indices, axis=1)
    assert plan.keep == min(before) and dropped == max(before) - min(before)
    assert (kept < 90).all() and (kept[:, :4] == np.arange(4)).all()   # sinks stay
    full = int(np.argmax(before))
    older = heap.positions[full, :heap.resident][heap.positions[full, :heap.resident] < 90]
    assert kept[full].tolist() == older[:plan.keep].tolist()   # by score: its newest went


def _heap_positions(cache) -> list:
    return [layer.heap.positions[:, :layer.heap.resident].copy() for layer in cache.heap_layers]


def _repack_to(cache, positions: list) -> None:
    """Keep exactly `positions` ([H, k] per heap layer) of what each heap layer holds (a test's
    reference for a rewind: one repack of a heap that never saw the reply)."""
    for layer, want in zip(cache.heap_layers, positions):
        have = layer.heap.positions[:, :layer.heap.resident]
        idx = np.stack([np.searchsorted(have[h], want[h]) for h in range(len(want))])
        assert (np.take_along_axis(have, idx, 1) == want).all(), "a rewind keeps only tokens the heap held"
        layer.repack(RepackPlan(keep_indices=idx, deltas=layer.heap._deltas(idx)), evicting=False)


def _turn(backend, steps, cache, prompt, n):
    """A turn: the prompt read but for its last token, the mark, then an n-token reply; the tokens fed."""
    backend.prefill(cache, prompt[:-1])
    cache.mark()
    reply = steps(cache, prompt[-1:], n)
    return list(prompt) + [t for t, _ in reply[:-1]]


@pytest.mark.parametrize("kind", ["torch", "mlx"])
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_a_reply_that_evicted_rewinds_to_where_it_began(model_dirs, torch_one_thread, kind, family, positions):
    """The rewound heap continues as a heap that read the prompt and then kept only what the rewound
    one keeps (bit for bit with absolute positions; compact ones re-rotated the keys twice)."""
    backend, steps = _backend(kind, model_dirs(family))
    cfg = HeapConfig(**SMALL, positions=positions)
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    first, second = ids[:150], ids[150:158]

    rolled = backend.new_cache(cfg)
    backend.prefill(rolled, first[:-1])
    rolled.mark()
    at_mark = _heap_positions(rolled)
    reply = steps(rolled, first[-1:], 60)
    mark = len(first) - 1
    assert rolled.heap_floor() > mark
    if family == "gpt_oss":   # sliding layers: the mark only
        assert backend.rollback_floor(rolled) == backend.tokens_in_cache(rolled) and backend.rollback_mark(rolled) == mark
    else:
        assert backend.rollback_floor(rolled) <= mark and backend.rollback_mark(rolled) is None
    backend.truncate(rolled, mark)
    assert rolled.rewinds == 1 and backend.tokens_in_cache(rolled) == mark
    kept = _heap_positions(rolled)
    for now, then in zip(kept, at_mark):
        assert (now < mark).all() and all(np.isin(now[h], then[h]).all() for h in range(len(now)))
        assert now.shape[1] >= SMALL["budget"] // 2
    got = steps(rolled, [first[-1]] + second, 12)

    fresh = backend.new_cache(cfg)
    backend.prefill(fresh, first[:-1])
    _repack_to(fresh, kept)
    want = steps(fresh, [first[-1]] + second, 12)
    if positions == "absolute":
        assert [t for t, _ in got] == [t for t, _ in want] != [t for t, _ in reply][:12]
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))
    else:
        np.testing.assert_allclose(got[0][1], want[0][1], rtol=1e-3, atol=1e-3)


def test_a_rewind_goes_back_to_the_latest_mark_only(model_dirs, torch_one_thread):
    """Not below the latest reply's start: a request that shares less of a long session (another
    conversation with its system prompt, an edit two turns back) reads its prompt into a new
    session rather than undo more of this one."""
    backend, steps = _backend("torch", model_dirs("llama"))
    cfg = HeapConfig(**SMALL, positions="absolute")
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    cache = backend.new_cache(cfg)
    earlier = len(_turn(backend, steps, cache, ids[:150], 20))
    fed = earlier + len(_turn(backend, steps, cache, ids[150:170], 40))
    mark = earlier + 19
    assert cache.rewindable(earlier) and backend.rollback_floor(cache) == mark < cache.heap_floor()
    with pytest.raises(AssertionError):
        backend.truncate(cache, earlier)
    backend.truncate(cache, mark + 5)   # at or past the mark: any point
    assert backend.tokens_in_cache(cache) == mark + 5 and cache.mark_at == mark < fed
    backend.truncate(cache, mark)
    backend.prefill(cache, ids[200:230])
    assert backend.rollback_floor(cache) == mark   # the mark stays until the next turn's
    backend.truncate(cache, mark)
    assert cache.mark_at == mark


def test_a_rewind_that_would_leave_under_half_the_heap_is_refused(model_dirs, torch_one_thread):
    """Below REWIND_FILL of the heap left, there is no rollback point: the next turn reads the
    conversation again into a heap chosen over all of it."""
    from localheap.backends.slots import rewind_least

    backend, steps = _backend("torch", model_dirs("llama"))
    cache = backend.new_cache(HeapConfig(**{**SMALL, "recent": 48}))   # the reply's newest 48 stay
    ids = backend.tokenizer.encode(" ".join(f"token {i} of many" for i in range(40)))
    _turn(backend, steps, cache, ids, 100)
    mark = len(ids) - 1
    heap = cache.heap_layers[0].heap
    assert (heap.positions[:, :heap.resident] < mark).sum(axis=1).min() < rewind_least(heap)
    assert backend.rollback_floor(cache) > mark and backend.rollback_mark(cache) is None
    with pytest.raises(AssertionError):
        backend.truncate(cache, mark)


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_rewind_with_recall_on_leaves_no_page_of_the_reply(model_dirs, torch_one_thread, kind):
    """The reply's evicted tokens went to the page store: a rewind forgets them there too (a later
    token takes their positions), and the next turn's recall reads only what the heap had before."""
    backend, steps = _backend(kind, model_dirs("llama"))
    cfg = HeapConfig(**SMALL, recall=True, recall_budget=16, page_size=8)
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    first, second = ids[:200], ids[200:260]
    cache = backend.new_cache(cfg)
    backend.prefill(cache, first[:-1])
    cache.mark()
    steps(cache, first[-1:], 60)
    mark = len(first) - 1
    cache.writer.drain()
    store = cache.pages

    def stored_positions():
        out = []
        for layer in range(store.g.n_layers):
            slots = store.summaries(layer)[0]
            if len(slots):
                out.append(store.load(layer, np.array([slots] * store.g.n_kv_heads))[0].ravel())
            out.append(store.layers[layer].tail_pos.ravel())
        return np.concatenate(out)

    assert stored_positions().max() >= mark   # the reply's evictions reached the store
    pages, held, seen = store.pages, _heap_positions(cache), backend.tokens_in_cache(cache)

    def refuse(seen):
        raise OSError(28, "No space left on device")

    store.forget_from = refuse   # the disk refuses the tombstones: nothing of the heap changes
    with pytest.raises(RollbackRefused):
        backend.truncate(cache, mark)
    assert backend.tokens_in_cache(cache) == seen and cache.rewinds == 0
    assert all(np.array_equal(a, b) for a, b in zip(_heap_positions(cache), held))
    del store.forget_from
    backend.truncate(cache, mark)
    assert cache.rewinds == 1 and 0 < store.pages < pages and stored_positions().max() < mark
    got = steps(cache, [first[-1]] + second, 8)   # a turn long enough to recall
    assert len(got) == 8 and cache.recall_log


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_a_spilled_session_keeps_a_heap_only_mark_and_drops_a_sliding_one(model_dirs, torch_one_thread, tmp_path, family):
    """The heap file keeps a heap-only cache's mark: spilled to disk (more sessions than
    --max-resident) and read back, it rewinds to the same heap as one that stayed in RAM. A sliding
    layer's marked state stays in RAM: spilled, such a session offers no rollback to its mark
    (offered, it failed once read back)."""
    from localheap.engine import branching
    from localheap.sessions.store import SessionStore

    backend, steps = _backend("torch", model_dirs(family))
    cfg = HeapConfig(**SMALL, positions="absolute")
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    first, second = ids[:150], ids[150:158]
    store = SessionStore(backend, cfg, spill_dir=tmp_path / "spill")
    s = store.create("sess_m")
    store.make_resident(s)
    s.extend(_turn(backend, steps, s.cache, first, 60))
    mark = len(first) - 1
    branching.settle(backend, s, reply_start=mark)
    if family == "llama":
        assert s.rollback_floor <= mark and s.rollback_mark is None
        kept = backend.new_cache(cfg)   # the same session kept in RAM, for reference
        _turn(backend, steps, kept, first, 60)
        backend.truncate(kept, mark)
        want = steps(kept, [first[-1]] + second, 8)
    else:
        assert s.rollback_mark == mark
    store.spill(s.id)
    if family == "gpt_oss":
        assert s.rollback_mark is None
        return
    assert s.rollback_floor <= mark
    store.make_resident(s)
    assert s.cache.mark_at == mark and backend.rollback_floor(s.cache) == s.rollback_floor
    branching.roll_back(backend, s, mark, store)
    assert s.cache.rewinds == 1 and len(s.fed) == mark
    got = steps(s.cache, [first[-1]] + second, 8)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))
