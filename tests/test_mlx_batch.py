"""The MLX decode batch: each session's tokens in a batch are its tokens alone, and its heap
(evictions, positions, scores, pages) is what it would be alone, whether its rows attend one by one
or as one batch from a slab (slab.py: rows join, sit out, leave, and a seated heap still evicts,
recalls and rolls back through its row); a prefill chunk in the step feeds the document's heap as a
chunk on its own would; the engine batches MLX sessions."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
pytest.importorskip("mlx_lm")

from recall_checks import CFG as RECALL_CFG  # noqa: E402
from recall_checks import (BatchKit, check_picks_beside_the_batch, check_row_ended_mid_pick, check_row_runs_ahead,  # noqa: E402
                           load_all, step_with_document)

from localheap.backends.mlx import MLXBackend  # noqa: E402
from localheap.backends.mlx.cache import HeapKVCache  # noqa: E402
from localheap.backends.mlx.batch import end_row, leave_slab, start_row, step_rows  # noqa: E402
from localheap.backends.mlx.generate import generate_steps  # noqa: E402
from localheap.backends.mlx.heapcache import HeapPromptCache  # noqa: E402
from localheap.generation import SamplingParams  # noqa: E402
from localheap.heap import HeapConfig  # noqa: E402
from localheap.models import demo_model_dir  # noqa: E402

SMALL = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy="snapkv", prefill_chunk=32)
# Logprobs of a row in a batch against the session alone, float32. Attention runs per heap as
# alone and RoPE per row is bit for bit the scalar offset; only the per-token matmuls see B rows
# instead of 1, so a BLAS may sum in another order (~1e-6 relative per matmul, compounded over
# layers and steps). mlx's CPU backend gave identical logprobs here (difference 0.0); the margin
# is for Metal's kernels, which may tile [B, D] and [1, D] products differently. A slab attends
# all rows over the longest row's slots, masked (exp of the mask's floor is exactly 0): on the CPU
# that is mlx's own formulation and came out bit for bit too; on Metal it is the fused sdpa with a
# mask and a float32 side pass for the scores, within the same margin (not measured here).
LOGPROBS_ATOL = 1e-4
SLABS = pytest.mark.parametrize("slabs", [None, {}], ids=["per-heap", "slab"])


@pytest.fixture(scope="module")
def demo():
    path = demo_model_dir()
    if path is None:
        pytest.skip("no bundled demo model in this installation")
    return MLXBackend.load(path)


@pytest.fixture(scope="module")
def llama(model_dirs):
    return MLXBackend.load(model_dirs("llama"))


def prompts(backend, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, backend.vocab_size, n).tolist() for n in lengths]


def alone(backend, cfg, prompt, params):
    cache = backend.new_cache(cfg)
    steps = list(generate_steps(backend.model, cache, prompt, params))
    return [t for t, _ in steps], [lp for _, lp in steps], cache


def batched(backend, cfg, prompt_list, params_list, defer=True, slabs=None):
    """Rows start one by one (`defer`: their prompt is fed by the first step), then step together;
    a row leaves once it has its max_tokens (with `slabs` ({}): its heap leaves the slab, the last
    row moving into its place)."""
    rows = [start_row(backend.model, backend.new_cache(cfg), p, sp, defer=defer)
            for p, sp in zip(prompt_list, params_list)]
    tokens, logprobs = [[] for _ in rows], [[] for _ in rows]

    def record(i):
        tokens[i].append(rows[i].token)
        logprobs[i].append(rows[i].logprobs)

    live = list(range(len(rows)))
    if not defer:
        for i in live:
            record(i)
    live = [i for i in live if len(tokens[i]) < params_list[i].max_tokens]
    while live:
        assert step_rows(backend.model, [rows[i] for i in live], slabs=slabs) == [None] * len(live)
        for i in live:
            record(i)
            if len(tokens[i]) == params_list[i].max_tokens:
                leave_slab(rows[i].cache)
        live = [i for i in live if len(tokens[i]) < params_list[i].max_tokens]
    if slabs:
        assert all(not slab.members and not slab.buffers for slab in slabs.values()), "every heap left"
    return tokens, logprobs, [r.cache for r in rows]


def assert_same_heap(a, b, atol=1e-5):
    """Positions, eviction counts, tokens seen, keys and the policy's scores, layer by layer."""
    for la, lb in zip(a.heap_layers, b.heap_layers):
        np.testing.assert_array_equal(la.heap.view_positions(), lb.heap.view_positions())
        assert (la.heap.evictions, la.heap.seen) == (lb.heap.evictions, lb.heap.seen)
        n = la.heap.resident
        np.testing.assert_allclose(np.array(la.keys[0, :, :n]), np.array(lb.keys[0, :, :n]), atol=atol)
        for name in ("scores", "counts", "window"):
            if getattr(la, name) is not None:
                np.testing.assert_allclose(np.array(getattr(la, name)), np.array(getattr(lb, name)),
                                           atol=atol, rtol=1e-5)


