"""The sessions directory through the real server (torch backend, recall on): ephemeral
requests ("store": false) leave nothing behind."""

from __future__ import annotations

import time

import httpx
import pytest

from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.testing import ServerThread

pytest.importorskip("torch")

HEAP = HeapConfig(budget=96, slack=32, recent=16, policy="snapkv", recall=True, recall_budget=32, page_size=8)
DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(60))


def files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def chat(http, text, headers=None, **kw):
    return http.post("/v1/chat/completions", headers=headers or {}, json={
        "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, **kw})


@pytest.fixture(scope="module")
def backend(model_dirs, torch_one_thread):
    from localheap.backends.torch import TorchBackend

    return TorchBackend.load(model_dirs("llama"), model_name="tiny")


@pytest.mark.parametrize("stream", [False, True])
def test_store_false_leaves_nothing_on_disk(backend, tmp_path, stream):
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        kept = chat(http, DOC + " What does the heap keep?")
        assert kept.status_code == 200 and kept.json()["localheap"]["heap"]["pages"]["pages"] > 0
        before = files(tmp_path)
        assert any(f.startswith(kept.headers["X-Session-Id"]) for f in before)
        r = chat(http, DOC + " What does the heap keep? Say it again.", stream=stream, store=False)
        assert r.status_code == 200, r.text
        sid = r.headers["X-Session-Id"]
        assert sid != kept.headers["X-Session-Id"]   # never runs on (or rolls back) a kept session
        if not stream:
            assert r.json()["localheap"]["heap"]["pages"]["pages"] > 0   # it did page out while it ran
        after = files(tmp_path)
        assert not [f for f in after if sid in f], after
        assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == [kept.headers["X-Session-Id"]]
        assert sid not in (tmp_path / "index.json").read_text()
        again = chat(http, "Hi", headers={"X-Session-Id": kept.headers["X-Session-Id"]}, store=False)
        assert again.status_code == 400 and again.json()["error"]["param"] == "store"
        assert "not kept" in again.json()["error"]["message"]


SHORT_DOC = " ".join(f"Paragraph {i}: the heap keeps sinks, heavy hitters and a recent window." for i in range(30))


class Sampler:
    """The directory's size, every 10 ms, while the test runs (what `du -sb` would say)."""

    def __init__(self, root):
        import threading

        self.root, self.peak, self.samples = root, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from localheap.sessions.diskbudget import dir_bytes

        while not self._stop.wait(0.01):
            self.peak = max(self.peak, dir_bytes(self.root))
            self.samples += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def metrics(http) -> dict:
    return {line.split()[0]: float(line.split()[1]) for line in http.get("/metrics").text.splitlines()
            if line and line[0] != "#"}


@pytest.mark.parametrize("count,total,deleted", [(40, 4 << 20, False), (24, 3 << 19, True)])
def test_many_sessions_stay_under_the_disk_total(backend, tmp_path, count, total, deleted):
    """Stateless requests of ~1.4K tokens (~0.45 MB of pages and ~75 KB of heap and tokens each)
    under a few MB: the directory never passes the bound, the least recently used sessions give
    their pages back first, then (when their heaps alone do not fit) go whole, the session in use
    keeps its recall, and the reclaims are counted."""
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              disk_total=total, max_sessions=256)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http, \
            Sampler(tmp_path) as du:
        order = []
        for i in range(count):
            r = chat(http, f"Document {i}. {SHORT_DOC} What does the heap keep?")
            assert r.status_code == 200, r.text
            order.append(r.headers["X-Session-Id"])
            heap = r.json()["localheap"]["heap"]
            assert heap["recalled"] == HEAP.recall_budget and heap["pages"]["pages_reclaimed"] == 0, (i, heap["pages"])   # in use: whole
        assert len(set(order)) == count
        sessions = {s["id"]: s for s in http.get("/v1/sessions").json()["data"]}
        m = metrics(http)
        gone = [sid for sid in order if sid not in sessions]
        if gone:   # the client is told to resend the conversation
            r = chat(http, "Hello?", headers={"X-Session-Id": gone[0]})
            assert r.status_code == 410 and "--disk-total" in r.json()["error"]["message"], r.text
    assert du.samples > 50 and du.peak <= total, (du.peak, total)
    assert m["localheap_disk_reclaimed_pages_total"] > 0 and m["localheap_disk_reclaimed_bytes_total"] > 0
    assert m["localheap_disk_total_bytes"] == total and m["localheap_disk_used_bytes"] <= total
    touched = [sid not in sessions or sessions[sid]["reclaimed"] is not None for sid in order]
    n = sum(touched)
    assert 0 < n < count and touched == [True] * n + [False] * (count - n), touched   # least recently used first
    assert m["localheap_disk_reclaimed_sessions_total"] == count - len(sessions)
    assert (len(sessions) < count) == deleted
    kept = [sid for sid in order if sid in sessions and sessions[sid]["reclaimed"]]
    assert kept, "some session lost pages and stayed"
    s = sessions[kept[0]]
    assert s["reclaimed"]["pages"] > 0 and s["reclaimed"]["bytes"] > 0
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        again = chat(http, "And the sinks?", headers={"X-Session-Id": kept[0]})   # fewer pages, still served
        assert again.status_code == 200, again.text
        assert again.json()["localheap"]["heap"]["pages"]["pages_reclaimed"] > 0
        gone = [sid for sid in order if sid not in sessions]
        if gone:   # a deleted session is gone for good across a restart: 404 (410 before it)
            assert chat(http, "Hello?", headers={"X-Session-Id": gone[0]}).status_code == 404


def test_a_request_that_cannot_fit_gets_507_and_nothing_is_lost(backend, tmp_path):
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              disk_total=8 << 20)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        first = chat(http, SHORT_DOC + " What does the heap keep?")
        assert first.status_code == 200
        before = {f: (tmp_path / f).stat().st_size for f in files(tmp_path)}
        srv.services.store.disk.total = 64 << 10    # less than one heap file: nothing could make room
        r = chat(http, "Document two. " + SHORT_DOC)
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "disk_total_exceeded" and "--disk-total" in err["message"], err
        sid = first.headers["X-Session-Id"]
        for route in ("checkpoint", "fork"):   # a checkpoint's heap, a fork's copy of one: refused alike
            r = http.post(f"/v1/sessions/{sid}/{route}")
            assert r.status_code == 507 and r.json()["error"]["code"] == "disk_total_exceeded", r.text
        assert {f: (tmp_path / f).stat().st_size for f in files(tmp_path)} == before   # nothing taken, nothing left
        assert metrics(http)["localheap_disk_reclaimed_bytes_total"] == 0
        srv.services.store.disk.total = 8 << 20
        assert http.post(f"/v1/sessions/{sid}/fork").status_code == 201
        assert chat(http, "And the sinks?", headers={"X-Session-Id": sid}).status_code == 200


