"""What the torch, MLX and backend-neutral recall tests share: a small heap with recall on,
random prompts, and checks of a page store (numpy in, no backend); and the decode batch's checks
both backends run (BatchKit)."""

import numpy as np

from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

# f32 pages (exact); 32 of the 96 slots are the recall region, 4 pages of 8 tokens
CFG = HeapConfig(budget=96, sinks=4, recent=16, slack=32, policy="snapkv", recall=True,
                 recall_budget=32, page_size=8, page_format="f32", obs_window=8)


def prompt(backend, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, backend.vocab_size, n).tolist()


def load_all(store, layer: int):
    """Every live full page of `layer`: positions [H, n], keys (pre-RoPE), values [H, n, D]."""
    slots, *_ = store.summaries(layer)
    return store.load(layer, np.broadcast_to(slots, (store.g.n_kv_heads, len(slots))).copy())


def assert_pages_hold(store, layer: int, pos: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    """The full pages of `layer` hold exactly these evicted tokens (f32 pages: values bit for bit,
    keys within one un-rotation). pos [H, m]; keys (pre-RoPE), values [H, m, D]; m >= what is on
    disk (the partial page waits in RAM)."""
    got_pos, got_k, got_v = load_all(store, layer)
    n = got_pos.shape[1]
    assert n == len(store.summaries(layer)[0]) * store.g.page_size and n > 0
    for h in range(pos.shape[0]):
        order = np.argsort(pos[h], kind="stable")[: n]
        want_pos = pos[h][order]
        at = np.searchsorted(want_pos, got_pos[h])
        np.testing.assert_array_equal(want_pos[at], got_pos[h])
        np.testing.assert_array_equal(got_v[h], values[h][order][at])
        np.testing.assert_allclose(got_k[h], keys[h][order][at], atol=1e-6)


def assert_recorded_pages(cache, recorded, unrotate) -> None:
    """Each layer's pages hold exactly what a spy on gather_evicted recorded: rows of (layer id,
    positions [H, n], keys as rotated in their slots, values, slots); unrotate(keys, slots) gives
    the pre-RoPE keys as numpy."""
    cache.writer.drain()
    assert cache.pages.pages > 0 and recorded
    for layer_id in range(len(cache.heap_layers)):
        mine = [r for r in recorded if r[0] == layer_id]
        pos = np.concatenate([r[1] for r in mine], axis=1)
        keys = np.concatenate([unrotate(r[2], r[4]) for r in mine], axis=1)
        values = np.concatenate([np.asarray(r[3]) for r in mine], axis=1)
        assert_pages_hold(cache.pages, layer_id, pos, keys, values)


class BatchKit:
    """A backend's decode batch for the shared checks below: its functions (start_row, step_rows,
    end_row) and its test module's helpers (prompts, alone, same_heap(want, got))."""

    def __init__(self, backend, start_row, step_rows, end_row, prompts, alone, same_heap):
        self.backend, self.start_row, self.step_rows, self.end_row = backend, start_row, step_rows, end_row
        self.prompts, self.alone, self.same_heap = prompts, alone, same_heap


def held_pick(monkeypatch):
    """paging.recall_pick held until the returned event is set; the list gets each pick's thread name."""
    import threading

    from localheap.backends import paging

    go, picking, real = threading.Event(), [], paging.recall_pick

    def held(cache, recalling):
        picking.append(threading.current_thread().name)
        assert go.wait(60), "the test never let the pick go"
        return real(cache, recalling)

    monkeypatch.setattr(paging, "recall_pick", held)
    return go, picking


def check_picks_beside_the_batch(kit: BatchKit, monkeypatch, slabs=None) -> None:
    """With a picker, a prompt due a recall is probed in its step and picked on the picker's thread:
    the row waits (no token) while the others keep stepping, for as many steps as the pick takes;
    the step after it is done merges it and feeds the prompt. Each row's tokens, recall and heap
    are then what they are alone."""
    from concurrent.futures import ThreadPoolExecutor

    from localheap.generation import SamplingParams

    go, picking = held_pick(monkeypatch)
    b = kit.backend
    ps = kit.prompts(b, (300, 180, 12), seed=4)
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=20), SamplingParams(max_tokens=40)]
    rows = [kit.start_row(b.model, b.new_cache(CFG), p, sp, defer=True) for p, sp in zip(ps, params)]
    tokens = [[] for _ in rows]
    with ThreadPoolExecutor(1, thread_name_prefix="picker") as picker:
        live, steps = list(range(len(rows))), 0
        while live:
            assert kit.step_rows(b.model, [rows[i] for i in live], slabs=slabs, picker=picker) == [None] * len(live)
            steps += 1
            for i in live:
                if not rows[i].waiting:
                    tokens[i].append(rows[i].token)
            if steps == 5:   # four steps without the long prompts: only the short one advanced
                assert [len(t) for t in tokens] == [0, 0, 5] and rows[0].waiting and rows[1].waiting
                go.set()
            for i in live:
                if len(tokens[i]) == params[i].max_tokens:
                    kit.end_row(rows[i])
            live = [i for i in live if len(tokens[i]) < params[i].max_tokens]
    assert picking == ["picker_0", "picker_0"]
    if slabs:
        assert all(not slab.members for slab in slabs.values()), "every heap left"
    for p, sp, got, row in zip(ps, params, tokens, rows):
        want_tokens, _, want = kit.alone(b, CFG, p, sp)
        assert got == want_tokens
        assert [e["tokens"] for e in row.cache.recall_log] == [e["tokens"] for e in want.recall_log]
        kit.same_heap(want, row.cache)