def max_diff(xs, ys):
    return max(mx.abs(x - y).max().item() for x, y in zip(xs, ys))


@SLABS
@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "started-alone"])
def test_demo_model_greedy_tokens_in_a_batch_equal_alone(demo, defer, slabs):
    """Rows of different lengths evict at different steps and finish at different steps."""
    lengths, maxes = (5, 30, 77, 140), (40, 12, 33, 25)
    ps = prompts(demo, lengths)
    params = [SamplingParams(max_tokens=m) for m in maxes]
    want = [alone(demo, SMALL, p, sp) for p, sp in zip(ps, params)]
    got_tokens, got_lps, caches = batched(demo, SMALL, ps, params, defer, slabs)
    assert got_tokens == [w[0] for w in want]
    assert len({c.heap_layers[0].heap.evictions for c in caches} - {0}) >= 2, "rows evicted, at different steps"
    for (_, lps, cache), got_lp, got in zip(want, got_lps, caches):
        assert max_diff(lps, got_lp) <= LOGPROBS_ATOL
        assert_same_heap(cache, got)


@SLABS
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "streaming", "geometry"])
def test_random_model_logprobs_within_tolerance_and_sampling_per_row(llama, policy, slabs):
    """Per row its own sampler: greedy rows, and a seeded top-k/top-p row (the global generator,
    seeded at its turn's start as alone: the only row that draws)."""
    ps = prompts(llama, (20, 64, 9), seed=3)
    params = [SamplingParams(max_tokens=30),
              SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=5),
              SamplingParams(max_tokens=24)]
    cfg = SMALL.with_(policy=policy, h2o_normalize=policy == "h2o")
    want = [alone(llama, cfg, p, sp) for p, sp in zip(ps, params)]
    got_tokens, got_lps, caches = batched(llama, cfg, ps, params, slabs=slabs)
    for (tokens, lps, cache), got, got_lp, got_cache in zip(want, got_tokens, got_lps, caches):
        assert got == tokens
        assert max_diff(lps, got_lp) <= LOGPROBS_ATOL
        assert_same_heap(cache, got_cache)


class EvenIds:
    """A constraint (a grammar's stand-in): only even ids; it sees every id sampled."""

    def __init__(self, vocab: int):
        self.mask, self.seen = np.arange(vocab) % 2 == 0, []

    def allowed(self):
        return self.mask

    def advance(self, token: int) -> None:
        self.seen.append(token)


@SLABS
def test_a_constrained_row_samples_on_its_own_beside_greedy_rows(llama, slabs):
    ps = prompts(llama, (30, 12, 50), seed=9)
    make = lambda c=None: [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, constraint=c),   # noqa: E731
                           SamplingParams(max_tokens=20)]
    want = [alone(llama, SMALL, p, sp)[0] for p, sp in zip(ps, make(EvenIds(llama.vocab_size)))]
    params = make(EvenIds(llama.vocab_size))
    got, _, _ = batched(llama, SMALL, ps, params, slabs=slabs)
    assert got == want
    assert all(t % 2 == 0 for t in got[1]) and params[1].constraint.seen == got[1]
    assert any(t % 2 for t in got[0] + got[2]), "the other rows were not constrained"


