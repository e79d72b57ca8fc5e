"""Cutting spans out of a session's heap (--cache-reuse): a client that trims old messages
resends the conversation without them, and the heap keeps what it holds of the rest, re-rotated
to the shorter history's positions (backends/slots.HeapRollback.cut). The first layer's K/V
depend only on each token and its position, so there the cut heap must hold what reading the
shorter history gives; deeper layers still carry what the cut tokens added to them."""

import numpy as np
import pytest

from localheap.heap import HeapConfig
from test_mark import _backend, heads_evicted_apart

FULL = HeapConfig(budget=1024, slack=64, recent=64, recall=False)


def test_a_cut_keeps_each_heads_tokens_in_the_spans_renumbered_end_to_end():
    heap = heads_evicted_apart()   # 0-109, the heads holding different tokens
    spans = [(0, 30), (70, 100)]   # the client dropped 30-69 and the last 10
    inside = [((p < 30) | ((p >= 70) & (p < 100))).sum() for p in heap.positions[:, :heap.resident]]
    plan, dropped = heap.keep_plan(spans, np.tile(np.arange(heap.resident, dtype=float), (2, 1)))
    kept = np.take_along_axis(heap.positions[:, :heap.resident], plan.keep_indices, axis=1)
    assert plan.keep == min(inside) and dropped == max(inside) - min(inside)
    assert ((kept < 30) | ((kept >= 70) & (kept < 100))).all() and (kept[:, :4] == np.arange(4)).all()
    assert (plan.deltas == np.arange(plan.keep) - plan.keep_indices).all()   # compact: slot j from slot i
    heap.apply(plan, evicting=False)
    assert heap.renumber(spans) == 60 == heap.seen == heap.repacked_at
    new = heap.positions[:, :heap.resident]
    assert (np.diff(new, axis=1) > 0).all() and new.max() < 60
    assert (new == np.where(kept < 30, kept, kept - 40)).all()
    assert heap.rope_offset() == heap.resident   # the next token follows the kept ones


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_the_first_layer_after_a_cut_is_what_reading_the_shorter_history_gives(model_dirs, torch_one_thread, kind):
    backend, steps = _backend(kind, model_dirs("llama"))
    ids = backend.tokenizer.encode(" ".join(f"message {i} says the heap keeps what matters" for i in range(30)))[:200]
    spans = [(0, 20), (90, 180)]
    short = ids[:20] + ids[90:180]

    cut = backend.new_cache(FULL)
    backend.prefill(cut, ids)
    assert backend.cuttable(cut)
    assert backend.cut(cut, spans) == len(short) == backend.tokens_in_cache(cut)
    fresh = backend.new_cache(FULL)
    backend.prefill(fresh, short)

    def first_layer(cache):
        layer = cache.heap_layers[0]
        n = layer.heap.resident
        return np.asarray(layer.keys[0, :, :n]).astype(np.float64), np.asarray(layer.values[0, :, :n])

    (k_cut, v_cut), (k_fresh, v_fresh) = first_layer(cut), first_layer(fresh)
    assert np.array_equal(v_cut, v_fresh)   # values are copied, not recomputed
    assert np.abs(k_cut - k_fresh).max() < 1e-4 * max(1.0, np.abs(k_fresh).max())   # re-rotated keys
    assert cut.heap_layers[0].heap.positions[:, :len(short)].tolist() == [list(range(len(short)))] * 2
    # deeper layers are not the fresh read's (the cut tokens shaped them), yet the heap runs on
    got = steps(cut, [ids[180]], 8)
    assert backend.tokens_in_cache(cut) == len(short) + 8 and len(got) == 8


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_cut_with_recall_keeps_the_kept_runs_pages_at_their_new_places_and_goes_on(model_dirs, torch_one_thread,
                                                                                    tmp_path, kind):
    """With recall on, the tokens of the kept runs that the heap had evicted stay in the page store,
    read back at their places in the shorter history with their own K/V (the keys are kept before
    RoPE: nothing to re-rotate); the cut tokens are never read back. The heap then evicts into the
    store and recalls again, its positions ascending and apart from the pages'."""
    from test_pages import _by_position

    backend, steps = _backend(kind, model_dirs("llama"))
    cfg = HeapConfig(budget=96, sinks=4, recent=16, slack=32, policy="snapkv", recall=True, recall_budget=32, page_size=8,
                     page_format="f32", obs_window=8)
    ids = backend.tokenizer.encode(" ".join(f"line {i} of a long talk about heaps" for i in range(80)))[:500]
    cache = backend.new_cache(cfg, pages_dir=tmp_path / "pages")
    backend.prefill(cache, ids[:400])
    steps(cache, ids[400:401], 4)   # a question: recall runs and pins pages
    cache.writer.drain()
    assert cache.pages.pages > 0 and any(layer.heap.n_recalled for layer in cache.heap_layers)
    held = backend.tokens_in_cache(cache)
    layers = range(len(cache.heap_layers))
    before = [_by_position(cache.pages, i) for i in layers]
    assert backend.cut(cache, [(0, 100), (300, held)]) == held - 200
    assert cache.cuts == 1
    for layer in cache.heap_layers:
        pos = layer.heap.positions[:, :layer.heap.resident]
        assert (np.diff(pos, axis=1) > 0).all() and pos.max() < held - 200 and not layer.heap.n_recalled
    kept_run = 0
    for i in layers:
        after = _by_position(cache.pages, i)
        moved = {(h, p if p < 100 else p - 200): key for (h, p), key in before[i].items() if p < 100 or p >= 300}
        assert after and all(moved[x] == key for x, key in after.items())   # its own K/V, at its new place
        kept_run += sum(p >= 100 for _, p in after)
        live = np.flatnonzero(cache.pages.layers[i].live)
        read = cache.pages.positions(i, live)
        assert (read < held - 200).all()
    assert kept_run > 0   # the kept run's evicted tokens are still in the store
    got = steps(cache, ids[401:410], 40)   # feeds, evicts into the store again, recalls
    assert len(got) == 40 and backend.tokens_in_cache(cache) == held - 200 + 9 + 39
    assert any(layer.heap.n_recalled for layer in cache.heap_layers)


