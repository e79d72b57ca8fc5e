"""The sessions directory under crashes and corruption (fake backend): atomic generations
committed by the index, recovery after a kill, corrupt files moved aside, failed writes
that leave the session resident, ids validated before they become paths."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
from test_engine import CFG, FakeBackend

from localheap.sessions import SessionLost, SessionStore, SpillFailed
from localheap.sessions.disk import SessionDir


def durable(path, backend=None, **kw):
    return SessionStore(backend or FakeBackend(), CFG, path, durable=True, **kw)


def feed(store, s, tokens):
    store.make_resident(s)
    s.cache.tokens.extend(tokens)
    s.extend(tokens)
    s.dirty = True


def saved_session(store, tokens):
    s = store.create()
    feed(store, s, tokens)
    store.save(s)
    return s


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_every_save_is_committed_and_private(tmp_path):
    root = tmp_path / "sessions"
    store = durable(root)
    a = saved_session(store, [1, 2, 3])
    feed(store, a, [4, 5])
    store.save(a)   # generation 1 replaces generation 0
    names = sorted(p.name for p in root.iterdir())
    assert names == ["index.json", f"{a.id}.1.safetensors", f"{a.id}.1.tokens"]
    assert mode(root) == 0o700 and all(mode(p) == 0o600 for p in root.iterdir())
    index = json.loads((root / "index.json").read_text())
    assert index["sessions"][0]["gen"] == 1 and index["sessions"][0]["tokens"] == 5


def test_a_killed_server_comes_back_from_the_directory(tmp_path):
    """No persist_all (the process died): the index and files written along the way suffice;
    temp files, an uncommitted generation and orphans are cleaned up or adopted."""
    backend = FakeBackend()
    store = durable(tmp_path, backend)
    a = saved_session(store, [1, 2, 3])
    b = saved_session(store, [7, 8])
    empty = store.create()
    (tmp_path / f".{a.id}.1.safetensors.123.tmp").write_text("half")          # a save cut short
    (tmp_path / f"{a.id}.1.safetensors").write_text(json.dumps([1, 2, 3, 4]))   # a turn not committed
    (tmp_path / f"{a.id}.1.tokens").write_bytes(b"\x00" * 16)
    orphan = "sess_orphan0000000000000"
    (tmp_path / f"{orphan}.2.safetensors").write_text(json.dumps([9, 9]))
    (tmp_path / f"{orphan}.2.tokens").write_bytes(bytes([9, 0, 0, 0, 9, 0, 0, 0]))
    (tmp_path / "sess_half.0.tokens").write_bytes(b"")                         # no heap file: removed

    again = durable(tmp_path, backend)
    assert again.load_persisted() == 4
    assert again.get(a.id).fed.tolist() == [1, 2, 3] and again.get(b.id).fed.tolist() == [7, 8]
    assert again.get(orphan).fed.tolist() == [9, 9] and again.get(empty.id).state == "empty"
    again.make_resident(again.get(a.id))
    assert again.get(a.id).cache.tokens == [1, 2, 3]
    left = {p.name for p in tmp_path.iterdir()}
    assert not any("tmp" in n for n in left) and f"{a.id}.1.tokens" not in left and "sess_half.0.tokens" not in left
    ids = {e["id"] for e in json.loads((tmp_path / "index.json").read_text())["sessions"]}
    assert ids == {a.id, b.id, orphan, empty.id}   # the adopted orphan is committed


def test_corrupt_index_tokens_and_heap_cost_only_their_session(tmp_path, caplog):
    backend = FakeBackend()
    store = durable(tmp_path, backend)
    good, bad_tokens, bad_heap = (saved_session(store, [i, i + 1, i + 2]) for i in (1, 10, 20))
    (tmp_path / f"{bad_tokens.id}.0.tokens").write_bytes(b"\x01\x02\x03")     # not whole int32s
    (tmp_path / f"{bad_heap.id}.0.safetensors").write_text("{not json")
    again = durable(tmp_path, backend)
    assert again.load_persisted() == 2 and bad_tokens.id not in again
    assert "moved" in caplog.text and bad_tokens.id in caplog.text
    with pytest.raises(SessionLost, match="unreadable token file"):   # 410, not 404: resend the history
        again.info(bad_tokens.id)
    # the tokens are the truth: an unreadable heap is rebuilt from them (and saved again)
    again.make_resident(again.get(bad_heap.id))
    assert again.get(bad_heap.id).cache.tokens == [20, 21, 22] and again.rebuilt == 1
    assert "rebuilding" in caplog.text and again.get(bad_heap.id).saved
    again.make_resident(again.get(good.id))
    assert again.get(good.id).cache.tokens == [1, 2, 3]
    aside = {p.name.split(".")[0] for p in (tmp_path / "aside").iterdir()}
    assert aside == {bad_tokens.id, bad_heap.id}

    (tmp_path / "index.json").write_text('{"model": "fake-model", "sessions": [')   # torn by hand
    third = durable(tmp_path, backend)
    assert third.load_persisted() == 2 and good.id in third and bad_heap.id in third   # adopted from their files


def test_token_file_that_disagrees_with_the_index_is_moved_aside(tmp_path):
    store = durable(tmp_path)
    s = saved_session(store, [1, 2, 3])
    (tmp_path / f"{s.id}.0.tokens").write_bytes(bytes([5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0]))   # same length
    again = durable(tmp_path)
    assert again.load_persisted() == 0 and s.id not in again


def test_index_entries_never_become_paths(tmp_path):
    outside = tmp_path / "victim.tokens"
    outside.write_text("keep me")
    root = tmp_path / "sessions"
    store = durable(root)
    (root / "index.json").write_text(json.dumps({"model": "fake-model", "sessions": [
        {"id": "../victim", "gen": 0, "tokens": 0, "file": "../victim.safetensors"},
        {"id": "sess_ok", "gen": None, "tokens": 0, "file": "../../victim.tokens"}]}))
    assert store.load_persisted() == 1
    store.delete("sess_ok")
    assert outside.read_text() == "keep me"


def test_failed_spill_keeps_the_session_resident(tmp_path):
    backend = FakeBackend()
    store = durable(tmp_path / "s", backend, max_resident=1)
    a = saved_session(store, [1, 2])
    feed(store, a, [3])

    def full_disk(cache, path, snapshot=False):
        path.write_text("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    backend.save_cache = full_disk
    with pytest.raises(SpillFailed, match=f"cannot save sessions to {tmp_path / 's'}: No space left"):
        store.spill(a.id)
    assert a.state == "resident" and a.cache.tokens == [1, 2, 3] and a.saved_gen == 0
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["index.json", f"{a.id}.0.safetensors",
                                                                   f"{a.id}.0.tokens"]
    # the rollback copy is still the committed generation
    assert store.rollback(a, fed_before=2) and a.fed.tolist() == [1, 2] and a.state == "spilled"


def test_directory_replaced_by_a_file(tmp_path):
    root = tmp_path / "s"
    store = SessionStore(FakeBackend(), CFG, root, max_resident=1)
    a = store.create()
    feed(store, a, [1, 2])
    for p in root.iterdir():
        p.unlink()
    root.rmdir()
    root.write_text("not a directory")
    with pytest.raises(SpillFailed, match=str(root)):
        store.spill(a.id)
    assert a.state == "resident"
    with pytest.raises(SpillFailed, match="not a directory"):
        SessionStore(FakeBackend(), CFG, root)   # checked at start


def test_startup_survives_any_directory_content(tmp_path):
    backend = FakeBackend()
    store = durable(tmp_path, backend)
    s = saved_session(store, [1, 2, 3])
    (tmp_path / "index.json").unlink()
    (tmp_path / "index.json").mkdir()                                      # a directory as the index
    (tmp_path / "aside").write_text("a file where aside/ goes")           # moving aside fails: logged
    target = tmp_path.parent / f"{tmp_path.name}-outside"
    target.write_text("outside")
    (tmp_path / "sess_link.0.tokens").symlink_to(target)                  # links are never followed
    (tmp_path / "sess_link.0.safetensors").write_text("[]")
    (tmp_path / "sess_bin.0.tokens").write_bytes(b"\xff" * 7)
    (tmp_path / "sess_bin.0.safetensors").write_bytes(b"\x00")
    (tmp_path / "notes.txt").write_text("not ours: left alone")
    again = durable(tmp_path, backend)
    assert again.load_persisted() == 1 and again.get(s.id).fed.tolist() == [1, 2, 3]
    assert (tmp_path / "notes.txt").exists() and target.read_text() == "outside" and "sess_link" not in again


def test_a_session_is_in_the_index_while_its_first_turn_runs(tmp_path):
    """Told of (201, or its reply's first token), a session stays in the index though it has no
    saved turn yet: a kill -9 mid-document brings it back empty, not as a 404."""
    store = durable(tmp_path)
    busy = store.create()
    feed(store, busy, [1, 2, 3])   # its first document, being read (not saved)
    busy.busy = True
    other = saved_session(store, [7, 8])   # another session's save rewrites the index
    index = {e["id"]: e for e in json.loads((tmp_path / "index.json").read_text())["sessions"]}
    assert index[busy.id]["gen"] is None and index[busy.id]["tokens"] == 0 and other.id in index
    again = durable(tmp_path)
    again.load_persisted()
    assert busy.id in again and len(again.get(busy.id).fed) == 0


def test_the_index_counts_the_turns_of_the_saved_copy(tmp_path):
    """A turn counts once it is saved: an index another session's save (or a title) rewrites while a
    turn is being saved, or after one the disk refused, names the turns of the copy it names (a kill
    then brought the session back with turn 1's tokens listed as 2 turns)."""
    store = durable(tmp_path)
    a = saved_session(store, [1, 2, 3])
    a.turns = 1
    store.save(a)
    feed(store, a, [4, 5])   # turn 2: counted, its save not committed yet
    a.turns = 2
    saved_session(store, [7, 8])
    index = {e["id"]: e for e in json.loads((tmp_path / "index.json").read_text())["sessions"]}
    assert (index[a.id]["tokens"], index[a.id]["turns"]) == (3, 1)
    again = durable(tmp_path)
    again.load_persisted()
    assert (len(again.get(a.id).fed), again.get(a.id).turns) == (3, 1)
    assert store.rollback(a, 3) and (len(a.fed), a.turns) == (3, 1)   # a failed step: back to the saved copy
    store.make_resident(a)
    a.unfed_reply = (9,)   # a reply max_tokens cut: its last token sent, never read; saved with its turn
    store.save(a)
    again = durable(tmp_path)
    again.load_persisted()
    assert again.get(a.id).unfed_reply == (9,)   # (a named session's next turn reads it first, after a restart too)
    feed(store, a, [6])
    a.turns = 2
    store.save(a)
    assert {e["id"]: e for e in json.loads((tmp_path / "index.json").read_text())["sessions"]}[a.id]["turns"] == 2


def test_startup_removes_half_written_checkpoints_and_lists_the_rest(tmp_path):
    from localheap.sessions.checkpoints import Checkpoints

    store = durable(tmp_path)
    s = saved_session(store, [1, 2, 3])
    folder = tmp_path / "checkpoints" / s.id
    folder.mkdir(parents=True)
    (folder / "3.safetensors").write_bytes(b"heap")
    (folder / "3.tokens").write_bytes(bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]))
    (folder / "5.tokens").write_bytes(bytes(20))              # its heap file never written
    (folder / "5.pages").mkdir()
    (folder / "7.safetensors.tmp.safetensors").write_bytes(b"half")
    (tmp_path / "checkpoints" / "sess_gone").mkdir()         # of no session
    again = durable(tmp_path)
    again.load_persisted()
    assert Checkpoints(tmp_path / "checkpoints", again.backend).load_persisted(again.sessions()) == 1
    assert sorted(p.name for p in folder.iterdir()) == ["3.safetensors", "3.tokens"]
    assert not (tmp_path / "checkpoints" / "sess_gone").exists()
    assert again.info(s.id)["checkpoints"] == [3]   # listed after the restart