@SLABS
def test_recall_rows_page_out_as_alone(llama, slabs):
    """Rows with recall on: the long ones recall at their turn's start (fed alone by the first
    step) and page out their own evictions during the batch; the short one never evicts."""
    ps = prompts(llama, (300, 180, 12), seed=4)
    params = [SamplingParams(max_tokens=70), SamplingParams(max_tokens=45), SamplingParams(max_tokens=20)]
    got_tokens, _, caches = batched(llama, RECALL_CFG, ps, params, slabs=slabs)
    for p, sp, tokens, cache in zip(ps, params, got_tokens, caches):
        want_tokens, _, want = alone(llama, RECALL_CFG, p, sp)
        assert tokens == want_tokens
        assert len(cache.recall_log) == len(want.recall_log) == (len(p) > 100)
        if len(p) < 100:
            continue
        assert_same_heap(want, cache)
        for c in (cache, want):
            c.writer.drain()
        assert cache.pages.tokens == want.pages.tokens > 0
        for layer in range(len(cache.heap_layers)):
            for a, b in zip(load_all(cache.pages, layer), load_all(want.pages, layer)):
                np.testing.assert_allclose(a, b, atol=1e-5)


def kit(backend) -> BatchKit:
    return BatchKit(backend, start_row, step_rows, end_row, prompts, alone, assert_same_heap)


@SLABS
def test_recall_picks_on_another_thread_while_the_batch_steps_as_alone(llama, monkeypatch, slabs):
    check_picks_beside_the_batch(kit(llama), monkeypatch, slabs)


def test_a_row_ended_while_its_recall_picks_waits_for_the_pick_and_drops_it(llama, monkeypatch):
    check_row_ended_mid_pick(kit(llama), monkeypatch)


@pytest.mark.parametrize("cfg", [SMALL, RECALL_CFG], ids=["snapkv", "recall"])
def test_prefill_chunks_riding_in_the_step_feed_as_alone(demo, cfg):
    """Two documents' chunks ride packed with two decoding rows (a last step with no row left):
    each document's heap, scores and pages end as its chunks fed alone; the rows' tokens too."""
    docs = prompts(demo, (300, 230), seed=7)
    chunks = [[d[i:i + 24] for i in range(0, len(d), 24)] for d in docs]
    solos = [demo.new_cache(cfg) for _ in docs]
    for solo, cs in zip(solos, chunks):
        for c in cs:
            demo.prefill(solo, c)
    chat = prompts(demo, (10, 50), seed=8)
    rows = [start_row(demo.model, demo.new_cache(SMALL), p, SamplingParams(max_tokens=100)) for p in chat]
    readers = [demo.new_cache(cfg) for _ in docs]
    tokens = [[r.token] for r in rows]
    for step in range(len(chunks[0])):
        riding = [(reader, cs[step]) for reader, cs in zip(readers, chunks) if step < len(cs)]
        stepping = rows if step + 1 < len(chunks[0]) else []
        assert step_rows(demo.model, stepping, riding) == [None] * (len(stepping) + len(riding))
        for t, r in zip(tokens, stepping):
            t.append(r.token)
    for solo, reader in zip(solos, readers):
        assert reader.heap_layers[0].heap.evictions > 0
        assert_same_heap(solo, reader, atol=0)
        if cfg.recall:
            for c in (solo, reader):
                c.writer.drain()
            assert reader.pages.tokens == solo.pages.tokens > 0
            for layer in range(len(reader.heap_layers)):
                for a, b in zip(load_all(reader.pages, layer), load_all(solo.pages, layer)):
                    np.testing.assert_array_equal(a, b)
    for t, p in zip(tokens, chat):
        assert t == alone(demo, SMALL, p, SamplingParams(max_tokens=len(t)))[0]


def test_a_row_that_cannot_make_room_leaves_the_others_untouched(demo, monkeypatch):
    ps = prompts(demo, (40, 60), seed=2)
    params = SamplingParams(max_tokens=30)
    rows = [start_row(demo.model, demo.new_cache(SMALL), p, params) for p in ps]
    broken = rows[0].cache

    def fail(n):
        raise OSError("page writer: disk full")

    monkeypatch.setattr(broken, "room_plan", fail)
    seen = broken.tokens_seen
    tokens = [rows[1].token]
    for _ in range(29):
        errors = step_rows(demo.model, rows)
        assert isinstance(errors[0], OSError) and errors[1] is None
        tokens.append(rows[1].token)
    assert broken.tokens_seen == seen
    assert tokens == alone(demo, SMALL, ps[1], params)[0]


