"""Sessions: prefix matching, the store's spill/restore and limits (fake backend), and a
bit-identical spill/restore round trip on the MLX backend."""

from __future__ import annotations

import pytest
from test_engine import CFG, FakeBackend

from localheap.heap import HeapConfig
from localheap.sessions import Prompt, SessionBusy, SessionNotFound, SessionStore, continue_session, match_session

encode = lambda text: [ord(c) for c in text]  # noqa: E731
decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731


def prompt(text, continuation=None):
    return Prompt(encode(text), text, encode(continuation) if continuation is not None else None)


def store_with(*histories):
    store = SessionStore(FakeBackend(), CFG)
    sessions = []
    for h in histories:
        s = store.create()
        store.make_resident(s)
        s.extend(encode(h))
        s.cache.tokens = encode(h)
        sessions.append(s)
    return store, sessions


def test_longest_token_prefix_wins_and_busy_or_empty_sessions_are_skipped():
    store, (short, long, other) = store_with("abc", "abcdef", "xyz")
    store.create()   # empty: never matched implicitly
    m = match_session(store.sessions(), prompt("abcdefgh"), encode, decode)
    assert m.session is long and m.new_tokens == encode("gh") and m.cached == 6
    long.busy = True
    assert match_session(store.sessions(), prompt("abcdefgh"), encode, decode).session is short
    assert match_session(store.sessions(), prompt("abc"), encode, decode) is None   # nothing new to feed
    assert match_session(store.sessions(), prompt("nope"), encode, decode) is None


def test_text_prefix_matches_a_reply_tokenized_differently():
    store, (s,) = store_with("hi")
    s.fed.extend([ord("a") + 1000])   # a token whose text is not its re-encoding

    def odd_decode(ids):
        return "".join("ab" if i == ord("a") + 1000 else chr(i) for i in ids)

    m = match_session(store.sessions(), Prompt(encode("hiabc"), "hiabc"), encode, odd_decode)
    assert m.session is s and m.new_tokens == encode("c") and m.cached == 3


def test_explicit_session_continues_with_rest_or_continuation():
    store, (s,) = store_with("<s>user: hi")
    assert continue_session(s, prompt("<s>user: hi assistant:"), encode, decode).new_tokens == encode(" assistant:")
    m = continue_session(s, prompt("<s>user: more", continuation="user: more"), encode, decode)
    assert m.new_tokens == encode("user: more") and m.cached == len("<s>user: hi")


def resident_sessions(store, n):
    """n resident sessions holding "session i", touched in order (the first is least recent)."""
    sessions = []
    for i in range(n):
        s = store.create()
        store.make_resident(s)
        s.extend(encode(f"session {i}"))
        s.cache.tokens = encode(f"session {i}")
        store.touch(s)
        sessions.append(s)
    return sessions


def test_spill_restore_round_trip_and_limits(tmp_path):
    store = SessionStore(FakeBackend(), CFG, tmp_path, max_resident=2, max_sessions=3)
    sessions = resident_sessions(store, 3)
    store.enforce_limits()
    assert [s.state for s in sessions] == ["spilled", "resident", "resident"]
    assert store.info(sessions[0].id)["state"] == "spilled" and store.spills == 1
    store.make_resident(sessions[0])
    assert sessions[0].cache.tokens == encode("session 0") and not list(tmp_path.iterdir())
    sessions[1].busy = True
    with pytest.raises(SessionBusy):
        store.spill(sessions[1].id)
    store.create()
    store.enforce_limits()
    assert len(store) == 3   # the least recently used idle session was dropped
    with pytest.raises(SessionNotFound):
        store.get("sess_missing")