def test_a_cache_with_absolute_positions_is_not_cuttable(model_dirs, torch_one_thread):
    torch = pytest.importorskip("torch")
    from localheap.backends.torch import TorchBackend

    backend = TorchBackend.load(model_dirs("llama"), device="cpu", dtype=torch.float32)
    assert not backend.cuttable(backend.new_cache(HeapConfig(budget=1024, positions="absolute", recall=False)))


def _window(kind, cache):
    """The first sliding layer's keys and values [H, n, D] in the order of their tokens."""
    layer = cache.stock_layers()[0]
    if kind == "torch":
        return np.asarray(layer.keys[0], np.float64), np.asarray(layer.values[0], np.float64)
    return (np.array(layer._temporal_order(layer.keys)[0]).astype(np.float64),
            np.array(layer._temporal_order(layer.values)[0]).astype(np.float64))


@pytest.mark.parametrize("kind", ["torch", "mlx"])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text"])
def test_a_sliding_layer_is_left_as_it_is_where_its_window_lies_in_the_last_span(model_dirs, torch_one_thread, kind,
                                                                                  family):
    """gpt-oss and gemma3: a sliding layer runs at its own absolute positions, so a cut whose last
    span holds its window leaves it as it is. In the first layer (whose K/V depend on each token
    and its position alone) the window then holds what reading the shorter history gives, at
    positions shifted by the tokens cut (RoPE: the same keys relative to each other, so the same
    attention for the next query, which sits at the layer's own position)."""
    from localheap.sessions import RollbackRefused

    backend, steps = _backend(kind, model_dirs(family))
    ids = backend.tokenizer.encode(" ".join(f"message {i} says the heap keeps what matters" for i in range(30)))[:200]
    spans = [(0, 20), (90, 200)]
    short = ids[:20] + ids[90:200]
    cut = backend.new_cache(FULL)
    backend.prefill(cut, ids)
    assert backend.cuttable(cut)
    k0, v0 = _window(kind, cut)
    for bad in ([(0, 20), (90, 199)],          # ends short of where the window stands (and no mark there)
                [(0, 20), (90, 110), (180, 200)]):   # its last span shorter than the window
        with pytest.raises(RollbackRefused):
            backend.cut(cut, bad)
        assert backend.tokens_in_cache(cut) == 200   # the cache as it was
    assert backend.cut(cut, spans) == len(short) == backend.tokens_in_cache(cut)
    k1, v1 = _window(kind, cut)
    assert np.array_equal(k0, k1) and np.array_equal(v0, v1)   # left as it was
    fresh = backend.new_cache(FULL)
    backend.prefill(fresh, short)
    kf, vf = _window(kind, fresh)
    n = min(v1.shape[1], vf.shape[1])   # (mlx-lm's rotating cache may hold a chunk's worth more, masked)
    assert n >= cut.stock_window(cut.stock_layers()[0]) - 1
    k1, v1, kf, vf = k1[:, -n:], v1[:, -n:], kf[:, -n:], vf[:, -n:]
    assert np.abs(v1 - vf).max() < 1e-3 * max(1.0, np.abs(vf).max())
    gram, gram_fresh = k1 @ np.swapaxes(k1, 1, 2), kf @ np.swapaxes(kf, 1, 2)   # keys against each other
    assert np.abs(gram - gram_fresh).max() < 1e-3 * max(1.0, np.abs(gram_fresh).max())
    got = steps(cut, [ids[0]], 8)   # the heap runs on
    assert backend.tokens_in_cache(cut) == len(short) + 8 and len(got) == 8


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_cut_that_ends_at_the_mark_brings_the_sliding_layers_back_there(model_dirs, torch_one_thread, kind):
    """A trimmed history whose last run ends where the latest reply began (a reasoning model whose
    past analysis the template drops): the sliding layers come back to the mark, the heap layers
    keep the spans, and the next turn runs on."""
    backend, steps = _backend(kind, model_dirs("gpt_oss"))
    ids = backend.tokenizer.encode(" ".join(f"message {i} says the heap keeps what matters" for i in range(30)))[:200]
    cache = backend.new_cache(FULL)
    backend.prefill(cache, ids[:-1])
    cache.mark()
    k_mark, v_mark = _window(kind, cache)
    steps(cache, ids[-1:], 12)   # the reply
    assert backend.tokens_in_cache(cache) == 200 + 11
    assert backend.cut(cache, [(0, 20), (90, 199)]) == 129 == backend.tokens_in_cache(cache)
    k, v = _window(kind, cache)
    assert np.array_equal(k, k_mark) and np.array_equal(v, v_mark)
    assert backend.rollback_mark(cache) is None   # the mark is spent
    got = steps(cache, ids[199:200], 6)
    assert len(got) == 6 and backend.tokens_in_cache(cache) == 129 + 6