@SLABS
@pytest.mark.parametrize("cfg", [SMALL, RECALL_CFG], ids=["snapkv", "recall"])
def test_eviction_events_on_one_step_are_evaluated_together(llama, monkeypatch, cfg, slabs):
    """Rows of one length evict on the same steps: their events are staged, evaluated together and
    finished each on its own heap (never a heap's own repack), with pages and heaps as alone."""
    ps = prompts(llama, (150, 150, 150), seed=6)
    params = [SamplingParams(max_tokens=60)] * 3
    want = [alone(llama, cfg, p, sp) for p, sp in zip(ps, params)]
    rows = [start_row(llama.model, llama.new_cache(cfg), p, sp) for p, sp in zip(ps, params)]
    finished = []
    real = HeapPromptCache.finish_repack
    monkeypatch.setattr(HeapPromptCache, "finish_repack", lambda self, s: (finished.append(id(self)), real(self, s)))
    monkeypatch.setattr(HeapPromptCache, "repack", lambda self, plan: pytest.fail("a heap evaluated its own event"))
    tokens, together = [[r.token] for r in rows], 0
    for _ in range(59):
        finished.clear()
        assert step_rows(llama.model, rows, slabs=slabs) == [None] * 3
        together = max(together, len(set(finished)))
        for t, r in zip(tokens, rows):
            t.append(r.token)
    assert together == 3, "three heaps' events in one step"
    for (want_tokens, _, want_cache), got, row in zip(want, tokens, rows):
        assert got == want_tokens
        assert_same_heap(want_cache, row.cache)
        if cfg.recall:
            for c in (want_cache, row.cache):
                c.writer.drain()
            assert row.cache.pages.tokens == want_cache.pages.tokens > 0


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_the_slab_off_mlx_formulation_fused_sdpa_and_side_pass(llama, monkeypatch, policy):
    """Where explicit attention is not mlx's own (Metal), a session alone runs the fused sdpa and a
    side pass for its scores, and so does the slab, batched and masked: forced here on the CPU."""
    from localheap.backends.mlx import attention
    monkeypatch.setattr(attention, "explicit_matches_stock", lambda *args: False)
    ps = prompts(llama, (40, 64, 50), seed=15)
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=26), SamplingParams(max_tokens=24)]
    cfg = SMALL.with_(policy=policy, h2o_normalize=policy == "h2o")
    want = [alone(llama, cfg, p, sp) for p, sp in zip(ps, params)]
    got_tokens, got_lps, caches = batched(llama, cfg, ps, params, slabs={})
    for (tokens, lps, cache), got, got_lp, got_cache in zip(want, got_tokens, got_lps, caches):
        assert got == tokens
        assert max_diff(lps, got_lp) <= LOGPROBS_ATOL
        assert cache.heap_layers[0].heap.evictions > 0
        assert_same_heap(cache, got_cache)


def test_slab_rows_sit_out_join_and_leave_as_alone(demo, tmp_path):
    """Rows that sit out steps leave the slab (a middle row: the last one moves into its place)
    and join again; the rows still in keep stepping untouched; an empty slab frees its buffers.
    A seated heap saves as it loads back once it has left."""
    ps = prompts(demo, (20, 70, 33, 110), seed=11)
    rows = [start_row(demo.model, demo.new_cache(SMALL), p, SamplingParams(max_tokens=40)) for p in ps]
    got, slabs = [[r.token] for r in rows], {}
    out = {1: range(5, 12), 0: range(8, 10), 3: range(20, 39)}   # row -> the steps it sits out
    for step in range(39):
        live = [r for i, r in enumerate(rows) if step not in out.get(i, ())]
        assert step_rows(demo.model, live, slabs=slabs) == [None] * len(live)
        slab = next(iter(slabs.values()))
        assert [id(c) for c in slab.members] and {id(c) for c in slab.members} == {id(r.cache) for r in live}
        assert all(c.heap_layers[0].seat.r == i for i, c in enumerate(slab.members)), "rows stay dense"
        for i, r in enumerate(rows):
            if r in live:
                got[i].append(r.token)
    saved = []
    for i, r in enumerate(rows):
        if r.cache.heap_layers[0].seat is not None:
            demo.save_cache(r.cache, tmp_path / f"{i}.safetensors")
            saved.append(i)
        leave_slab(r.cache)
    assert not next(iter(slabs.values())).buffers, "an empty slab frees its buffers"
    assert len(saved) == 3
    for i in saved:
        assert_same_heap(demo.load_cache(SMALL, tmp_path / f"{i}.safetensors"), rows[i].cache, atol=0)
    for p, tokens, r in zip(ps, got, rows):
        want_tokens, _, want = alone(demo, SMALL, p, SamplingParams(max_tokens=len(tokens)))
        assert tokens == want_tokens
        assert_same_heap(want, r.cache)