def test_mlx_spill_restore_continues_bit_identically(tmp_path):
    pytest.importorskip("mlx.core")
    from localheap.generation import SamplingParams
    from localheap.models import load_backend

    backend = load_backend("random:llama:tiny", "mlx")
    cfg = HeapConfig(budget=32, slack=16, recent=8)
    store = SessionStore(backend, cfg, tmp_path)
    ids = backend.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 8)
    greedy = SamplingParams(max_tokens=12)

    def continue_(s):
        return list(backend.generate(s.cache, ids[-3:], greedy))

    a, b = store.create(), store.create()
    for s in (a, b):
        store.make_resident(s)
        backend.prefill(s.cache, ids)
        s.extend(ids)
    store.spill(b.id)
    assert b.cache is None and b.spill_path.exists()
    store.restore(b.id)
    assert b.snapshot["heap"]["evicted"] > 0 and backend.stats(b.cache).to_dict() == backend.stats(a.cache).to_dict()
    assert continue_(a) == continue_(b)


def test_sessions_persist_across_store_instances(tmp_path):
    from test_engine import CFG, FakeBackend

    backend = FakeBackend()
    store = SessionStore(backend, CFG, spill_dir=tmp_path)
    fed = store.create()
    store.make_resident(fed)
    backend.prefill(fed.cache, [5, 6, 7])
    fed.extend([5, 6, 7])
    empty = store.create()
    assert store.persist_all("fake-model") == 2
    other = SessionStore(backend, CFG, spill_dir=tmp_path / "copy")
    for p in tmp_path.iterdir():
        if p.is_file():
            (other.spill_dir / p.name).write_bytes(p.read_bytes())
    assert other.load_persisted("other-model") == 0, "another model's sessions are not loaded"
    assert len(list((other.spill_dir / "aside").iterdir())) == 3, "but moved aside, not deleted"
    again = SessionStore(backend, CFG, spill_dir=tmp_path)
    assert again.load_persisted("fake-model") == 2
    restored = again.get(fed.id)
    assert restored.state == "spilled" and restored.fed.tolist() == [5, 6, 7]
    again.make_resident(restored)
    assert backend.tokens_in_cache(restored.cache) == 3
    assert again.get(empty.id).state == "empty"


def test_a_heap_the_disk_refuses_stays_resident_and_the_next_is_spilled(tmp_path):
    """Over max_resident, the least recently used idle heap whose save the disk refuses (its
    turn not on disk) stays resident; the next one is spilled instead. SpillFailed only when
    none can go."""
    from localheap.sessions import SpillFailed

    backend = FakeBackend()
    store = SessionStore(backend, CFG, tmp_path, max_resident=2, max_sessions=8)
    sessions = resident_sessions(store, 3)
    save = backend.save_cache

    def refuse_first(cache, path, **kw):
        if cache is sessions[0].cache:
            raise OSError(28, "No space left on device")
        return save(cache, path, **kw)

    backend.save_cache = refuse_first
    store.enforce_limits()
    assert [s.state for s in sessions] == ["resident", "spilled", "resident"]
    sessions[2].busy = True   # nothing else can go
    store.make_resident(s := store.create())
    s.extend(encode("four"))
    s.cache.tokens = encode("four")
    with pytest.raises(SpillFailed):
        store.enforce_limits(keep=s)   # s is about to run; the refused heap is the only idle one
    assert sessions[0].state == "resident"


@pytest.mark.parametrize("error", ["RankLost", "RankFailed"])
def test_a_restore_stopped_by_another_rank_keeps_the_saved_copy(tmp_path, error):
    """--distributed: a restore that fails because a rank is gone (or failed its part) says nothing
    about the files here: the saved copy stays where the index says, to be read after a restart."""
    from localheap.engine import RankFailed, RankLost

    backend = FakeBackend()
    store = SessionStore(backend, CFG, tmp_path, durable=True)
    s = resident_sessions(store, 1)[0]
    store.spill(s.id)
    saved = s.spill_path
    raised = RankLost("rank lost: rank 1 ended") if error == "RankLost" else RankFailed(1, "load", "OSError: x")

    def gone(cfg, path, pages_dir=None):
        raise raised

    backend.load_cache = gone
    with pytest.raises(type(raised)):
        store.restore(s.id)
    assert s.cache is None and s.spill_path == saved and saved.exists()
    assert not (tmp_path / "aside").exists() or not list((tmp_path / "aside").iterdir())