def test_page_out_faults_degrade_one_session(backend, tmp_path, monkeypatch):
    """A session whose pages the disk refuses, then whose page directory is removed: its requests
    succeed, its stats and /health say its recall is degraded, another session is untouched, and
    once the disk takes writes again it pages out and /health is ok."""
    import errno
    import shutil

    from localheap.heap.pages import PageStore

    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        a, b = (http.post("/v1/sessions").json()["id"] for _ in range(2))
        write = PageStore._pwrite

        def full_for_a(self, layer, data, offset):
            if a in str(self.root):
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(self, layer, data, offset)

        monkeypatch.setattr(PageStore, "_pwrite", full_for_a)
        r = chat(http, SHORT_DOC + " What does the heap keep?", headers={"X-Session-Id": a})
        assert r.status_code == 200, r.text
        pages = r.json()["localheap"]["heap"]["pages"]
        assert pages["pages_failed"] > 0 and pages["pages"] == 0 and "No space" in pages["degraded"]
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert len(health.json()["degraded"]) == 1 and a in health.json()["degraded"][0]
        other = chat(http, SHORT_DOC + " And the sinks?", headers={"X-Session-Id": b})
        assert other.status_code == 200
        assert other.json()["localheap"]["heap"]["pages"]["pages"] > 0
        assert other.json()["localheap"]["heap"]["pages"]["degraded"] is None

        monkeypatch.undo()                               # space is back: page-out resumes
        r = chat(http, SHORT_DOC + " Once more?", headers={"X-Session-Id": a})
        assert r.status_code == 200 and r.json()["localheap"]["heap"]["pages"]["pages"] > 0
        assert http.get("/health").json()["status"] == "ok"

        shutil.rmtree(tmp_path / f"{a}.pages")           # a page store deleted under a running session
        r = chat(http, SHORT_DOC + " And again?", headers={"X-Session-Id": a})
        assert r.status_code == 200, r.text
        assert r.json()["localheap"]["heap"]["pages"]["pages_lost"] > 0
        health = http.get("/health").json()
        assert health["status"] == "degraded" and "removed" in health["degraded"][0]
        assert chat(http, "Fine?", headers={"X-Session-Id": b}).status_code == 200
        assert chat(http, "Still there?", headers={"X-Session-Id": a}).status_code == 200
        assert http.get("/health").json()["status"] == "ok"   # a turn without loss