def test_two_slabs_and_a_lone_heap_in_one_step_as_alone(demo):
    """Heaps of two configs sit in a slab each, and a geometry heap (query statistics: no slab)
    attends on its own, all in one forward: each row's tokens and heap as alone."""
    h2o = SMALL.with_(budget=40, policy="h2o", h2o_normalize=True)
    cfgs = [SMALL, h2o, SMALL, h2o, SMALL.with_(policy="geometry")]
    ps = prompts(demo, (40, 90, 60, 120, 70), seed=14)
    params = SamplingParams(max_tokens=30)
    rows = [start_row(demo.model, demo.new_cache(c), p, params, defer=True) for c, p in zip(cfgs, ps)]
    slabs, got = {}, [[] for _ in rows]
    for _ in range(30):
        assert step_rows(demo.model, rows, slabs=slabs) == [None] * len(rows)
        for t, r in zip(got, rows):
            t.append(r.token)
    assert sorted(len(s.members) for s in slabs.values()) == [2, 2]
    for c, p, tokens, r in zip(cfgs, ps, got, rows):
        leave_slab(r.cache)
        want_tokens, _, want = alone(demo, c, p, params)
        assert tokens == want_tokens
        assert want.heap_layers[0].heap.evictions > 0
        assert_same_heap(want, r.cache)


def test_a_seated_heap_recalls_evicts_and_rolls_back_through_its_row(llama):
    """mlx has no views: a heap in a slab is read and written through its row. Row 0 takes a new
    turn while still seated (its recall merge and page-out), evicts, then rolls back: each heap
    ends as the same calls made on it with no slab, row by row, and the other rows never see it."""
    ps = prompts(llama, (300, 180, 40), seed=12)
    question = prompts(llama, (9,), seed=13)[0]

    def run(slabs):
        caches = [llama.new_cache(RECALL_CFG) for _ in ps]
        rows = [start_row(llama.model, c, p, SamplingParams(max_tokens=10**6), defer=True) for c, p in zip(caches, ps)]
        tokens = [[] for _ in rows]

        def steps(n):
            for _ in range(n):
                groups = [rows] if slabs is not None else [[r] for r in rows]   # no slab: each row alone
                for group in groups:
                    assert step_rows(llama.model, group, slabs=slabs) == [None] * len(group)
                for t, r in zip(tokens, rows):
                    t.append(r.token)

        steps(12)
        rows[0] = start_row(llama.model, caches[0], question, SamplingParams(max_tokens=10**6), defer=True)
        steps(40)
        seated = slabs is not None and all(layer.seat is not None for c in caches for layer in c.heap_layers)
        floor = caches[0].rollback_floor()
        assert floor < caches[0].tokens_seen - 1
        caches[0].truncate(max(floor, caches[0].tokens_seen - 5))
        steps(6)
        for c in caches:
            leave_slab(c)
            c.writer.drain()
        return tokens, caches, seated

    want_tokens, want, _ = run(None)
    got_tokens, got, seated = run({})
    assert seated, "every heap was in the slab throughout"
    assert len(got[0].recall_log) == len(want[0].recall_log) == 2 and got[0].recall_log[1]["tokens"] > 0
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        assert_same_heap(b, a, atol=0)
        assert a.pages.tokens == b.pages.tokens
        for layer in range(len(a.heap_layers)):
            for x, y in zip(load_all(a.pages, layer), load_all(b.pages, layer)):
                np.testing.assert_array_equal(x, y)


def test_batch_step_bench_tables(llama):
    """bench batch-step on MLX: a row per batch size and per mixed chunk, in process CPU time."""
    from localheap.bench.batch_step import beside_table, rows_table

    cfg = HeapConfig(budget=64, sinks=4, recent=16, slack=16, prefill_chunk=48)
    rows = rows_table(llama, cfg, 100, [1, 2, 3], steps=3, repeats=2)
    assert [r["rows"] for r in rows] == [1, 2, 3] and rows[0]["vs_one"] == 1.0
    assert all(r["step_ms"] > 0 for r in rows)
    side = beside_table(llama, cfg, 100, [8, 16], repeats=1)
    assert [r["chunk"] for r in side] == [8, 16]
    assert all(0 < r["chat_kept"] and 0 < r["doc_kept"] for r in side)


