"""The page store's part of a turn's one commit point (numpy only): versioned states that a heap
file names, records past the committed state discarded on open, stale states removed, bad
records tombstoned when read, a corrupt state refused (the session is rebuilt), and recall
that degrades instead of failing."""

import numpy as np
import pytest

from localheap.backends import paging
from localheap.heap import HeapConfig, LayerHeap, PageWriter
from localheap.heap.pages import CorruptPageState, PageCorrupt, PageStore, compact_store

from test_pages import H, P, evicted, store


def states(s):
    return sorted(f.name for f in s.root.glob("state.*.npz"))


def test_a_reopen_at_the_committed_state_drops_what_a_later_uncommitted_turn_wrote(tmp_path):
    rng = np.random.default_rng(0)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 2 * P + 1))
    assert s.checkpoint(3) == 3
    s.committed(3)
    s.append(0, *evicted(rng, 2 * P, 100))   # the next turn: pages and a state, never committed
    s.checkpoint(4)
    assert states(s) == ["state.3.npz", "state.4.npz"]
    s.close()
    big = s._file(0).stat().st_size
    r = store(tmp_path, state=3)              # what a crash before the index's rename reopens
    assert r.pages == 2 and r.layers[0].tail_pos.shape == (H, 1) and states(r) == ["state.3.npz"]
    assert r._file(0).stat().st_size == 2 * r.record_bytes < big   # the lost turn's records cut off the file
    assert set(r.load(0, np.array([r.summaries(0)[0]] * H))[0][0]) == set(range(2 * P))
    r.append(0, *evicted(rng, P, 200))        # the slots the lost turn used are reused
    r.checkpoint(4)
    r.committed(4)
    r.close()
    again = store(tmp_path, state=4)
    assert again.pages == 3 and states(again) == ["state.4.npz"]
    assert 100 not in again.load(0, np.array([again.summaries(0)[0]] * H))[0]


def test_a_new_store_discards_what_its_directory_held(tmp_path):
    s = store(tmp_path)
    s.append(0, *evicted(np.random.default_rng(1), 2 * P))
    s.checkpoint(0)
    s.close()
    fresh = store(tmp_path, state=None)   # a session whose first turn never committed
    assert fresh.pages == 0 and states(fresh) == [] and (tmp_path / "pages" / "layer000.pages").stat().st_size == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_corrupt_or_missing_state_is_refused(tmp_path, damage):
    s = store(tmp_path)
    s.append(0, *evicted(np.random.default_rng(2), 2 * P + 3))
    s.checkpoint(0)
    s.close()
    path = tmp_path / "pages" / "state.0.npz"
    data = bytearray(path.read_bytes())
    if damage == "flip":   # inside the partial page's keys
        data[data.find(s.layers[0].tail_k.tobytes()[:64]) + 5] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()
    with pytest.raises(CorruptPageState):
        store(tmp_path, state=0)


def test_a_record_that_fails_its_check_when_read_is_tombstoned_and_counted(tmp_path):
    rng = np.random.default_rng(3)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 3 * P))
    s.checkpoint(0)
    with open(tmp_path / "pages" / "layer000.pages", "r+b") as f:   # bit rot in page 1's payload
        f.seek(2 * s.record_bytes - 1)
        f.write(b"\xff")
    with pytest.raises(PageCorrupt):
        s.load(0, np.array([[0, 1], [0, 1]]))
    assert s.corrupt == 1 and s.pages == 2 and 1 not in s.summaries(0)[0]
    assert s.stats()["pages_corrupt"] == 1
    pos, _, _ = s.load(0, np.array([[0, 2], [0, 2]]))   # the others still load
    assert set(pos[0]) == set(range(P)) | set(range(2 * P, 3 * P))


def test_compaction_reads_the_committed_state(tmp_path):
    rng = np.random.default_rng(4)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 2 * P), value=np.tile(np.repeat([0.0, 1.0], P).astype(np.float32), (H, 1)))
    s.checkpoint(0)
    s.committed(0)
    s.close()
    assert compact_store(tmp_path / "pages", s.record_bytes, state=0) == (1, s.record_bytes)
    r = store(tmp_path, state=0)
    assert r.pages == 1 and r.dropped == 1


def _four_pages(tmp_path):
    """A committed, closed store of four pages of one layer, page j worth j (page 0 goes first)."""
    rng = np.random.default_rng(5)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 4 * P), value=np.tile(np.repeat(np.arange(4.0), P).astype(np.float32), (H, 1)))
    s.checkpoint(0)
    s.committed(0)
    s.close()
    return s, tmp_path / "pages" / "layer000.pages"


def _positions(r):
    """Every live page's positions, in slot order (a page twice would show twice)."""
    slots = np.flatnonzero(r.layers[0].live)
    pos = r.load(0, np.array([slots] * H))[0][0]
    return sorted(pos.tolist())


def test_compaction_works_in_place(tmp_path):
    """--disk-total compacts while the directory is at its bound: the layer file is compacted where
    it lies (same inode, never larger), not rewritten beside itself, and keeps every other page."""
    s, f = _four_pages(tmp_path)
    before = f.stat()
    assert compact_store(tmp_path / "pages", s.record_bytes, state=0) == (1, s.record_bytes)
    after = f.stat()
    assert after.st_ino == before.st_ino and after.st_size == before.st_size - s.record_bytes
    assert sorted(p.name for p in (tmp_path / "pages").iterdir()) == ["layer000.pages", "state.0.npz"]
    r = store(tmp_path, state=0)
    assert r.pages == 3 and r.dropped == 1 and _positions(r) == list(range(P, 4 * P))