def test_a_session_a_request_waits_for_or_with_nothing_on_disk_is_not_deleted(backend, tmp_path):
    """Taking space back deletes idle sessions whole as a last step: never one that a request waiting
    to start names (its client got 410 for a session it was about to use), nor one with nothing on
    disk (just created: deleting it gives no room)."""
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              disk_total=64 << 20)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        svc = srv.services
        assert svc.store.disk.waiting == svc.engine.admission.named   # the engine tells which are waited for
        ids = [chat(http, f"Document {i}. {SHORT_DOC}").headers["X-Session-Id"] for i in range(3)]
        empty = http.post("/v1/sessions").json()["id"]
        svc.store.disk.waiting = lambda: {ids[1]}   # as if a request for it were queued
        svc.engine.call(lambda: svc.store.disk.reclaim(1 << 40, set())).result()
        left = {s["id"] for s in http.get("/v1/sessions").json()["data"]}
        assert left == {ids[1], empty}, (ids, empty, left)
        svc.store.disk.waiting = svc.engine.admission.named
        for sid in (ids[1], empty):
            assert chat(http, "And the sinks?", headers={"X-Session-Id": sid}).status_code == 200


def test_the_sessions_jobs_passed_over_name_are_kept_while_a_later_one_is_placed():
    """admit() passes over a job that cannot start yet (waiting for RAM, its session busy) and places
    the next: that one's --disk-total room must not come from the session the first one names."""
    from types import SimpleNamespace as NS

    from localheap.engine.admission import AdmissionQueue
    from localheap.engine.errors import OverBudget

    class Store:
        disk = NS(waiting=set)
        sessions = {"Y": NS(busy=False), "Z": NS(busy=False)}

        def __contains__(self, sid):
            return sid in self.sessions

        def get(self, sid):
            return self.sessions[sid]

    store = Store()
    q = AdmissionQueue(NS(tokenizer=None), store, governor=None, timeout=60)
    first, second = (NS(cancelled=False, submitted=time.monotonic(), request=NS(session_id=sid)) for sid in "YZ")
    q.waiting.extend([first, second])
    kept = []

    def place(req, blocked=False):
        if req.session_id == "Y":
            raise OverBudget("no RAM for its heap yet")   # it waits
        kept.append(store.disk.waiting())   # what DiskTotal.reclaim leaves alone while Z is placed
        return None, False

    q.place = place
    q.admit(lambda: True, lambda job, match, created: None, lambda job, e: None, lambda job: None)
    assert kept == [{"Y", "Z"}] and list(q.waiting) == [first] and q.named() == {"Y"}


def test_checkpoints_go_after_pages_and_before_sessions(backend, tmp_path):
    """Sessions that read a document hold a checkpoint (a heap file, its tokens and hard links of
    the pages). Under the bound, the least recently used give theirs back (the pages the
    checkpoint shared with them then go too), and no session is deleted while that suffices."""
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              disk_total=3 << 20)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http, \
            Sampler(tmp_path) as du:
        ids = []
        for i in range(8):
            sid = http.post("/v1/sessions").json()["id"]
            done = http.post(f"/v1/sessions/{sid}/documents", json={"text": f"Document {i}. {SHORT_DOC}",
                                                                    "stream": False})
            assert done.status_code == 200, done.text
            ids.append(sid)
        sessions = {s["id"]: s for s in http.get("/v1/sessions").json()["data"]}
        m = metrics(http)
    assert du.peak <= 3 << 20, du.peak
    assert m["localheap_disk_reclaimed_checkpoints_total"] > 0 and m["localheap_disk_reclaimed_sessions_total"] == 0
    assert sessions[ids[0]]["checkpoints"] == [] and sessions[ids[0]]["reclaimed"]["checkpoints"] == 1
    assert sessions[ids[-1]]["checkpoints"] and sessions[ids[-1]]["reclaimed"] is None


