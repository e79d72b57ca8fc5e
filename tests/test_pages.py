"""The page store (numpy only): exact pages, the int8 error bound, crash safety, the disk budget,
scoring, and the recall bookkeeping of LayerHeap."""

import os
import sys

import numpy as np
import pytest

from localheap.heap import HeapConfig, HeapConfigError, LayerHeap, SlotView
from localheap.heap.pages import PageGeometry, PageStore, copy_tree, link_tree
from localheap.heap.recall import PageWriter, score_pages, select_pages

H, D, P = 2, 8, 4


def evicted(rng, n, start=0):
    pos = np.broadcast_to(np.arange(start, start + n), (H, n)).copy()
    return pos, rng.standard_normal((H, n, D)).astype(np.float32), rng.standard_normal((H, n, D)).astype(np.float32)


def store(tmp_path, fmt="f32", layers=1, **kw):
    kw.setdefault("summary", "minmax")
    return PageStore(tmp_path / "pages", PageGeometry(layers, H, D, P, fmt), **kw)


def test_pages_hold_the_evicted_kv_exactly(tmp_path):
    rng = np.random.default_rng(0)
    s = store(tmp_path)
    pos, k, v = evicted(rng, 10)
    assert s.append(0, pos, k, v) == 2          # two full pages, two tokens wait in RAM
    assert s.pages == 2 and s.layers[0].tail_pos.shape == (H, 2)
    got_pos, got_k, got_v = s.load(0, np.array([[0, 1], [0, 1]]))
    np.testing.assert_array_equal(got_pos, pos[:, :8])
    np.testing.assert_array_equal(got_k, k[:, :8])
    np.testing.assert_array_equal(got_v, v[:, :8])


def page_record(s, seq, pos, k, v, value):
    """One page's record as the store first built it, page by page (the reference for _records)."""
    from localheap.heap.pagecodec import encode, payload_names
    from localheap.heap.pages import _META_FIELDS, MAGIC, _crc

    rec = np.zeros((), s.dtype)
    rec["magic"], rec["seq"], rec["value"], rec["n"] = MAGIC, seq, value, pos.shape[1]
    rec["positions"] = pos
    rec["kmin"], rec["kmax"], rec["kmean"] = k.min(axis=1), k.max(axis=1), k.mean(axis=1)
    encode(rec, s.g.fmt, k, v)
    rec["crc_meta"] = _crc(rec, _META_FIELDS)
    rec["crc_data"] = _crc(rec, payload_names(s.g.fmt))
    return rec.tobytes()


@pytest.mark.parametrize("wire", ["float32", "float16"])
@pytest.mark.parametrize("fmt", ["f32", "f16", "int8"])
def test_pages_written_together_are_the_pages_written_one_by_one(tmp_path, fmt, wire):
    """Appends of many pages at once (an eviction event) write, page for page, the bytes that
    building each page alone gives: summaries, payload, value, seq and checksums; and the RAM
    spans and values are each page's. K/V that come in as float16 (the backends' wire for the f16
    and int8 formats) give the pages of their float32 values."""
    rng = np.random.default_rng(11)
    s = PageStore(tmp_path / "pages", PageGeometry(1, 3, 16, 8, fmt), summary="minmax")
    H, D, P = 3, 16, 8
    pos_all, k_all, v_all, val_all = [], [], [], []
    start = 0
    for n in (5, 37, 64, 3, 70):                 # partial pages carried over between appends
        pos = np.stack([rng.permutation(np.arange(start, start + 3 * n))[:n] for _ in range(H)])
        k = (rng.standard_normal((H, n, D)) * rng.choice([0.01, 1, 100])).astype(wire)
        v = rng.standard_normal((H, n, D)).astype(wire)
        value = rng.standard_normal((H, n)).astype(np.float32)
        s.append(0, pos, k, v, value)
        k, v = k.astype(np.float32), v.astype(np.float32)   # the reference: float32 values
        for a, b in ((pos_all, pos), (k_all, k), (v_all, v), (val_all, value)):
            a.append(b)
        start += 3 * n
    pos, k, v, value = (np.concatenate(a, axis=1) for a in (pos_all, k_all, v_all, val_all))
    m = pos.shape[1] // P
    assert s.pages == m
    raw = (tmp_path / "pages" / "layer000.pages").read_bytes()
    for j in range(m):
        t = slice(j * P, (j + 1) * P)
        want = page_record(s, j, pos[:, t], k[:, t], v[:, t], float(value[:, t].max()))
        assert raw[j * s.record_bytes: (j + 1) * s.record_bytes] == want, j
        np.testing.assert_array_equal(s.layers[0].span[j], np.stack([pos[:, t].min(axis=1), pos[:, t].max(axis=1)], axis=1))
        assert s.layers[0].value[j] == np.float32(value[:, t].max())


