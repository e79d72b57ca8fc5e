"""Page-out when the disk refuses (numpy only): a full disk, a removed directory, a store that
could not be created. The store keeps serving without the pages it could not write, says why,
and pages out again once the disk takes writes."""

import errno
import os
import shutil
import subprocess

import numpy as np
import pytest

from localheap.heap.pages import PageGeometry, PageStore

from test_pages import D, H, P, evicted, store


def full_disk(*_):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_loses_pages_not_the_store(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    s = store(tmp_path, layers=2)
    assert s.append(0, *evicted(rng, 2 * P)) == 2
    monkeypatch.setattr(s, "_pwrite", full_disk)
    assert s.append(1, *evicted(rng, 2 * P)) == 0          # refused: counted, no exception
    assert s.failed == 2 and s.pages == 2 and "No space left" in s.fault
    assert s.stats()["degraded"] == s.fault and s.stats()["pages_failed"] == 2
    got, _, _ = s.load(0, np.array([[0, 1], [0, 1]]))      # what was written still loads
    assert got.shape == (H, 2 * P)
    monkeypatch.undo()                                      # space came back
    assert s.append(1, *evicted(rng, P, 100)) == 1
    assert s.fault is None and s.pages == 3 and s.failed == 2
    s.checkpoint()
    again = PageStore(s.root, s.g, summary="minmax")
    assert again.pages == 3 and again.failed == 0


def test_a_disk_that_fills_midway_through_an_event_keeps_the_pages_that_fit(tmp_path, monkeypatch):
    """An event's pages go out in one write; when the disk has room for only some of them, each
    page that fits is kept and each that does not is counted, as with a write per page."""
    rng = np.random.default_rng(3)
    s = store(tmp_path)
    write = s._pwrite
    room = 2 * s.record_bytes

    def filling(layer, data, offset):
        if offset + len(data) > room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(layer, data, offset)

    monkeypatch.setattr(s, "_pwrite", filling)
    pos, k, v = evicted(rng, 4 * P)
    assert s.append(0, pos, k, v) == 2
    assert s.pages == 2 and s.failed == 2 and "No space left" in s.fault
    got, got_k, _ = s.load(0, np.array([[0, 1], [0, 1]]))
    np.testing.assert_array_equal(got, pos[:, : 2 * P])
    np.testing.assert_array_equal(got_k, k[:, : 2 * P])
    s.checkpoint()
    again = PageStore(s.root, s.g, summary="minmax")
    assert again.pages == 2


def test_a_removed_directory_is_started_over(tmp_path):
    rng = np.random.default_rng(1)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 3 * P))
    s.checkpoint()
    shutil.rmtree(s.root)                                   # under the running session
    assert s.append(0, *evicted(rng, P, 50)) == 1           # into a new directory
    assert s.lost == 3 and s.pages == 1 and s.stats()["pages_lost"] == 3 and s.fault is None
    assert s.root.is_dir() and (s.root / "layer000.pages").stat().st_size == s.record_bytes
    s.checkpoint()                                          # the new store is the one a reopen finds
    again = PageStore(s.root, s.g, summary="minmax")
    assert again.pages == 1
    pos, _, _ = again.load(0, np.array([[0], [0]]))
    np.testing.assert_array_equal(pos[0], np.arange(50, 50 + P))


def test_a_removed_layer_file_is_started_over(tmp_path):
    """A layer's file unlinked under the running store: its writes went to the removed file (every
    turn "saved", the pages gone at the next start). It is found, counted and started over, as a
    removed directory is."""
    rng = np.random.default_rng(1)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 3 * P))
    s.checkpoint()
    s.snapshot(tmp_path / "checkpoint.pages", s.version)   # (its hard link keeps the removed file alive)
    (s.root / "layer000.pages").unlink()
    assert s.append(0, *evicted(rng, P, 50)) == 1
    assert s.lost == 3 and s.pages == 1 and s.stats()["pages_lost"] == 3
    s.checkpoint()
    again = PageStore(s.root, s.g, summary="minmax")
    assert again.pages == 1
    pos, _, _ = again.load(0, np.array([[0], [0]]))
    np.testing.assert_array_equal(pos[0], np.arange(50, 50 + P))


def test_a_store_the_disk_refuses_at_creation_waits_for_it(tmp_path):
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the store's directory would go")
    s = PageStore(blocker / "pages", PageGeometry(1, H, D, P, "f32"), summary="minmax")
    assert s.fault is not None and s.pages == 0
    rng = np.random.default_rng(2)
    assert s.append(0, *evicted(rng, P)) == 0 and s.failed == 1
    blocker.unlink()
    blocker.mkdir()
    assert s.append(0, *evicted(rng, P, 10)) == 1 and s.fault is None


def test_a_full_tmpfs(tmp_path):
    """The real thing where this machine lets us mount one (root on Linux); skipped elsewhere."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                          capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    try:
        rng = np.random.default_rng(3)
        s = PageStore(mnt / "pages", PageGeometry(1, H, D, 64, "f32"), summary="minmax")
        written = sum(s.append(0, *evicted(rng, 64, 64 * i)) for i in range(200))
        assert 0 < written < 200 and s.failed == 200 - written and "No space" in s.fault
        assert s.pages == written
        s.drop_lowest(s.pages // 2)                         # room again (freed slots): page-out resumes
        assert s.append(0, *evicted(rng, 64, 99_999)) == 1 and s.fault is None
        s.close()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)   # now a read-only disk
        ro = PageStore(mnt / "pages", PageGeometry(1, H, D, 64, "f32"), summary="minmax")
        assert "Read-only" in ro.fault and ro.pages == 0
        assert ro.append(0, *evicted(rng, 64, 88_888)) == 0 and ro.failed == 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)   # -l: a file still open elsewhere