# -- which prompt is a trimmed history (pure matching, fake sessions) ------------------------------

def _session(history: str, reply_start=None, cuttable=True):
    from localheap.sessions import Session
    from localheap.sessions.session import token_array

    s = Session(id="s", cfg=FULL, fed=token_array([ord(c) for c in history]))
    s.rollback_floor, s.reply_start, s.cuttable = len(history), reply_start, cuttable
    return s


def _match(sessions, text: str, min_chunk: int = 8):
    from localheap.sessions import Prompt, match_session

    return match_session(sessions, Prompt([ord(c) for c in text], text), lambda t: [ord(c) for c in t],
                         lambda ids: "".join(map(chr, ids)), min_chunk=min_chunk)


SYS = "<sys>be brief</sys>"
TURNS = ["<u>first question here</u><a>first answer given</a>", "<u>second question asked</u><a>second reply</a>",
         "<u>third question now</u><a>third answer back</a>"]


def test_a_history_without_its_oldest_turn_cuts_the_session_to_what_the_prompt_keeps():
    s = _session(SYS + "".join(TURNS))
    m = _match([s], SYS + TURNS[1] + TURNS[2] + "<u>fourth</u><a>")
    # the shared prefix runs into the next turn's "<u>", then one run from the second turn's text on
    assert m.session is s and m.rollback is None and m.cut == [(0, len(SYS) + 3), (len(SYS) + len(TURNS[0]) + 3, len(s.fed))]
    assert m.cached == len(SYS) + len(TURNS[1]) + len(TURNS[2])
    assert "".join(chr(t) for t in m.new_tokens) == "<u>fourth</u><a>"
    s.cut(m.cut)
    assert "".join(map(chr, s.fed)) == SYS + TURNS[1] + TURNS[2]