@pytest.mark.parametrize("budget_pages", [0, 9])
@pytest.mark.parametrize("fmt", ["f16", "int8"])
def test_an_events_layers_built_on_threads_give_the_store_of_appends_in_turn(tmp_path, fmt, budget_pages):
    """append_many with a pool (an eviction event's layers built on the page builders' threads)
    writes the files, tails, RAM summaries, spans, values and counts that one append per layer in
    job order gives, partial pages carried between events, layers in any order, with a disk budget
    that drops pages between one layer's write and the next."""
    from concurrent.futures import ThreadPoolExecutor

    L = 3
    stores = {}
    with ThreadPoolExecutor(3) as pool:
        for way in ("in turn", "threads"):
            g = PageGeometry(L, H, D, P, fmt)
            s = PageStore(tmp_path / way, g, summary="minmax")
            s.disk_budget = budget_pages * s.record_bytes
            rng = np.random.default_rng(3)
            start = 0
            for n in (5, 11, 2, 9, 16):
                jobs = []
                for layer in rng.permutation(L).tolist():
                    pos, k, v = evicted(rng, n, start)
                    jobs.append((layer, pos, k.astype(np.float16), v.astype(np.float16), rng.random((H, n)).astype(np.float32)))
                if way == "in turn":
                    got = sum(s.append(*job) for job in jobs)
                else:
                    got = s.append_many(jobs, pool)
                stores.setdefault(way, []).append(got)
                start += n
            stores[way].append(s)
    a, b = stores["in turn"][-1], stores["threads"][-1]
    assert stores["in turn"][:-1] == stores["threads"][:-1]          # pages written per event
    assert (a.pages, a.seq, a.written, a.dropped) == (b.pages, b.seq, b.written, b.dropped) and a.written > 9
    assert a.dropped == (0 if budget_pages == 0 else a.written - 9)
    for layer in range(L):
        name = f"layer{layer:03d}.pages"
        assert (tmp_path / "in turn" / name).read_bytes() == (tmp_path / "threads" / name).read_bytes()
        x, y = a.layers[layer], b.layers[layer]
        for f in x.sums:
            np.testing.assert_array_equal(x.sums[f], y.sums[f])
        for name in ("live", "value", "span", "tail_pos", "tail_k", "tail_v", "tail_value"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


@pytest.mark.parametrize("threads", [True, False], ids=["pool", "in turn"])
def test_an_events_layer_that_fails_to_build_raises_after_the_others_are_written(tmp_path, monkeypatch, threads):
    """A layer whose pages fail to build raises from append_many once the other layers' pages are
    written: only that layer's tokens are lost."""
    from concurrent.futures import ThreadPoolExecutor

    s = PageStore(tmp_path / "pages", PageGeometry(3, H, D, P, "f16"), summary="minmax")
    real = PageStore._records

    def records(self, pos, *rest):
        if pos[0, 0] == 100:
            raise MemoryError("no room")
        return real(self, pos, *rest)

    monkeypatch.setattr(PageStore, "_records", records)
    rng = np.random.default_rng(0)
    jobs = [(layer, *evicted(rng, 8, 100 if layer == 1 else 0)) for layer in range(3)]
    with ThreadPoolExecutor(3) as pool, pytest.raises(MemoryError):
        s.append_many(jobs, pool if threads else None)
    assert [int(L.live.sum()) for L in s.layers] == [2, 0, 2] and s.seq == 4


@pytest.mark.parametrize("fmt", ["f16", "int8"])
def test_float16_partial_pages_checkpoint_and_reopen_as_float32_ones(tmp_path, fmt):
    """A store fed float16 K/V keeps its partial page in float16; checkpointed and reopened
    mid-page it goes on to write the bytes, tails and state of a store fed the same values as float32."""
    stores = {}
    for wire in ("float16", "float32"):
        root = tmp_path / wire
        s = PageStore(root / "pages", PageGeometry(2, H, D, P, fmt), summary="minmax")
        data = np.random.default_rng(5)
        start = 0
        for i, n in enumerate((3, 6, 1, 9, 2)):   # 21 tokens: whole pages and a partial one each time
            pos, k, v = evicted(data, n, start)
            k = k.astype(np.float16).astype(wire)
            v = v.astype(np.float16).astype(wire)
            for layer in range(2):
                s.append(layer, pos, k, v)
            start += n
            if i == 2:   # reopen from a checkpoint taken with a partial page pending
                s.checkpoint()
                s.close()
                s = PageStore(root / "pages", PageGeometry(2, H, D, P, fmt), summary="minmax")
        stores[wire] = s
    a, b = stores["float16"], stores["float32"]
    assert a.pages == b.pages > 0
    for layer in range(2):
        name = f"layer{layer:03d}.pages"
        assert (tmp_path / "float16" / "pages" / name).read_bytes() == (tmp_path / "float32" / "pages" / name).read_bytes()
        for x, y in zip(a.tail(layer), b.tail(layer)):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        for f in a.layers[layer].sums:
            np.testing.assert_array_equal(a.layers[layer].sums[f], b.layers[layer].sums[f])


def test_int8_pages_within_the_stated_error(tmp_path):
    rng = np.random.default_rng(1)
    s = store(tmp_path, fmt="int8")
    pos, k, v = evicted(rng, 8)
    s.append(0, pos, k, v)
    _, got_k, got_v = s.load(0, np.array([[0, 1], [0, 1]]))
    for got, want in ((got_k, k), (got_v, v)):
        bound = np.abs(want).max(axis=-1, keepdims=True) / 254 + 1e-6   # pagecodec's stated bound
        assert (np.abs(got - want) <= bound).all()
        assert np.abs(got - want).max() > 0      # it is quantized


def test_each_head_loads_its_own_pages_in_token_order(tmp_path):
    rng = np.random.default_rng(2)
    s = store(tmp_path)
    for start in (100, 0):                        # later eviction events may hold older tokens
        s.append(0, *evicted(rng, P, start))
    pos, _, _ = s.load(0, np.array([[0, 1], [1, 1]]))
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 3, 100, 101, 102, 103])
    np.testing.assert_array_equal(pos[1], [0, 0, 1, 1, 2, 2, 3, 3])


def test_reopen_keeps_checkpointed_pages_and_ignores_a_torn_tail(tmp_path):
    rng = np.random.default_rng(3)
    s = store(tmp_path)
    pos, k, v = evicted(rng, 10)
    s.append(0, pos, k, v)
    s.checkpoint()
    s.append(0, *evicted(rng, 8, 10))           # written after the checkpoint: not the saved store's
    s.close()
    with open(tmp_path / "pages" / "layer000.pages", "ab") as f:
        f.write(b"\x47torn")                      # half a record
    r = store(tmp_path)
    assert r.pages == 2 and r.written == 2
    np.testing.assert_array_equal(r.layers[0].tail_k, k[:, 8:])   # the partial page came back
    np.testing.assert_array_equal(r.load(0, np.array([[0, 1], [0, 1]]))[1], k[:, :8])
    assert r.summary_bytes > 0


def test_records_written_after_the_checkpoint_never_come_back(tmp_path):
    """A crash leaves records past the checkpoint; reopened, the store tombstones them, so a later
    checkpoint's larger sequence number does not take them for valid."""
    rng = np.random.default_rng(13)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 8), value=np.tile(np.repeat([0, 1], P).astype(np.float32), (H, 1)))
    s.checkpoint()                              # seq 2
    s.append(0, *evicted(rng, 12, 8))           # slots 2-4, seq 2-4: lost in the crash
    s.close()
    r = store(tmp_path)
    assert r.pages == 2
    r.disk_budget = r.record_bytes
    assert r.enforce_budget() == 1              # slot 0 freed
    r.disk_budget = 0
    r.append(0, *evicted(rng, 8, 100))          # slots 0 and 2, seq 2 and 3
    r.checkpoint()                              # seq 4: the lost page in slot 3 (seq 3) must stay lost
    r.close()
    again = store(tmp_path)
    assert again.pages == 3
    slots = again.summaries(0)[0]
    assert sorted(again.load(0, np.array([slots] * H))[0][0].tolist()) == [*range(4, 8), *range(100, 108)]