def test_a_compaction_cut_short_loses_nothing_it_kept_and_counts_nothing_twice(tmp_path, monkeypatch):
    """Killed after the moved records are copied and before the file is cut: each moved page is on
    disk twice; a reopen keeps one of each (and tombstones the other), and compacts again later.
    The dropped page is counted though the kill came before the compaction ended."""
    import localheap.heap.pages as pages_mod

    s, f = _four_pages(tmp_path)

    def killed(fd, size):
        raise KeyboardInterrupt("kill -9 before the cut")
    monkeypatch.setattr(pages_mod.os, "ftruncate", killed)
    with pytest.raises(KeyboardInterrupt):
        compact_store(tmp_path / "pages", s.record_bytes, state=0)
    monkeypatch.undo()
    assert f.stat().st_size == 4 * s.record_bytes   # page 3 copied over page 0, and still at slot 3
    r = store(tmp_path, state=0)
    assert r.pages == 3 and r.dropped == 1 and _positions(r) == list(range(P, 4 * P))
    r.close()
    assert compact_store(tmp_path / "pages", 0, state=0) == (0, s.record_bytes)   # the tombstoned copy's slot
    again = store(tmp_path, state=0)
    assert again.pages == 3 and again.dropped == 1 and _positions(again) == list(range(P, 4 * P))


def _cache_with_pages(tmp_path, resident_positions):
    cfg = HeapConfig(budget=32, slack=8, recent=4, recall=True, recall_budget=16, page_size=P)
    heap = LayerHeap(cfg, H, 32, layer=0)
    n = resident_positions.shape[1]
    heap.positions[:, :n], heap.resident = resident_positions, n

    class Layer:
        pass

    layer = Layer()
    layer.heap = heap

    class Cache:
        pass

    cache = Cache()
    cache.cfg, cache.heap_layers = cfg, [layer]
    cache.writer = PageWriter()
    return cache


def test_recall_goes_on_without_a_pick_it_cannot_merge(tmp_path, monkeypatch):
    """A recalled token already resident (what bad bytes once made a 500): the layer goes without
    recall, logged and counted; an error inside the pick: the whole question does."""
    cache = _cache_with_pages(tmp_path, np.broadcast_to(np.arange(8), (H, 8)).copy())
    clash = np.broadcast_to(np.arange(4, 4 + P), (H, P)).copy()
    fine = np.broadcast_to(np.arange(40, 40 + P), (H, P)).copy()
    zeros = np.zeros((H, P, 8), np.float32)
    before = paging.FAULTS.recall_failed
    pick = lambda: paging.mergeable_only(cache, paging.pick_checked(cache, None, {}))   # noqa: E731 - as recall does
    monkeypatch.setattr(paging, "pick_spans", lambda *a: {0: (clash, zeros, zeros)})
    assert pick() == {} and paging.FAULTS.recall_failed == before + 1
    monkeypatch.setattr(paging, "pick_spans", lambda *a: {0: (fine, zeros, zeros)})
    assert list(pick()) == [0]

    def broken(*a):
        raise IndexError("a bug")

    monkeypatch.setattr(paging, "pick_spans", broken)
    assert pick() == {} and paging.FAULTS.recall_failed == before + 2
    tries = []

    def corrupt_then_fine(*a):
        tries.append(1)
        if len(tries) == 1:
            raise PageCorrupt(2)
        return {0: (fine, zeros, zeros)}

    monkeypatch.setattr(paging, "pick_spans", corrupt_then_fine)
    assert list(pick()) == [0] and len(tries) == 2


def test_a_heap_file_names_its_state_by_its_version():
    assert paging.file_version("sess_ab.3.safetensors") == 3
    assert paging.file_version(".sess_ab.3.safetensors.1234.tmp") == 3   # a save's temp file
    assert paging.file_version("120.safetensors") == 120                 # a checkpoint
    assert paging.file_version("sess_ab.7.tensor-rank1of2.safetensors") == 7
    assert paging.file_version("heap.safetensors") is None


def test_store_opened_at_latest_takes_the_newest_state(tmp_path):
    s = store(tmp_path)
    s.append(0, *evicted(np.random.default_rng(5), 2 * P))
    s.checkpoint()
    s.append(0, *evicted(np.random.default_rng(6), P, 50))
    s.checkpoint()
    s.close()
    assert PageStore(s.root, s.g, summary="minmax").pages == 3


def test_a_reopen_leaves_a_checkpoint_taken_after_its_state_whole(tmp_path):
    """A document's checkpoint is taken (hard links) just before its turn's save; a crash or a refused save
    leaves the session at its older state. Reopening there must not tombstone nor cut the records the
    checkpoint holds live in the shared file (its fork had 2 pages of 8): the store takes its own copy."""
    from localheap.heap.pages import copy_tree

    rng = np.random.default_rng(3)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 2 * P))
    s.checkpoint(0)
    s.committed(0)
    s.append(0, *evicted(rng, 6 * P, 100))   # the document's turn
    s.snapshot(tmp_path / "ckpt" / "800.pages", 800)
    assert s.pages == 8
    s.close()                                  # killed before the turn's save commits
    r = PageStore(s.root, s.g, state=0)
    assert r.pages == 2 and r._file(0).stat().st_size == 2 * r.record_bytes   # its own file, cut
    r.close()
    copy_tree(tmp_path / "ckpt" / "800.pages", tmp_path / "fork.pages", 800)
    assert PageStore(tmp_path / "fork.pages", s.g, state=800).pages == 8
