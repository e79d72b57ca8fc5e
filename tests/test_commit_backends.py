"""The kill -9 of issue 28 on both backends, in process: a turn whose heap, tokens and page-store
state were written but whose index rename never happened is not in force; the session comes
back at its committed turn, with its pages as that turn left them, and answers as a session
that never saw the lost turn."""

from recall_checks import CFG, prompt
from test_recall_backends import backend_name, generate, llama  # noqa: F401 - fixtures

from localheap.sessions.store import SessionStore


def test_a_turn_written_but_never_committed_is_not_in_force(llama, tmp_path):  # noqa: F811
    first, second, third = prompt(llama, 300, seed=11), prompt(llama, 200, seed=12), prompt(llama, 40, seed=13)
    ref = llama.new_cache(CFG)
    ref_first = generate(llama, ref, first, 4)
    want = generate(llama, ref, third, 6)

    store = SessionStore(llama, CFG, spill_dir=tmp_path / "s", durable=True)
    s = store.create("sess_c")
    store.make_resident(s)
    out = generate(llama, s.cache, first, 4)
    assert out == ref_first
    s.extend(first + out[:-1])
    store.save(s)
    committed = len(s.fed)
    out = generate(llama, s.cache, second, 4)   # pages out more of the first turn's tokens
    s.extend(second + out[:-1])
    # the next save, up to (not including) the index's rename
    store.dir.write_with(store.dir.heap_path(s.id, 1), lambda tmp: llama.save_cache(s.cache, tmp))
    store.dir.write_tokens(s.id, 1, s.fed)
    pages_dir = store.pages_dir(s)
    assert sorted(p.name for p in pages_dir.glob("state.*")) == ["state.0.npz", "state.1.npz"]

    again = SessionStore(llama, CFG, spill_dir=tmp_path / "s", durable=True)
    assert again.load_persisted() == 1
    t = again.get("sess_c")
    assert len(t.fed) == committed
    assert sorted(p.name for p in pages_dir.glob("state.*")) == ["state.0.npz"]
    again.make_resident(t)
    assert generate(llama, t.cache, third, 6) == want
    again.delete("sess_c")