def test_a_checkpoint_links_keep_the_pages_the_live_store_goes_on_from(tmp_path):
    """link_tree is a checkpoint: the live store appending, reusing dropped slots and dropping
    pages (disk budget) leaves it as it was; a fork (copy_tree) opens it and writes its own files."""
    rng = np.random.default_rng(14)
    live = PageStore(tmp_path / "live", PageGeometry(1, H, D, P, "f32"), summary="minmax")
    for start in range(0, 24, 4):               # the oldest pages are worth least
        live.append(0, *evicted(rng, 4, start), value=np.full((H, 4), start, np.float32))
    live.checkpoint()
    link_tree(tmp_path / "live", tmp_path / "snap")
    want = {int(r["seq"]): r.tobytes() for r in live.read(0, live.summaries(0)[0])}
    assert os.stat(tmp_path / "snap" / "layer000.pages").st_nlink == 2   # a link, not a copy

    live.append(0, *evicted(rng, 8, 24), value=np.full((H, 8), 99, np.float32))   # past the checkpoint's records
    live.disk_budget = 5 * live.record_bytes
    assert live.enforce_budget() == 3           # drops: the file is shared, so the live store copies it first
    assert os.stat(tmp_path / "snap" / "layer000.pages").st_nlink == 1
    live.append(0, *evicted(rng, 8, 40))       # into the dropped slots
    live.checkpoint()

    copy_tree(tmp_path / "snap", tmp_path / "fork")
    fork = PageStore(tmp_path / "fork", PageGeometry(1, H, D, P, "f32"), summary="minmax")
    assert {int(r["seq"]): r.tobytes() for r in fork.read(0, fork.summaries(0)[0])} == want
    snap_bytes = (tmp_path / "snap" / "layer000.pages").read_bytes()
    fork.append(0, *evicted(rng, 8, 200))
    fork.checkpoint()
    assert (tmp_path / "snap" / "layer000.pages").read_bytes() == snap_bytes   # the fork wrote its own file
    live_pages = live.pages
    reopened = PageStore(tmp_path / "live", PageGeometry(1, H, D, P, "f32"), summary="minmax")
    assert reopened.pages == live_pages == 5
    assert 200 not in reopened.load(0, np.array([reopened.summaries(0)[0]] * H))[0]


def test_a_corrupt_record_is_not_loaded(tmp_path):
    rng = np.random.default_rng(4)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 8))
    s.checkpoint()
    s.close()
    path = tmp_path / "pages" / "layer000.pages"
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF                               # inside the first record's positions
    path.write_bytes(bytes(data))
    assert store(tmp_path).pages == 1


def test_never_checkpointed_store_starts_empty(tmp_path):
    s = store(tmp_path)
    s.append(0, *evicted(np.random.default_rng(5), 8))
    s.close()
    assert store(tmp_path).pages == 0


def test_disk_budget_drops_the_lowest_value_pages_and_reuses_their_slots(tmp_path):
    rng = np.random.default_rng(6)
    s = store(tmp_path, layers=2, disk_budget=0)
    budget = 3 * s.record_bytes
    s.disk_budget = budget
    for i, value in enumerate([5.0, 1.0, 9.0, 2.0]):
        pos, k, v = evicted(rng, P, i * P)
        s.append(i % 2, pos, k, v, np.full((H, P), value))
    assert s.pages == 3 and s.dropped == 1 and s.stats()["pages_dropped"] == 1
    # the value-1 page went, its slot taken by the value-2 page: the files do not grow past the bound
    assert s.layers[1].live[0] and s.layers[1].value[0] == 2.0 and not s.layers[1].live[1]
    assert s.disk_bytes <= budget
    assert sum(os.path.getsize(f) for f in (tmp_path / "pages").glob("layer*.pages")) <= budget
    s.append(1, *evicted(rng, P, 99), np.full((H, P), 7.0))
    assert s.dropped == 2 and s.pages == 3      # the freed slot took the new page; the value-2 page went
    assert s.layers[1].live[0] and not s.layers[1].live[1]
    assert os.path.getsize(tmp_path / "pages" / "layer001.pages") <= 2 * s.record_bytes


def test_max_pages_drops_the_lowest_value_pages_like_the_disk_budget(tmp_path):
    rng = np.random.default_rng(15)
    s = store(tmp_path, layers=2, max_pages=6)
    for start in range(0, 20, 4):               # 5 pages per layer, worth their start position
        for layer in range(2):
            s.append(layer, *evicted(rng, 4, start), value=np.full((H, 4), start + layer, np.float32))
    assert s.pages == 6 and s.dropped == 4 and s.page_limit == 6
    kept = sorted(int(s.layers[i].value[slot]) for i in range(2) for slot in s.summaries(i)[0])
    assert kept == [8, 9, 12, 13, 16, 17]
    assert s.stats()["tokens_limit"] == 6 * P // 2


def test_quest_bound_is_an_upper_bound_and_finds_the_planted_page(tmp_path):
    rng = np.random.default_rng(7)
    s = store(tmp_path)
    for i in range(6):
        s.append(0, *evicted(rng, P, i * P))
    fact = rng.standard_normal(D).astype(np.float32) * 4
    pos, k, v = evicted(rng, P, 100)
    k[:, 2] = fact                                  # one token of page 6 matches the query
    s.append(0, pos, k, v)
    s.checkpoint()
    queries = np.broadcast_to(fact, (H, 3, D)).copy()
    for kind in ("minmax", "mean"):
        other = store(tmp_path, summary=kind)        # the same files, another summary in RAM
        _, *summary = other.summaries(0)
        scores = score_pages(queries, tuple(summary))
        assert select_pages(scores, 1).tolist() == [[6], [6]], kind
        other.close()
    slots, kmin, kmax = s.summaries(0)
    bound = score_pages(queries, (kmin, kmax))
    _, keys, _ = s.load(0, np.broadcast_to(slots, (H, len(slots))).copy())
    exact = np.einsum("hqd,htd->hqt", queries, keys).max(axis=1).reshape(H, len(slots), P).max(axis=2)
    assert (bound >= exact - 1e-2).all()           # f16 summaries: a bound up to rounding