def test_a_trim_in_the_middle_takes_two_runs_and_a_rewritten_last_reply_ends_the_last():
    s = _session(SYS + "".join(TURNS) + "<think>hmm</think>fine", reply_start=len(SYS + "".join(TURNS)))
    m = _match([s], SYS + TURNS[0] + TURNS[2] + "fine<u>more</u><a>")
    head = len(SYS + TURNS[0]) + 3   # through the next turn's "<u>"
    assert m.cut == [(0, head), (head + len(TURNS[1]), s.reply_start)]   # the reasoning dropped: up to the reply
    assert m.cached == head + len(TURNS[2]) - 3 and "".join(map(chr, m.new_tokens)) == "fine<u>more</u><a>"


def test_with_sliding_layers_a_last_run_that_ends_inside_the_reply_ends_where_it_began():
    """gpt-oss re-renders its past reply with <|end|> where it sampled <|return|>: the run goes
    into the reply and stops short of its end. A heap alone keeps that much; with sliding layers
    (cut_at_reply) the run ends where the reply began, and the reply is read again."""
    reply = "<a>the answer</a>$"
    history = SYS + "".join(TURNS) + reply
    sent = SYS + TURNS[1] + TURNS[2] + reply[:-1] + "#<u>next</u><a>"
    start = len(SYS + "".join(TURNS))
    heap_only = _match([_session(history, reply_start=start)], sent)
    assert heap_only.cut[-1][1] == len(history) - 1   # all of the reply but its last token
    s = _session(history, reply_start=start)
    s.cut_at_reply = True
    m = _match([s], sent)
    assert m.cut[:-1] == heap_only.cut[:-1] and m.cut[-1] == (heap_only.cut[-1][0], start)
    assert m.cached == sum(b - a for a, b in m.cut) and "".join(map(chr, m.new_tokens)) == reply[:-1] + "#<u>next</u><a>"


def test_no_cut_without_the_flag_for_short_runs_for_a_prompt_that_drops_the_latest_turn_or_for_a_named_session():
    s = _session(SYS + "".join(TURNS))
    trimmed = SYS + TURNS[1] + TURNS[2] + "<u>fourth</u><a>"
    assert _match([s], trimmed, min_chunk=0) is None   # off: nothing shared beyond the system prompt worth a rollback
    assert _match([s], trimmed, min_chunk=200) is None   # the runs are shorter than asked
    assert _match([s], SYS + TURNS[1] + "<u>fourth</u><a>") is None   # the latest turn is not in it: not this talk
    s.addressed = True
    assert _match([s], trimmed) is None
    assert _match([_session(SYS + "".join(TURNS), cuttable=False)], trimmed) is None


def test_a_prompt_that_extends_the_session_is_never_cut():
    s = _session(SYS + "".join(TURNS))
    m = _match([s], SYS + "".join(TURNS) + "<u>more</u><a>")
    assert m.cut is None and m.cached == len(s.fed)


def test_a_turn_that_fails_after_a_cut_falls_back_to_the_saved_copy_and_its_own_tokens(model_dirs, torch_one_thread,
                                                                                       tmp_path):
    """The saved copy holds the uncut history: a failed turn after a cut goes back to it whole (its
    tokens read from disk, not the cut ones cut short), and the index keeps the copy's own CRC."""
    import json
    import zlib

    from localheap.engine import branching
    from localheap.sessions import SessionStore
    from localheap.sessions.session import token_array

    backend, _ = _backend("torch", model_dirs("llama"))
    store = SessionStore(backend, FULL, tmp_path, durable=True, cache_reuse=8)
    ids = backend.tokenizer.encode(" ".join(f"message {i} says the heap keeps what matters" for i in range(30)))[:200]
    s = store.create()
    store.make_resident(s)
    backend.prefill(s.cache, ids)
    s.extend(ids)
    branching.settle(backend, s)
    store.save(s)
    assert s.cuttable and s.saved and s.saved_crc == zlib.crc32(s.fed.tobytes())
    branching.cut(backend, s, [(0, 20), (90, 200)], store)
    assert len(s.fed) == 130 and backend.tokens_in_cache(s.cache) == 130 and not s.saved and store.cuts == 1
    other = store.create()   # another session's save rewrites the index: this one's entry keeps its saved CRC
    store.make_resident(other)
    backend.prefill(other.cache, ids[:30])
    other.extend(ids[:30])
    store.save(other)
    entry = next(e for e in json.loads((tmp_path / "index.json").read_text())["sessions"] if e["id"] == s.id)
    assert entry["tokens"] == 200 and entry["crc"] == zlib.crc32(token_array(ids).tobytes())
    assert store.rollback(s, fed_before=len(s.fed))   # the turn after the cut failed
    assert s.fed.tolist() == ids and s.cache is None
    store.make_resident(s)
    assert backend.tokens_in_cache(s.cache) == 200