def check_row_ended_mid_pick(kit: BatchKit, monkeypatch) -> None:
    """A run cancelled while its pick runs: end_row waits for the pick (it reads the page store) and
    drops it: nothing is merged, the prompt's question is not fed, and a later turn recalls."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from localheap.generation import SamplingParams

    go, _ = held_pick(monkeypatch)
    b = kit.backend
    row = kit.start_row(b.model, b.new_cache(CFG), kit.prompts(b, (300,), seed=5)[0], SamplingParams(max_tokens=5),
                        defer=True)
    with ThreadPoolExecutor(1) as picker:
        assert kit.step_rows(b.model, [row], picker=picker) == [None] and row.waiting
        before = b.tokens_in_cache(row.cache)   # the turn's body (all but its question) is in
        threading.Timer(0.2, go.set).start()
        kit.end_row(row)
        assert not row.waiting and row.token is None
        assert b.tokens_in_cache(row.cache) == before and row.cache.recall_log == []
        assert all(layer.heap.recalled.sum() == 0 for layer in row.cache.heap_layers)
        monkeypatch.undo()
        again = kit.start_row(b.model, row.cache, kit.prompts(b, (8,), seed=6)[0], SamplingParams(max_tokens=2),
                              defer=True)
        while kit.step_rows(b.model, [again], picker=picker) == [None] and again.waiting:
            pass
    assert again.token is not None and again.cache.recall_log[-1]["tokens"] > 0
    assert b.tokens_in_cache(again.cache) == before + 8


def step_with_document(kit: BatchKit, rows: list, params: list, reader, chunks: list, got,
                       tokens: list, records: list, steps: int = 30) -> None:
    """Step `rows` (each until its max_tokens) with one document chunk riding per step while
    chunks last, appending each row's token to `tokens[i]` and got(row) (its logits, logprobs) to
    `records[i]`; every heap attends as a lone part (sliding layers: no slab)."""
    slabs: dict = {}
    for step in range(steps):
        live = [i for i in range(len(rows)) if len(tokens[i]) < params[i].max_tokens]
        riding = [(reader, chunks[step])] if step < len(chunks) else []
        assert kit.step_rows(kit.backend.model, [rows[i] for i in live], riding, slabs=slabs) == \
            [None] * (len(live) + len(riding))
        for i in live:
            tokens[i].append(rows[i].token)
            records[i].append(got(rows[i]))
    assert not any(slab.members for slab in slabs.values()), "sliding caches attend as lone parts"


def check_row_runs_ahead(kit: BatchKit, cfg, got) -> list:
    """With `ahead` (the engine's steps) a row stepping on its own has its next step queued before
    its token is read. A second row joining at step 15 takes the batch with it (the first takes its
    queued step's token, fed in no forward again) and, once it has left, the first runs ahead
    again: tokens and heaps as alone, past evictions. end_row drops a queued step's sample, its token
    fed. `got(row)`: what each step records beside the token (logits, logprobs). Returns, per row,
    (alone's tokens, records, cache), the row and its records, for the backend's own checks."""
    model, ps = kit.backend.model, kit.prompts(kit.backend, (150, 40), seed=21)
    params = [SamplingParams(max_tokens=70), SamplingParams(max_tokens=20)]
    want = [kit.alone(kit.backend, cfg, p, sp) for p, sp in zip(ps, params)]
    rows = [kit.start_row(model, kit.backend.new_cache(cfg), ps[0], params[0], defer=True)]
    tokens, records, queued, slabs = [[], []], [[], []], 0, {}
    for step in range(70):
        if step == 15:
            rows.append(kit.start_row(model, kit.backend.new_cache(cfg), ps[1], params[1], defer=True))
        live = [(i, r) for i, r in enumerate(rows) if len(tokens[i]) < params[i].max_tokens]
        assert kit.step_rows(model, [r for _, r in live], slabs=slabs, ahead=True) == [None] * len(live)
        for i, r in live:
            tokens[i].append(r.token)
            records[i].append(got(r))
            if len(tokens[i]) == params[i].max_tokens:
                kit.end_row(r)
        queued += rows[0].ahead is not None
    assert 45 <= queued < 69, queued   # ahead alone, not beside the second row, nor after its last token
    for (want_tokens, _, want_cache), got, row in zip(want, tokens, rows):
        assert got == want_tokens
        assert row.ahead is None
        kit.same_heap(want_cache, row.cache)
    assert rows[0].cache.heap_layers[0].heap.evictions > 0
    row = kit.start_row(model, kit.backend.new_cache(cfg), kit.prompts(kit.backend, (30,), seed=22)[0],
                        SamplingParams(max_tokens=50), defer=True)
    for _ in range(10):
        assert kit.step_rows(model, [row], slabs=slabs, ahead=True) == [None]
    assert row.ahead is not None
    kit.end_row(row)
    assert row.ahead is None and row.cache.tokens_seen == 30 + 10   # the prompt, and the 10 tokens taken
    return list(zip(want, rows, records))