def test_zscore_lets_the_query_that_singles_a_page_out_pick_it():
    """Two queries over 8 pages: a loud one (a template word) that scores every page high, one page
    a little higher; a quiet one (the name asked about) that scores page 5 far above the rest. The
    raw bound follows the loud query; the per-query z-score follows the one that singles a page out.
    The z-scores are the per-query standardized bounds, exactly."""
    n = 8
    kmin = np.zeros((n, 1, 2), np.float32)
    kmax = np.zeros((n, 1, 2), np.float32)
    kmax[:, 0, 0] = 10.0
    kmax[2, 0, 0] = 10.5     # page 2: the loud query's favourite, by a little
    kmax[5, 0, 1] = 3.0      # page 5: the quiet query's, by far
    queries = np.array([[[1.0, 0.0], [0.0, 1.0]]], np.float32)   # [H=1, Q=2, D=2]
    assert select_pages(score_pages(queries, (kmin, kmax)), 1).tolist() == [[2]]
    z = score_pages(queries, (kmin, kmax), "zscore")
    assert select_pages(z, 1).tolist() == [[5]]
    bound = np.stack([kmax[:, 0, 0], kmax[:, 0, 1]])              # [Q, N]: the bound per query
    want = ((bound - bound.mean(axis=1, keepdims=True)) / (bound.std(axis=1, keepdims=True) + 1e-6)).max(axis=0)
    np.testing.assert_allclose(z[0], want, rtol=1e-6)


def test_recall_score_is_validated_and_reaches_the_config_from_the_flag():
    import argparse

    from localheap.commands.common import add_heap_args, heap_config

    with pytest.raises(HeapConfigError, match="recall score"):
        HeapConfig(recall_score="softmax")
    p = argparse.ArgumentParser()
    add_heap_args(p)
    default = heap_config(p.parse_args([]))
    assert (default.recall_score, default.recall_select, default.recall_budget) == ("zscore", "spans", 2048)
    cfg = heap_config(p.parse_args(["--recall", "on", "--recall-score", "bound", "--recall-select", "pages"]))
    assert (cfg.recall_score, cfg.recall_select) == ("bound", "pages")
    with pytest.raises(SystemExit):
        p.parse_args(["--recall-score", "softmax"])
    with pytest.raises(SystemExit):
        p.parse_args(["--recall-select", "tokens"])
    with pytest.raises(HeapConfigError, match="recall selection"):
        HeapConfig(recall_select="tokens")


def test_recall_is_on_by_default_where_the_commands_serve_and_the_region_fits():
    import argparse

    from localheap.commands.common import add_heap_args, heap_config
    from localheap.cli import build_parser

    def cfg(argv, recall):
        p = argparse.ArgumentParser()
        add_heap_args(p, recall=recall)
        return heap_config(p.parse_args(argv))

    assert cfg([], True).recall and not cfg([], False).recall        # serve/chat/generate vs the benches
    assert not cfg(["--recall", "off"], True).recall and cfg(["--recall", "on"], False).recall
    assert cfg(["--budget", "1024"], True).recall_budget == 512       # half the budget, whole pages
    assert cfg(["--budget", "1024", "--recall-budget", "256"], True).recall_budget == 256
    assert cfg(["--budget", "300", "--recent", "280", "--page-size", "32"], True).recall is False   # no room
    with pytest.raises(ValueError, match="--budget 300 with --recent 280 leaves no room"):
        cfg(["--budget", "300", "--recent", "280", "--recall", "on"], True)
    with pytest.raises(HeapConfigError, match="recall budget"):   # a region given that does not fit
        cfg(["--budget", "300", "--recent", "280", "--recall-budget", "64", "--recall", "on"], True)
    parser = build_parser()
    for command in (["serve"], ["chat"], ["generate", "--prompt", "hi"]):
        assert heap_config(parser.parse_args(command)).recall, command
    assert not heap_config(parser.parse_args(["bench", "needle"])).recall
    # pages never fill the disk by default: a tenth of its free space per session
    import shutil
    from pathlib import Path
    auto = heap_config(parser.parse_args(["serve"])).disk_budget
    assert 0 < auto <= shutil.disk_usage(Path.home()).free // 10 + 2**20
    assert heap_config(parser.parse_args(["serve", "--disk-budget", "0"])).disk_budget == 0
    assert heap_config(parser.parse_args(["serve", "--disk-budget", "2G"])).disk_budget == 2**31


def test_page_writer_runs_jobs_in_order_and_reports_errors():
    w, seen = PageWriter(), []
    for i in range(5):
        w.submit(lambda i=i: seen.append(i))
    w.drain()
    assert seen == list(range(5))
    w.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        w.drain()


def test_page_writer_lets_go_of_a_job_once_it_ran():
    """What a job holds (evicted K/V: torch tensors) is freed once it has run, while the writer's
    thread waits for more, not when the thread ends: freeing a tensor takes the GIL again, and a
    daemon thread that asks for it while the interpreter finalizes is ended inside torch's C++
    code, which aborts the process ("terminate called without an active exception")."""
    import gc
    import time
    import weakref

    class Held:
        pass

    w = PageWriter()
    held = Held()
    gone = weakref.ref(held)
    w.submit(lambda held=held: None)
    del held
    w.drain()
    until = time.monotonic() + 2.0   # (the thread drops it just after drain returns)
    while gone() is not None and time.monotonic() < until:
        gc.collect()
        time.sleep(0.01)
    assert gone() is None, "the writer's thread still holds the job it ran"
    assert w._thread is not None and w._thread.is_alive()   # (not freed by the thread ending: it waits IDLE_S)
    w.close()