def test_a_cut_heap_with_recall_is_saved_spilled_and_restored_as_it_was(model_dirs, torch_one_thread, tmp_path):
    from localheap.engine import branching
    from localheap.sessions import SessionStore

    backend, steps = _backend("torch", model_dirs("llama"))
    cfg = HeapConfig(budget=96, sinks=4, recent=16, slack=32, policy="snapkv", recall=True, recall_budget=32,
                     page_size=8, page_format="f32", obs_window=8)
    store = SessionStore(backend, cfg, tmp_path, cache_reuse=8)
    ids = backend.tokenizer.encode(" ".join(f"line {i} of a long talk about heaps" for i in range(80)))[:500]
    s = store.create()
    store.make_resident(s)
    backend.prefill(s.cache, ids[:400])
    s.extend(ids[:400])
    branching.settle(backend, s)
    store.save(s)
    branching.cut(backend, s, [(0, 100), (300, 400)], store)
    before = backend.stats(s.cache).to_dict()
    store.spill(s.id)
    assert s.cache is None and s.saved_tokens == 200
    store.restore(s.id)
    assert backend.stats(s.cache).to_dict() == before and backend.tokens_in_cache(s.cache) == 200
    got = steps(s.cache, ids[400:410], 20)   # a question: recall over what the store kept, then decode
    assert len(got) == 20 and backend.tokens_in_cache(s.cache) == 229


def test_with_the_flag_a_dropped_reasoning_block_is_cut_out_and_the_answer_kept():
    """Any run of at least min_chunk tokens counts: a template that drops the reply's reasoning sends
    the answer back, which the session holds after the reasoning: cut out, not rewound and read again."""
    history = SYS + "".join(TURNS)
    answer = "the heap keeps the tokens that matter"
    s = _session(history + "<think>let me think this through</think>" + answer, reply_start=len(history))
    s.rollback_mark = len(history)   # where the reply began
    m = _match([s], history + answer + "<u>next</u><a>")
    assert m.cut == [(0, len(history)), (len(s.fed) - len(answer), len(s.fed))]
    assert m.cached == len(history + answer)
    m = _match([s], history + answer + "<u>next</u><a>", min_chunk=0)   # off: a rollback to the reply's start
    assert m.cut is None and m.rollback == len(history)


def test_a_session_read_back_at_start_rolls_back_and_is_cut_as_before_the_restart(model_dirs, torch_one_thread,
                                                                                  tmp_path):
    """The index keeps where a saved copy rolls back to and whether it can be cut: before, a session
    read back at start had neither until it had run a turn, so its first trimmed (or regenerated)
    turn read the whole history again."""
    from localheap.engine import branching
    from localheap.sessions import Prompt, SessionStore, match_session

    backend, _ = _backend("torch", model_dirs("llama"))
    store = SessionStore(backend, FULL, tmp_path, durable=True)
    ids = backend.tokenizer.encode(" ".join(f"message {i} says the heap keeps what matters" for i in range(30)))[:200]
    s = store.create()
    store.make_resident(s)
    backend.prefill(s.cache, ids)
    s.extend(ids)
    branching.settle(backend, s, reply_start=180)   # as after a turn whose reply began at 180
    store.save(s)
    again = SessionStore(backend, FULL, tmp_path, durable=True)
    assert again.load_persisted(store.model_id) == 1
    r = again.get(s.id)
    assert r.cache is None and (r.rollback_floor, r.reply_start, r.cuttable) == (s.rollback_floor, 180, True)
    same = lambda ids: ids   # noqa: E731 - (no text: encode and decode are not called)
    regenerated = Prompt(ids[:180] + ids[:3])   # the last reply regenerated: a rollback to where it began
    m = match_session([r], regenerated, same, same)
    assert m.session is r and m.rollback == 180 and m.cut is None
    trimmed = Prompt(ids[:20] + ids[90:200] + ids[:3])   # (a repetitive text: the longest run is taken)
    m = match_session([r], trimmed, same, same, min_chunk=8)
    assert m.session is r and m.cut == [(0, 20), (90, 200)]
    again.make_resident(r)
    branching.cut(backend, r, m.cut, again)
    assert backend.tokens_in_cache(r.cache) == 130 == len(r.fed)