@SLABS
@pytest.mark.parametrize("family", ["phi3", "glm4", "glm4_moe"])
def test_partial_rotary_sessions_in_the_batch_equal_alone(model_dirs, family, slabs):
    """phi3 (q, k, v in one projection; RoPE on 3/4 of a head), glm4 (half a head, interleaved
    pairs) and glm4_moe (half a head in split halves; experts): rows evicting at different steps
    give the tokens, logprobs and heaps they give alone."""
    backend = MLXBackend.load(model_dirs(family))
    ps = prompts(backend, (9, 60, 110), seed=3)
    params = [SamplingParams(max_tokens=m) for m in (40, 30, 20)]
    want = [alone(backend, SMALL, p, sp) for p, sp in zip(ps, params)]
    tokens, logprobs, caches = batched(backend, SMALL, ps, params, slabs=slabs)
    assert tokens == [w[0] for w in want]
    for (_, want_lp, cache), got_lp, got in zip(want, logprobs, caches):
        assert max_diff(got_lp, want_lp) <= LOGPROBS_ATOL
        assert_same_heap(cache, got)
    assert len({c.heap_layers[0].heap.evictions for c in caches} - {0}) >= 2, "rows evicted, at different steps"


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_sliding_window_sessions_decode_and_read_in_the_batch_as_alone(model_dirs, family):
    """gemma3 and gpt-oss (learned sinks): sessions whose sliding layers are mlx-lm's rotating
    cache take the batch as lone parts (each layer at its own offset), past their heap budget and
    their window; a document's chunks ride in every step over a window already full (its mask as
    alone). Tokens, logprobs, heaps and the sliding layers' K/V as alone."""
    backend = MLXBackend.load(model_dirs(family))
    assert backend.batchable(backend.new_cache(SMALL))
    ps = prompts(backend, (70, 90, 20), seed=11)
    params = [SamplingParams(max_tokens=m) for m in (30, 25, 20)]
    want = [alone(backend, SMALL, p, sp) for p, sp in zip(ps, params)]
    doc = prompts(backend, (96,), seed=13)[0]
    chunks = [doc[i:i + 12] for i in range(0, len(doc), 12)]
    reader, solo = backend.new_cache(SMALL), backend.new_cache(SMALL)
    for c in chunks:
        backend.prefill(solo, c)
    rows = [start_row(backend.model, backend.new_cache(SMALL), p, sp, defer=True) for p, sp in zip(ps, params)]
    tokens, logprobs = [[] for _ in rows], [[] for _ in rows]
    step_with_document(kit(backend), rows, params, reader, chunks, lambda r: r.logprobs, tokens, logprobs)
    for (want_tokens, want_logprobs, cache), got, row in zip(want, tokens, rows):
        assert got == want_tokens
        assert max_diff(logprobs[rows.index(row)], want_logprobs) <= LOGPROBS_ATOL
        assert_same_heap(cache, row.cache)
    assert_same_heap(solo, reader)
    assert any(r.cache.heap_layers[0].heap.evictions for r in rows), "rows evicted"
    for a_cache, b_cache in [(w[2], r.cache) for w, r in zip(want, rows)] + [(solo, reader)]:
        sliding = [(a, b) for a, b in zip(a_cache, b_cache) if not isinstance(a, HeapKVCache)]
        assert sliding
        for a, b in sliding:
            assert a.offset == b.offset > a.max_size
            for x, y in zip(a.state, b.state):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)


@pytest.mark.parametrize("cfg", [SMALL, RECALL_CFG], ids=["snapkv", "recall"])
def test_a_row_stepping_alone_runs_ahead_as_alone(llama, cfg):
    """recall_checks.check_row_runs_ahead (the engine's steps run ahead on MLX), with each step's
    logprobs as alone too, and the recall tier's pages."""
    for (_, want_logprobs, want_cache), row, logprobs in check_row_runs_ahead(kit(llama), cfg, lambda r: r.logprobs):
        assert max_diff(logprobs, want_logprobs) <= LOGPROBS_ATOL
        if cfg.recall:
            for c in (want_cache, row.cache):
                c.writer.drain()
            assert row.cache.pages.tokens == want_cache.pages.tokens