def test_the_session_about_to_run_gives_back_its_own_checkpoint_then_pages(backend, tmp_path):
    """One session that read a document, alone under a bound that its next turn does not fit: no
    idle session can give the room, so it gives back its own checkpoint (whose links pin its page
    files) and then its lowest-value pages, and answers (it was a 507 on every retry). The
    directory never passes the bound; a bound that even all of that would not meet is still a 507."""
    from localheap.sessions.diskbudget import dir_bytes

    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              disk_total=64 << 20)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["id"]
        done = http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC + " " + DOC, "stream": False})
        assert done.status_code == 200, done.text
        store = srv.services.store
        s, disk = store.get(sid), store.disk
        while s.busy or dir_bytes(tmp_path) != (time.sleep(0.2) or dir_bytes(tmp_path)):   # its writes settled
            pass
        assert s.checkpoints and s.cache is not None
        used, least = dir_bytes(tmp_path), disk.reserve(s, pages=False) + disk._index_rewrite()
        pinned = s.cache.pages.shared_bytes
        cp = sum(p.stat().st_size for p in (store.checkpoints.root / sid).rglob("*")
                 if p.is_file() and p.stat().st_nlink == 1)
        pages = dir_bytes(store.pages_dir(s))
        assert pinned > 0 and pages > 4 * (cp + 4096), (pinned, pages, cp)
        disk.total = used + least - pinned - cp - pages // 4   # past what dropping the checkpoint gives back
        r = chat(http, "What does the heap keep?", headers={"X-Session-Id": sid})
        assert r.status_code == 200, r.text
        assert dir_bytes(tmp_path) <= disk.total, (dir_bytes(tmp_path), disk.total)
        info = http.get(f"/v1/sessions/{sid}").json()
        assert info["checkpoints"] == [] and info["reclaimed"]["checkpoints"] == 1, info["reclaimed"]
        assert info["reclaimed"]["pages"] > 0, info["reclaimed"]
        assert r.json()["localheap"]["heap"]["pages"]["pages_reclaimed"] > 0
        disk.total = 64 << 10   # less than its heap: nothing it gives back would do; refused, nothing taken
        before = files(tmp_path)
        r = chat(http, "And the sinks?", headers={"X-Session-Id": sid})
        assert r.status_code == 507 and r.json()["error"]["code"] == "disk_total_exceeded", r.text
        assert files(tmp_path) == before


def test_a_request_refused_after_the_idle_ones_gave_less_than_counted_keeps_its_own(backend, tmp_path, monkeypatch):
    """Idle sessions that give back less than counted on (a compaction that failed; pages other runs
    wrote meanwhile): the session about to run gives back its own checkpoint and pages only where that
    then fits. Where it would not, the 507 leaves them as they were (they were dropped, then the 507)."""
    from localheap.sessions.diskbudget import dir_bytes

    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              disk_total=64 << 20)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        store = srv.services.store
        idle = http.post("/v1/sessions").json()["id"]
        assert http.post(f"/v1/sessions/{idle}/documents", json={"text": DOC, "stream": False}).status_code == 200
        sid = http.post("/v1/sessions").json()["id"]
        assert http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC, "stream": False}).status_code == 200
        s, disk = store.get(sid), store.disk
        while s.busy or dir_bytes(tmp_path) != (time.sleep(0.2) or dir_bytes(tmp_path)):   # its writes settled
            pass
        disk.usage()
        used, least = disk.used, disk.reserve(s, pages=False) + disk._index_rewrite()
        own = disk._own_freeable(s) + s.cache.pages.shared_bytes
        held_by_idle = disk.by_session[idle]
        assert s.checkpoints and own > 0 and held_by_idle > 0
        disk.total = used - held_by_idle - own + least + held_by_idle // 2   # fits only if the idle one gives all
        monkeypatch.setattr(disk, "reclaim", lambda need, exclude: 0)   # it gives nothing
        before = {f: (tmp_path / f).stat().st_size for f in files(tmp_path)}
        r = chat(http, "What does the heap keep?", headers={"X-Session-Id": sid})
        assert r.status_code == 507 and r.json()["error"]["code"] == "disk_total_exceeded", r.text
        assert "kept for the running sessions' next saves" in r.json()["error"]["message"]
        assert {f: (tmp_path / f).stat().st_size for f in files(tmp_path)} == before   # its own untouched
        assert http.get(f"/v1/sessions/{sid}").json()["reclaimed"] is None