def test_page_writer_bounds_the_jobs_waiting_behind_it():
    """A writer that falls behind (a low-priority thread on busy cores) makes submit wait once
    MAX_QUEUED jobs wait, so evicted K/V cannot pile up in RAM; every job still runs, in order."""
    import threading

    w, seen, gate, running = PageWriter(), [], threading.Event(), threading.Event()
    w.submit(lambda: (running.set(), gate.wait()))   # the running job, held
    assert running.wait(5)
    for i in range(PageWriter.MAX_QUEUED):
        w.submit(lambda i=i: seen.append(i))
    extra = threading.Thread(target=lambda: w.submit(lambda: seen.append("extra")))
    extra.start()
    extra.join(0.3)
    assert extra.is_alive() and seen == []   # the queue is full: submit waits
    gate.set()
    extra.join(5)
    assert not extra.is_alive()
    w.drain()
    assert seen == [*range(PageWriter.MAX_QUEUED), "extra"]


def test_page_writer_says_once_that_parts_were_queued():
    """fresh_parts: True once after parts were queued (the engine leaves that step's slice out), then False."""
    from localheap.heap.recall import PageWriter

    w = PageWriter()
    assert not w.fresh_parts()
    w.submit_parts([lambda: None, lambda: None])
    assert w.fresh_parts() and not w.fresh_parts()
    w.run_parts()
    assert not w.fresh_parts()
    w.close()


def test_page_writer_parts_run_between_steps_in_order_with_the_jobs():
    """Parts (a page-out left to the engine thread between its steps) run on the calling thread, at
    least one per run_parts and more until its deadline; never while a job of the thread's waits or
    runs; a job submitted after parts runs after them; drain runs what is left and raises a part's
    error; release_parts hands what is left to the thread."""
    import threading
    import time

    w, seen, where = PageWriter(), [], []
    me = threading.get_ident()
    w.submit_parts([lambda i=i: (seen.append(i), where.append(threading.get_ident())) for i in range(4)])
    w.run_parts(until=0.0)                                   # the deadline long past: one part
    assert seen == [0] and where == [me]
    w.run_parts(until=time.monotonic() + 60)                 # the rest, here
    assert seen == [0, 1, 2, 3] and set(where) == {me}

    gate, running = threading.Event(), threading.Event()
    w.submit(lambda: (running.set(), gate.wait()))          # a job of the thread's, held
    assert running.wait(5)
    w.submit_parts([lambda: seen.append("after the job")])
    w.run_parts(until=time.monotonic() + 60)
    assert seen[-1] == 3                                     # not while the job runs
    gate.set()
    w.drain()                                                # runs the part, here
    assert seen[-1] == "after the job"

    w.submit_parts([lambda: seen.append("part")])
    w.submit(lambda: seen.append("job"))                     # queued after the part: runs after it
    w.drain()
    assert seen[-2:] == ["part", "job"]

    w.submit_parts([lambda: 1 / 0, lambda: seen.append("still runs")])
    with pytest.raises(ZeroDivisionError):
        w.drain()
    assert seen[-1] == "still runs"

    w.between_steps = True
    w.submit_parts([lambda: where.append(threading.get_ident())])
    w.release_parts()                                        # the session left the batch
    assert not w.between_steps
    w.drain()
    assert where[-1] != me                                   # the thread ran it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities: Linux only")