def test_startup_keeps_only_the_committed_page_state(tmp_path):
    store = durable(tmp_path)
    s = saved_session(store, [1, 2, 3])
    unsaved = store.create()
    pages = tmp_path / f"{s.id}.pages"
    pages.mkdir()
    for name in ("layer000.pages", f"state.{s.saved_gen}.npz", f"state.{s.saved_gen + 1}.npz", "state.0.npz.tmp"):
        (pages / name).write_bytes(b"x")
    (tmp_path / f"{unsaved.id}.pages").mkdir()               # pages of a first turn that never committed
    (tmp_path / "sess_nobody.pages").mkdir()                 # of no session
    again = durable(tmp_path)
    again.load_persisted()
    assert sorted(p.name for p in pages.iterdir()) == ["layer000.pages", f"state.{s.saved_gen}.npz"]
    assert not (tmp_path / f"{unsaved.id}.pages").exists() and not (tmp_path / "sess_nobody.pages").exists()


def test_an_ephemeral_session_leaves_the_index_alone(tmp_path, monkeypatch):
    """The index never names a session that is not kept (store false, an echo, an embedding):
    making and deleting one rewrites nothing (each rewrite is an fsync: 8.7 ms with 100 sessions
    on the dev VM, twice per embedded input before)."""
    store = durable(tmp_path)
    kept = store.create()
    writes = []
    real = store.dir.write_index
    monkeypatch.setattr(store.dir, "write_index", lambda index: (writes.append(index), real(index)))
    brief = store.create(ephemeral=True)
    store.delete(brief.id)
    assert writes == []
    store.delete(kept.id)
    assert len(writes) == 1 and writes[0]["sessions"] == []