def test_a_checkpoint_or_fork_the_disk_refuses_is_a_507_and_the_checkpoint_stays(backend, tmp_path, monkeypatch):
    """A fork whose own copy of the checkpoint's pages the disk refused (ENOSPC) took the checkpoint
    for unreadable and deleted it; a checkpoints folder replaced by a file, or a checkpoint's files
    removed under the server, were 500s. Now: 507s that leave the checkpoint as it was, and a fork
    from a checkpoint whose files are gone reads its tokens again and forgets it."""
    import errno
    import shutil

    import localheap.backends.paging as paging

    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["id"]
        assert http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC, "stream": False}).status_code == 200
        (n,) = http.get(f"/v1/sessions/{sid}").json()["checkpoints"]
        folder = srv.services.store.checkpoints.root / sid
        kept = files(folder)
        assert any(".pages/" in f for f in kept), kept   # (recall evicted: the fork copies pages)

        def full(src, dst, state=None):
            raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))

        with monkeypatch.context() as m:
            m.setattr(paging, "copy_tree", full)
            r = http.post(f"/v1/sessions/{sid}/fork", json={"tokens": n})
            assert r.status_code == 507 and r.json()["error"]["code"] == "sessions_dir_unwritable", r.text
        assert http.get(f"/v1/sessions/{sid}").json()["checkpoints"] == [n] and files(folder) == kept
        assert len(http.get("/v1/sessions").json()["data"]) == 1   # (the fork's session is gone)
        # a request that reuses the checkpoint (an editor's completion after its warm-up) is not refused
        # for it: the disk full, its tokens are read again, and the checkpoint stays
        from localheap.engine import branching

        store = srv.services.store
        c = store.checkpoints.nearest(sid, n)

        def reuse():
            s = branching.new_branch(store, sid)
            try:
                branching.fork_into(store, s, c, strict=False)
                return list(s.fed) == list(c.tokens) and s.cache is not None
            finally:
                store.delete(s.id)

        with monkeypatch.context() as m:
            m.setattr(paging, "copy_tree", full)
            assert srv.services.engine.call(reuse).result(timeout=60)
        assert http.get(f"/v1/sessions/{sid}").json()["checkpoints"] == [n] and files(folder) == kept
        assert chat(http, "And then?", headers={"X-Session-Id": sid}).status_code == 200   # (a new point)
        root = srv.services.store.checkpoints.root
        root.rename(tmp_path / "aside")
        root.write_text("not a folder")
        r = http.post(f"/v1/sessions/{sid}/checkpoint")
        assert r.status_code == 507 and r.json()["error"]["code"] == "sessions_dir_unwritable", r.text
        root.unlink()
        (tmp_path / "aside").rename(root)
        assert http.post(f"/v1/sessions/{sid}/fork", json={"tokens": n}).status_code == 201
        shutil.rmtree(folder)   # removed under the server: the fork reads the tokens again
        r = http.post(f"/v1/sessions/{sid}/fork", json={"tokens": n})
        assert r.status_code == 201 and r.json()["tokens"] == n, r.text
        assert http.get(f"/v1/sessions/{sid}").json()["checkpoints"] == []


def test_the_documents_own_checkpoint_asks_the_disk_total_for_room_first(backend, tmp_path, monkeypatch):
    """The automatic checkpoint after a document was written without asking --disk-total (the
    directory passed the bound by its heap file until the next reclaim): it is made only where it
    fits as the directory is (nothing taken back from other sessions for an optional file), and
    where it does not the document is read without it."""
    from localheap.sessions.diskbudget import DiskTotal

    asked = []
    fits = DiskTotal.fits

    def spy(self, nbytes):
        asked.append(nbytes)
        return fits(self, nbytes) if len(asked) == 1 else False

    monkeypatch.setattr(DiskTotal, "fits", spy)
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              disk_total=64 << 20)
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        for want in (1, 0):   # room, then none
            sid = http.post("/v1/sessions").json()["id"]
            done = http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC, "stream": False})
            assert done.status_code == 200, done.text
            assert len(http.get(f"/v1/sessions/{sid}").json()["checkpoints"]) == want
        assert metrics(http)["localheap_disk_reclaimed_bytes_total"] == 0
    assert len(asked) == 2 and asked[0] >= srv.services.store.heap_bytes()