def test_a_stale_rollback_point_or_cut_flag_is_refused_with_the_heap_as_it_was(model_dirs, torch_one_thread):
    """What an index said (rollback_floor, cuttable) is a hint: the heap's own points decide, and a
    point it cannot reach is a RollbackRefused (the prompt is then read into a new session)."""
    from localheap.engine import branching
    from localheap.sessions import RollbackRefused, Session

    backend, _ = _backend("torch", model_dirs("llama"))
    ids = backend.tokenizer.encode(" ".join(f"message {i} says the heap keeps what matters" for i in range(30)))[:200]
    s = Session(id="s", cfg=FULL)
    s.cache = backend.new_cache(HeapConfig(budget=64, slack=32, recent=16, recall=False, rewind=False))
    backend.prefill(s.cache, ids)
    s.extend(ids)
    floor = backend.rollback_floor(s.cache)
    assert floor > 50
    s.rollback_floor = 0   # stale
    with pytest.raises(RollbackRefused):
        branching.roll_back(backend, s, 50)
    s.cache.cfg = s.cache.cfg.with_(positions="absolute")   # as a heap that cannot be cut
    with pytest.raises(RollbackRefused):
        branching.cut(backend, s, [(0, 20), (90, 200)])
    assert backend.tokens_in_cache(s.cache) == 200 == len(s.fed)


def test_a_kept_reply_sampled_as_other_tokens_than_its_text_gives_matches_by_text():
    """A reply sampled as tokens the tokenizer would not choose for its text: the prompt's tokens
    differ there, so no run of tokens reaches the latest reply; the session's tail from the trim on
    still decodes to text that begins the rest of the prompt's, as a whole history matches by text."""
    from localheap.sessions import Prompt, Session, match_session
    from localheap.sessions.session import token_array

    AB = 1000   # one token for "ab", which the tokenizer below never chooses
    decode = lambda ids: "".join("ab" if i == AB else chr(i) for i in ids)   # noqa: E731
    encode = lambda text: [ord(c) for c in text]   # noqa: E731
    sampled = [AB if t == "ab" else ord(t) for t in ["<", "a", ">", "w", "e", " ", "ab", "o", "u", "t", "<", "/",
                                                      "a", ">"]]   # "<a>we about</a>" with "ab" as one token
    turns = [encode(t) for t in TURNS]
    fed = encode(SYS) + turns[0] + turns[1][:-len("<a>second reply</a>")] + sampled + turns[2]
    s = Session(id="s", cfg=FULL, fed=token_array(fed))
    s.rollback_floor, s.reply_start, s.cuttable = len(fed), len(fed), True
    text = SYS + TURNS[1][:-len("<a>second reply</a>")] + "<a>we about</a>" + TURNS[2] + "<u>new</u><a>"
    m = match_session([s], Prompt(encode(text), text), encode, decode, min_chunk=8)
    start = len(SYS) + len(TURNS[0]) + 3   # the shared prefix runs into the kept turn's "<u>"
    assert m.cut == [(0, len(SYS) + 3), (start, len(fed))] and m.cached == len(fed) - len(TURNS[0])
    assert decode(m.new_tokens) == "<u>new</u><a>"
    assert match_session([s], Prompt(encode(text)), encode, decode, min_chunk=8) is None   # no text: no match