@pytest.mark.parametrize("nice", [0, 5, 19])
def test_page_writer_runs_below_the_engine_threads(monkeypatch, nice):
    """The writer's thread takes a core only when the engine's threads leave one (Linux: its nice
    value raised by WRITER_NICE, capped at 19); the thread that submits keeps its own."""
    import threading

    from localheap.heap import recall

    monkeypatch.setattr(recall, "WRITER_NICE", nice)
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    w, seen = PageWriter(), []
    w.submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    w.close()
    assert seen == [min(19, here + nice)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here


def test_heap_pins_recalled_slots_and_releases_them():
    cfg = HeapConfig(budget=16, sinks=2, recent=4, slack=8, policy="streaming", recall=True,
                     recall_budget=8, page_size=4)
    heap = LayerHeap(cfg, 2, cfg.budget)
    assert heap.recall_slots == 8
    heap.append(26)
    plan = heap.plan(SlotView(positions=heap.view_positions()))
    assert plan.keep == 2 + 16 - 8                 # the recall region stays free
    gone = heap.evicted_slots(plan)
    heap.apply(plan)
    assert gone.shape == (2, 16)
    merge = heap.merge(np.array([[4, 5, 6, 7], [8, 9, 10, 11]]))
    assert heap.resident == 14 and heap.n_recalled == 4
    assert (np.diff(heap.view_positions(), axis=1) > 0).all()
    np.testing.assert_array_equal(heap.positions[0, :8], [0, 1, 4, 5, 6, 7, 18, 19])
    # compact: a resident slot moves by (new - old); a recalled key (pre-RoPE) is rotated to its slot
    assert merge.rotate_by[0, 2] == 2 and merge.rotate_by[0, 6] == 6 - 2
    heap.append(8)
    plan = heap.plan(SlotView(positions=heap.view_positions()))
    heap.apply(plan)
    assert heap.n_recalled == 4                    # pinned through an eviction
    evicted_before = heap.evicted
    heap.apply(heap.release_plan(), evicting=False)
    assert heap.n_recalled == 0 and heap.evicted == evicted_before
    assert heap.stats().recalled == 0


def test_recall_config_is_checked():
    with pytest.raises(HeapConfigError):
        HeapConfig(budget=512, recent=256, recall=True, recall_budget=512)
    with pytest.raises(HeapConfigError):
        HeapConfig(page_format="q3")
    assert HeapConfig(recall=False, recall_budget=10**6).recall_slots == 0


def span_store(tmp_path, rng, fact, head1_order):
    """200-odd evicted tokens of one layer; head 0 in position order with `fact` as the keys of
    positions 100 and 101, head 1 in `head1_order` (its pages cut the document elsewhere)."""
    n = len(head1_order)
    pos = np.stack([np.arange(n), np.asarray(head1_order)])
    k = rng.standard_normal((H, n, D)).astype(np.float32)
    v = rng.standard_normal((H, n, D)).astype(np.float32)
    k[0, 100:102] = fact
    s = store(tmp_path)
    s.append(0, pos, k, v)
    return s, pos, k, v


def fake_cache(recall_slots):
    from types import SimpleNamespace

    heap = SimpleNamespace(layer=0, recall_slots=recall_slots)
    return SimpleNamespace(heap_layers=[SimpleNamespace(heap=heap)], cfg=HeapConfig())


def test_span_recall_brings_the_window_one_head_points_to_back_in_every_head(tmp_path):
    """Only head 0's queries match the fact (positions 100-101); head 1's are noise and its pages hold
    other cuts of the document. Span recall gives both heads the same window around the fact, each
    with its own stored K/V; page recall gives head 1 the pages its noise scores best."""
    from localheap.backends.paging import pick_pages, pick_spans
    from localheap.heap.recall import WINDOW

    rng = np.random.default_rng(3)
    fact = rng.standard_normal(D).astype(np.float32) * 4
    order = np.concatenate([np.arange(2, 200), [0, 1]])        # head 1's pages: [2..5], [6..9], ...
    s, pos, k, v = span_store(tmp_path, rng, fact, order)
    queries = np.stack([np.broadcast_to(fact, (3, D)), rng.standard_normal((3, D))]).astype(np.float32)
    cache = fake_cache(recall_slots=2 * WINDOW)
    got_pos, got_k, got_v = pick_spans(cache, s, {0: queries})[0]
    window = set(range(96 - WINDOW // 2, 112 + WINDOW // 2))    # bin [96, 112) and its margins
    for h in range(H):
        assert set(got_pos[h].tolist()) == window, h
        at = {int(p): i for i, p in enumerate(pos[h])}
        idx = [at[p] for p in got_pos[h].tolist()]
        np.testing.assert_array_equal(got_k[h], k[h, idx])
        np.testing.assert_array_equal(got_v[h], v[h, idx])
    page_pos = pick_pages(cache.__class__(heap_layers=cache.heap_layers, cfg=HeapConfig(recall_select="pages")),
                          s, {0: queries})[0][0]
    assert {100, 101} <= set(page_pos[0].tolist()) and set(page_pos[1].tolist()) != window


def test_span_recall_takes_tokens_still_in_the_partial_page(tmp_path):
    """Head 1 evicted positions 100-101 last: they wait in its partial page (RAM), not on disk, and
    still come back with the window head 0 voted for."""
    from localheap.backends.paging import pick_spans
    from localheap.heap.recall import WINDOW

    rng = np.random.default_rng(4)
    fact = rng.standard_normal(D).astype(np.float32) * 4
    order = np.concatenate([np.arange(0, 100), np.arange(102, 202), [100, 101]])   # 202 tokens: 2 in the tail
    s, pos, k, v = span_store(tmp_path, rng, fact, order)
    assert sorted(s.tail(0)[0][1].tolist()) == [100, 101]
    queries = np.stack([np.broadcast_to(fact, (3, D)), rng.standard_normal((3, D))]).astype(np.float32)
    got_pos, got_k, _ = pick_spans(fake_cache(2 * WINDOW), s, {0: queries})[0]
    assert {100, 101} <= set(got_pos[1].tolist())
    i = got_pos[1].tolist().index(100)
    np.testing.assert_array_equal(got_k[1, i], k[1, 200])


def test_page_positions_are_read_from_headers_and_spans_kept_in_ram(tmp_path):
    rng = np.random.default_rng(5)
    s = store(tmp_path)
    pos = np.stack([np.arange(12), np.arange(12)[::-1]])
    s.append(0, pos, *evicted(rng, 12)[1:])
    slots = np.array([0, 1, 2])
    np.testing.assert_array_equal(s.positions(0, slots), pos.reshape(H, 3, P).transpose(1, 0, 2))
    np.testing.assert_array_equal(s.spans(0, slots)[:, 1], [[8, 11], [4, 7], [0, 3]])
    s.checkpoint()
    again = store(tmp_path)                                     # reopened: spans rebuilt from the records
    np.testing.assert_array_equal(again.spans(0, slots), s.spans(0, slots))
    again.close()


def test_batched_header_reads_match_the_per_field_crc_and_flag_bad_records(tmp_path):
    """positions() reads many headers at once and checks one CRC over the header's run of bytes:
    it must accept exactly the records the per-field CRC accepts (-1 for a corrupt, tombstoned or
    missing record), for every page format."""
    import zlib

    from localheap.heap.pagecodec import payload_names
    from localheap.heap.pages import _META_FIELDS, MAGIC, _crc

    rng = np.random.default_rng(6)
    for fmt in ("f32", "f16", "int8"):
        s = store(tmp_path / fmt, fmt=fmt)
        pos = np.stack([np.arange(24), rng.permutation(24)])
        s.append(0, pos, *evicted(rng, 24)[1:])
        want = pos.reshape(H, 6, P).transpose(1, 0, 2)
        rb, fd = s.record_bytes, s._fds[0]
        for slot in range(6):
            rec = s.read(0, np.array([slot]))[0]
            assert rec["magic"] == MAGIC and _crc(rec, _META_FIELDS) == rec["crc_meta"]
            # read() checks both CRCs over byte runs: the per-field CRCs of the same record
            raw = rec.tobytes()
            assert zlib.crc32(raw[s._meta_run]) == _crc(rec, _META_FIELDS)
            assert zlib.crc32(raw[s._data_run]) == _crc(rec, payload_names(fmt)) == rec["crc_data"]
        os.pwrite(fd, b"\x7f", 1 * rb + s.dtype.fields["kmax"][1])    # page 1: a summary byte flipped
        os.pwrite(fd, b"\x00" * 4, 3 * rb)                             # page 3: tombstoned (magic 0)
        got = s.positions(0, np.array([5, 1, 3, 0, 9, 2]))             # slot 9: past the file's end
        for i, slot in enumerate([5, 1, 3, 0, 9, 2]):
            np.testing.assert_array_equal(got[i], want[slot] if slot in (0, 2, 5) else -1)
        # the live pages whose headers failed are tombstoned and counted, as read() does (the
        # recall's span pick skipped them silently); slot 9 is no page
        assert s.corrupt == 2 and not s.layers[0].live[[1, 3]].any() and s.layers[0].live[[0, 2, 4, 5]].all()
        s.positions(0, np.array([1, 3]))
        assert s.corrupt == 2
        assert s.positions(0, np.array([], np.int64)).shape == (0, H, P)
        s.close()


@pytest.mark.parametrize("fmt", ["f32", "f16", "int8"])
@pytest.mark.parametrize("with_tail", [False, True])
def test_recall_gathers_only_the_taken_tokens_as_the_whole_records_decode_them(tmp_path, fmt, with_tail):
    """paging.gather_taken reads the taken tokens out of the records: the same positions and K/V
    bits as decoding the pages whole and indexing them, float16 pages left float16 (float32 where
    the tail, kept float32, or int8 pages are among them), each head's in position order."""
    from localheap.backends.paging import gather_taken
    from localheap.heap.pagecodec import decode

    rng = np.random.default_rng(11)
    s = store(tmp_path, fmt)
    s.append(0, *evicted(rng, 30))                               # 7 pages, 2 tokens in the tail
    slots = np.flatnonzero(s.layers[0].live)
    taken, r = [], 9
    for h in range(H):                                           # a head's picks: distinct, out of position order
        tok = rng.choice(P * len(slots), r, replace=False)
        src, off = tok // P, tok % P
        if with_tail:
            src[1], off[1] = -1, h % 2
        taken.append((src, off))
    pos, keys, values = gather_taken(s, 0, slots, taken, r)
    recs = s.read(0, slots)
    k_all, v_all = decode(recs, fmt)
    tail_pos, tail_k, tail_v = s.tail(0)
    for h, (src, off) in enumerate(taken):
        want = [(tail_pos[h, o], tail_k[h, o], tail_v[h, o]) if p < 0 else
                (recs["positions"][p, h, o], k_all[p, h, o], v_all[p, h, o]) for p, o in zip(src[:r], off[:r])]
        want.sort(key=lambda x: x[0])
        np.testing.assert_array_equal(pos[h], [w[0] for w in want])
        np.testing.assert_array_equal(keys[h].astype(np.float32), np.stack([w[1] for w in want]))
        np.testing.assert_array_equal(values[h].astype(np.float32), np.stack([w[2] for w in want]))
    assert keys.dtype == (np.float16 if fmt == "f16" and not with_tail else np.float32)


@pytest.mark.parametrize("readers", [1, 3])
def test_a_recalls_bad_records_in_several_layers_are_all_tombstoned_and_counted_once(tmp_path, monkeypatch, readers):
    """paging.read_taken reads every layer (on the readers, or in turn) before it raises: one
    PageCorrupt counting the bad records of all of them, each tombstoned; the good layers' pages
    read as they are."""
    from localheap.backends import paging
    from localheap.heap.pages import PageCorrupt

    monkeypatch.setattr(paging, "RECALL_READERS", readers)
    monkeypatch.setattr(paging, "_readers", None)
    rng = np.random.default_rng(5)
    s = store(tmp_path, layers=3)
    for layer in range(3):
        s.append(layer, *evicted(rng, 16))                          # 4 pages a layer
    slots = np.arange(4)
    taken = [(np.array([0, 1, 2, 3]), np.array([0, 1, 2, 3]))] * H
    jobs = [(layer, slots, taken, 4) for layer in range(3)]
    want = paging.read_taken(s, jobs)
    rb = s.record_bytes
    for layer, slot in ((0, 1), (2, 3)):                            # one bad record in layers 0 and 2
        os.pwrite(s._fds[layer], b"\xff" * 8, slot * rb + rb // 2)
    with pytest.raises(PageCorrupt) as e:
        paging.read_taken(s, jobs)
    assert e.value.n == 2 and s.corrupt == 2
    assert not s.layers[0].live[1] and not s.layers[2].live[3] and s.layers[1].live[:4].all()
    again = paging.read_taken(s, [jobs[1]])
    for a, b in zip(again[1], want[1]):
        np.testing.assert_array_equal(a, b)
    if readers > 1:
        assert paging._readers is not None


def test_a_rewind_forgets_every_page_and_tail_token_at_or_past_its_point(tmp_path):
    """forget_from(seen): no page can bring back a token at or past `seen` (a later token takes its
    place); a page holding one goes whole, the partial page keeps the older tokens, each KV head cut
    to the fewest; the forgetting is on disk, so a checkpoint after it reopens without them, while a
    checkpoint linked before it keeps them."""
    rng = np.random.default_rng(21)
    s = store(tmp_path)
    s.append(0, *evicted(rng, 8))                        # positions 0-7: two pages
    pos, k, v = evicted(rng, 4, 20)
    pos[1, 3] = 40                                       # head 1's page reaches past 30
    s.append(0, pos, k, v)
    tail_pos, tail_k, tail_v = evicted(rng, 3, 24)
    tail_pos[0] = [24, 31, 25]                           # the partial page: head 0 has one token past 30
    s.append(0, tail_pos, tail_k, tail_v)
    s.checkpoint()
    link_tree(tmp_path / "pages", tmp_path / "snap")
    assert s.pages == 3
    assert s.forget_from(30) == 1 and s.pages == 2 and s.dropped == 0
    L = s.layers[0]
    np.testing.assert_array_equal(L.tail_pos, [[24, 25], [24, 25]])
    np.testing.assert_array_equal(L.tail_k, np.stack([tail_k[0, [0, 2]], tail_k[1, [0, 1]]]))
    np.testing.assert_array_equal(L.tail_v, np.stack([tail_v[0, [0, 2]], tail_v[1, [0, 1]]]))
    assert s.forget_from(30) == 0 and s.pages == 2
    # a crash before the rewound turn's commit: the store opens at the state before it, as the
    # session does (its tokens still hold the reply: its next turn rewinds again); the forgotten
    # page is gone (as if the disk budget had dropped it), the partial page is the saved one
    s.close()
    crashed = PageStore(tmp_path / "pages", PageGeometry(1, H, D, P, "f32"), summary="minmax", state=0)
    assert crashed.pages == 2 and crashed.layers[0].tail_pos.tolist() == tail_pos.tolist()
    assert crashed.forget_from(30) == 0 and crashed.layers[0].tail_pos.shape == (H, 2)
    crashed.checkpoint()   # the rewound turn committed this time
    crashed.close()
    again = store(tmp_path)
    assert again.pages == 2 and again.layers[0].tail_pos.shape == (H, 2)
    assert again.load(0, np.array([again.summaries(0)[0]] * H))[0].max() < 30
    snap = PageStore(tmp_path / "snap", PageGeometry(1, H, D, P, "f32"), summary="minmax")
    assert snap.pages == 3


def _by_position(store, layer=0):
    """{(head, position now): key row} of every live page's tokens (the cut ones left out)."""
    slots = store.summaries(layer)[0]
    pos, k, _ = store.load(layer, np.array([slots] * H)) if len(slots) else (np.zeros((H, 0), int), None, None)
    return {(h, int(p)): k[h, j].tobytes() for h in range(H) for j, p in enumerate(pos[h])}


def test_a_cut_maps_the_pages_tokens_to_the_shorter_history_and_forgets_the_others(tmp_path):
    """PageStore.cut(spans): a token inside the spans is read back (positions, load, the spans in
    RAM, the partial page) at its place in the spans joined end to end, with its own K/V; one
    outside is never read back; a page that keeps none is tombstoned. Records are not rewritten:
    the cut is in the state, so a reopened store reads through it, and a page written after the cut
    (in the new places) is not mapped again. A second cut composes with the first."""
    rng = np.random.default_rng(5)
    s = store(tmp_path)
    order = rng.permutation(60)                          # evicted out of order, as a heap evicts
    pos = np.stack([order, np.roll(order, 7)])           # each head its own tokens in each page
    k = rng.standard_normal((H, 60, D)).astype(np.float32)
    s.append(0, np.array([[100, 101, 102, 103], [104, 105, 106, 107]]),
             *rng.standard_normal((2, H, 4, D)).astype(np.float32))   # a page the cut keeps nothing of
    s.append(0, pos, k, k.copy())                        # 15 pages
    tail = np.array([[70, 12, 45], [71, 13, 46]])        # the partial page
    tk = rng.standard_normal((H, 3, D)).astype(np.float32)
    s.append(0, tail, tk, tk.copy())
    before = _by_position(s)

    def through(p, spans):
        at = 0
        for lo, hi in spans:
            if lo <= p < hi:
                return at + p - lo
            at += hi - lo
        return None

    spans = [(0, 10), (40, 75)]                          # 10-39 cut, and all from 75 on
    s.cut(spans)
    after = _by_position(s)
    want = {(h, through(p, spans)): key for (h, p), key in before.items() if through(p, spans) is not None}
    assert set(after) <= set(want) and all(after[x] == want[x] for x in after)
    fewest = min(sum(1 for h2, _ in want if h2 == h) for h in range(H))   # load: each head as many as all
    assert [sum(1 for h2, _ in after if h2 == h) for h in range(H)] == [fewest] * H
    L = s.layers[0]
    assert L.tail_pos.tolist() == [[40, 15], [41, 16]]   # 12 and 13 cut: each head keeps two, in order
    np.testing.assert_array_equal(L.tail_k, tk[:, [0, 2]])
    live = np.flatnonzero(L.live)
    assert len(live) == 15 and not L.live[0]             # the page of 100-107 alone: gone
    read = s.positions(0, live)
    for j, slot in enumerate(live):                      # the spans in RAM hold the tokens read back
        for h in range(H):
            got = read[j, h][read[j, h] >= 0]
            assert (L.span[slot, h, 0] <= got).all() and (got <= L.span[slot, h, 1]).all()
    s.append(0, np.array([[45, 46, 47, 48]] * H), *rng.standard_normal((2, H, 4, D)).astype(np.float32))
    mid = _by_position(s)                                # a page written after the cut: [40, 15, 45, 46]
    assert {(0, 45), (1, 46)} <= set(mid) and all(mid[x] == after[x] for x in after if x in mid)
    s.checkpoint()
    s.close()
    again = store(tmp_path)
    assert _by_position(again) == mid                    # the cut read back from the state
    second = [(0, 4), (9, 49)]                           # a second cut: 4-8 of the shorter history
    again.cut(second)
    twice = _by_position(again)
    assert twice and all(twice[x] == mid[(x[0], next(p for p in range(60) if through(p, second) == x[1]))]
                         for x in twice)
    assert max(p for _, p in twice) < 44
    again.close()


def test_page_span_of_a_batch_is_each_pages_span():
    """A reopen takes every record's span at once (page_span over [k, H, P])."""
    from localheap.heap.pages import page_span

    rng = np.random.default_rng(5)
    pos = rng.integers(0, 1000, (6, 3, 8))
    pos[rng.random(pos.shape) < 0.3] = -1
    pos[2, 1] = -1   # a head with no token left
    batch = page_span(pos)
    assert batch.shape == (6, 3, 2)
    for k in range(6):
        assert np.array_equal(batch[k], page_span(pos[k]))
    assert batch[2, 1].tolist() == [-1, -1]


def test_a_disk_total_share_bounds_the_files_growth_not_their_holes_twice(tmp_path):
    """--disk-total gives a running store a share of the room left: its live pages may grow by it (their holes
    taken off) and its files by it (holes and all). The files' bound counted the holes twice, dropping pages
    that fitted (2 of 4)."""
    from types import SimpleNamespace

    from localheap.sessions.diskbudget import DiskTotal

    rng = np.random.default_rng(9)
    s = store(tmp_path, layers=2)
    s.append(0, *evicted(rng, 10 * P), np.full((H, 10 * P), 1.0))
    s.append(1, *evicted(rng, 10 * P), np.full((H, 10 * P), 5.0))
    s.drop_lowest(6)   # layer 0: 6 holes; layer 1: none
    session = SimpleNamespace(cache=SimpleNamespace(pages=s), cfg=SimpleNamespace(disk_budget=0))
    DiskTotal(SimpleNamespace(), 10**12)._share([session], 8 * s.record_bytes)
    files, dropped = s.file_bytes, s.dropped
    s.append(1, *evicted(rng, 4 * P, 1000), np.full((H, 4 * P), 9.0))   # 4 pages into layer 1's file
    assert (s.file_bytes - files) // s.record_bytes == 4 and s.dropped == dropped