def test_sessions_that_are_never_kept_make_no_kept_session_go(tmp_path):
    """max_sessions counts the kept sessions only, and max_resident no heap sized to one input
    (an embedding's): making such sessions never deletes nor spills a conversation."""
    from localheap.embedding import embedding_heap

    store = SessionStore(FakeBackend(), CFG, tmp_path, durable=True, max_sessions=2, max_resident=1)
    a, b = store.create(), store.create()
    store.make_resident(b)
    sized = store.create(ephemeral=True, cfg=embedding_heap(CFG, 10))
    store.make_resident(sized)
    store.enforce_limits(keep=sized)
    assert b.cache is not None and a.id in store   # (before: b spilled for a heap of a few KB, a deleted)
    brief = store.create(ephemeral=True)          # a session's whole heap: it takes b's place in RAM
    store.enforce_limits(keep=brief)
    assert a.id in store and b.id in store and b.cache is None
    c = store.create()
    store.enforce_limits(keep=c)
    assert a.id not in store and {b.id, c.id} <= {s.id for s in store.sessions()}   # a kept one past the limit goes


def test_a_documents_checkpoint_a_full_disk_refuses_is_a_warning_without_a_traceback(tmp_path, monkeypatch, caplog):
    """The document's automatic checkpoint on a full disk: expected there (the turn's save says
    saved: false), logged in a line; any other failure keeps its traceback."""
    import logging

    from localheap.engine.branching import checkpoint_quietly

    store = durable(tmp_path)
    s = saved_session(store, [1, 2, 3])
    for error, level, traced in ((OSError(errno.ENOSPC, "No space left on device"), logging.WARNING, False),
                                 (RuntimeError("a bug"), logging.ERROR, True)):
        monkeypatch.setattr(store.checkpoints, "save", lambda s, error=error: (_ for _ in ()).throw(error))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            checkpoint_quietly(store, s)
        (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert record.levelno == level and (record.exc_info is not None) == traced, record


def test_a_sessions_directory_made_anew_is_written_only_once_the_servers_lock_is_taken_in_it(tmp_path):
    """The sessions directory removed while a server runs, and made again: by hand, it is taken (the
    server's lock taken in it first); by another server started on it, never: not while that one holds
    its lock, nor once it is gone (its index names its sessions: this one's index dropped them)."""
    import shutil
    from types import SimpleNamespace

    from localheap.commands.serve import lock_sessions_dir

    root = tmp_path / "sessions"

    def lock(port):
        return lock_sessions_dir(root, "serve.lock", SimpleNamespace(host="127.0.0.1", port=port))

    mine = lock(8001)
    d = SessionDir(root)
    d.check()
    d.relock = lambda: lock(8001)
    d.write_bytes(root / "a", b"1")
    shutil.rmtree(root)
    root.mkdir()   # by hand
    d.write_bytes(root / "b", b"2")
    assert (root / "b").read_bytes() == b"2" and len(d.locks) == 1 and "8001" in (root / "serve.lock").read_text()
    shutil.rmtree(root)
    theirs = lock(8002)   # another server started on it
    with pytest.raises(SpillFailed, match="in use by another localheap serve"):
        d.write_bytes(root / "c", b"3")
    (root / "index.json").write_text('{"sessions": [{"id": "sess_theirs"}]}')   # it saved a session
    theirs.close()   # and stopped
    with pytest.raises(SpillFailed, match="made again by another server"):
        d.write_bytes(root / "c", b"3")
    assert not (root / "c").exists() and len(d.locks) == 1
    lock(8003).close()   # (the refused one let go of the lock it took)
    for f in [mine, *d.locks]:
        f.close()


def test_a_rollback_to_the_saved_copy_takes_back_its_rollback_points(tmp_path):
    """A failed step falls back to the saved copy: where that copy rolls back to and where its reply
    began come back with it, not the failed run's (past the copy's end: the next request's prefix
    match read them)."""
    store = durable(tmp_path)
    a = store.create()
    feed(store, a, [1, 2, 3, 4])
    a.rollback_floor, a.reply_start, a.cuttable = 1, 2, True
    store.save(a)
    feed(store, a, [5, 6, 7])   # a run that failed
    a.rollback_floor, a.reply_start, a.cuttable = 6, 6, False
    assert store.rollback(a, fed_before=4) and a.fed.tolist() == [1, 2, 3, 4]
    assert (a.rollback_floor, a.reply_start, a.cuttable) == (1, 2, True)
    b = store.create()
    feed(store, b, [8, 9])   # no saved copy: back to empty, nothing to roll back to
    b.rollback_floor, b.reply_start, b.cuttable = 1, 1, True
    assert store.rollback(b, fed_before=0) and len(b.fed) == 0
    assert (b.rollback_floor, b.reply_start, b.cuttable) == (None, None, False)


def test_a_restart_lists_a_saved_sessions_heap_totals(tmp_path):
    """The index keeps the saved copy's heap totals (no layers): a restarted server lists them, and /metrics
    counts its pages on disk, before the session is used again (they read null and 0 pages)."""
    from localheap.heap import HeapStats
    from localheap.sessions.recover import PAGE_COUNTS

    store = durable(tmp_path)
    a = store.create()
    feed(store, a, [1, 2, 3])
    pages = {**{k: 2 for k in PAGE_COUNTS}, "last_recall": None}
    a.stats = HeapStats(tokens_seen=3, resident=3, evicted=0, capacity=8, kv_bytes=64, evictions=0, pages=pages)
    store.save(a)
    a.stats = HeapStats(tokens_seen=9, resident=8, evicted=1, capacity=8, kv_bytes=64, evictions=1)   # not saved
    store._commit()
    again = durable(tmp_path)
    again.load_persisted()
    heap = again.info(a.id)["heap"]
    assert heap["tokens_seen"] == 3 and heap["pages"]["disk_bytes"] == 2 and again.get(a.id).state == "spilled"
    index = json.loads((tmp_path / "index.json").read_text())
    index["sessions"][0]["stats"] = {"tokens_seen": 99}   # malformed: listed without
    (tmp_path / "index.json").write_text(json.dumps(index))
    third = durable(tmp_path)
    third.load_persisted()
    assert third.info(a.id)["heap"] is None and len(third.get(a.id).fed) == 3


def test_sessions_another_checkpoint_of_the_same_name_saved_are_set_aside(tmp_path):
    """Two checkpoints in folders of one name (output/model, other/model) share a default sessions
    directory: the second's start sets the first's sessions aside instead of continuing their heaps with
    its own weights (it reused 39 of 52 prompt tokens of the other model's session)."""
    first = FakeBackend()
    first.model_key = "aaaa0001"
    store = durable(tmp_path, first)
    saved_session(store, [1, 2, 3])
    same = FakeBackend()
    same.model_key = "aaaa0001"
    assert durable(tmp_path, same).load_persisted() == 1
    other = FakeBackend()
    other.model_key = "bbbb0002"
    assert durable(tmp_path, other).load_persisted() == 0
    assert any(p.name.startswith("index.json.") for p in (tmp_path / "aside").iterdir())
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["model_key"] == "bbbb0002" and index["sessions"] == []


def test_a_title_leaves_control_characters_out():
    from localheap.sessions.session import short_title

    assert short_title("a\x00b\x07c\u200bd\nnext") == "a b c d next"
