"""llama-server's slot save, restore and erase (POST /slots/ID?action=..., serve --slot-save-path;
engine/slotstate.py, sessions/slotfiles.py): a slot's session saved as one file, read back by
another server (its own sessions directory: a restart, or another machine) as a session that
continues as the saved one did, evicted tokens and page store included; erase forgets the slot's
session; a busy slot is waited for; another key's session is not the caller's to save or erase;
a failed save leaves the file as it was; names, files and slots that are no good are 400s, and
without --slot-save-path every action is llama-server's 501."""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from recall_checks import CFG

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    pytest.importorskip("fastapi")
    from localheap.backends.torch import TorchBackend
    from localheap.randmodel import build_random_model

    return TorchBackend.load(build_random_model("qwen2", tmp_path_factory.mktemp("model")), dtype=torch.float32)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def either(request, backend):
    """The random qwen2 on torch; the demo model on MLX (skipped where mlx is not installed)."""
    if request.param == "torch":
        return backend
    pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
    from localheap.backends.mlx import MLXBackend
    from localheap.models import demo_model_dir

    return MLXBackend.load(demo_model_dir())


def _server(backend, tmp_path, name: str, **kw):
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    settings = ServerSettings(web_dir=None, default_max_tokens=16, heap=CFG, sessions_dir=tmp_path / name,
                              **{"slot_save_path": tmp_path / "slots", **kw})
    return ServerThread(create_app(backend, settings))


def _ids(backend, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, backend.vocab_size, n).tolist()


def _complete(srv, prompt, n: int = 8, headers=None) -> dict:
    r = httpx.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0,
                                                  "return_tokens": True}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _slot(srv, i, action: str, status: int = 200, headers=None, **body):
    r = httpx.post(f"{srv.url}/slots/{i}", params={"action": action}, json=body or None, headers=headers, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_a_slot_file_read_back_by_another_server_continues_as_the_saved_session(either, tmp_path):
    backend = either
    prompt = _ids(backend, 300, seed=1)   # 300 tokens through a 96-slot heap: evictions, pages on disk
    follow = _ids(backend, 12, seed=2)
    with _server(backend, tmp_path, "a") as srv:
        _complete(srv, prompt, n=6)
        s = srv.services.store.get(srv.services.engine.slots.slots[0].last["session_id"])
        held = len(s.fed)
        saved = _slot(srv, 0, "save", filename="chat.bin")
        assert saved["n_saved"] == held and saved["n_written"] == (tmp_path / "slots" / "chat.bin").stat().st_size
        whole = list(s.fed) + follow   # (its reply as the session holds it: an EOS that ended it too)
        there = _complete(srv, whole)   # the saved session, continued in the server that saved it
        assert there["tokens_cached"] == held
    with tarfile.open(tmp_path / "slots" / "chat.bin") as tar:
        names = tar.getnames()
    assert names[0] == "localheap-slot.json" and names[-1] == f"{held}.safetensors"
    assert any(n.startswith(f"{held}.pages/") for n in names)   # the evicted tokens' page store went with it
    assert not list((tmp_path / "a" / "checkpoints" / ".slot-staging").glob("*"))   # staging removed

    with _server(backend, tmp_path, "b", persist_sessions=True) as srv:   # another sessions directory
        assert len(srv.services.store) == 0
        restored = _slot(srv, 3, "restore", filename="chat.bin")
        assert restored["n_restored"] == held and restored["n_read"] == saved["n_written"]
        sid = restored["localheap"]["session_id"]
        s = srv.services.store.get(sid)
        assert len(s.fed) == held and s.saved_tokens == held   # a durable store has it on disk at once
        view = httpx.get(srv.url + "/slots").json()[3]
        assert view["n_prompt_tokens_cache"] == held and view["localheap"]["session_id"] == sid
        here = _complete(srv, whole)
        assert here["tokens_cached"] == held and here["tokens"] == there["tokens"]
        assert here["timings"]["prompt_n"] == len(follow)   # what a client reads to see the restore held
        # the file's point is the session's first checkpoint: a prompt parting from the later tokens forks there
        assert srv.services.store.checkpoints.of(sid)[0].n == held
        again = _slot(srv, 0, "restore", filename="chat.bin")   # restored twice: two sessions, both the same
        assert again["localheap"]["session_id"] != sid and again["n_restored"] == held
    with _server(backend, tmp_path, "b", persist_sessions=True) as srv:   # restarted: the restored sessions kept
        kept = srv.services.store.get(again["localheap"]["session_id"])
        assert len(kept.fed) == kept.saved_tokens == held and kept.title == "slot file chat.bin"
        assert httpx.delete(f"{srv.url}/v1/sessions/{sid}").status_code == 200   # (it went on: whole, then a reply)
        again_here = _complete(srv, whole)
        assert again_here["tokens_cached"] == held and again_here["tokens"] == there["tokens"]


def test_erase_forgets_the_slots_session_and_an_unused_slot_saves_and_restores_nothing(backend, tmp_path):
    prompt = _ids(backend, 40, seed=3)
    with _server(backend, tmp_path, "a") as srv:
        done = _complete(srv, prompt, n=4)
        sid = srv.services.engine.slots.slots[0].last["session_id"]
        n = len(srv.services.store.get(sid).fed)
        assert _slot(srv, 0, "erase") == {"id_slot": 0, "n_erased": n}
        assert sid not in srv.services.store
        assert _complete(srv, prompt + done["tokens"], n=2)["tokens_cached"] == 0   # read anew
        assert _slot(srv, 0, "erase")["n_erased"] > 0 and _slot(srv, 0, "erase")["n_erased"] == 0
        web = httpx.post(srv.url + "/v1/sessions", headers={"X-Localheap-Client": "web"}).json()["id"]
        chat = {"model": srv.services.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "id_slot": 4}
        assert httpx.post(srv.url + "/v1/chat/completions", json=chat, headers={"X-Session-Id": web},
                          timeout=120).status_code == 200
        assert srv.services.engine.slots.slots[4].last["session_id"] == web
        assert _slot(srv, 4, "erase")["n_erased"] == 0 and web in srv.services.store   # the web UI's: let go only
        assert srv.services.engine.slots.slots[4].last is None
        empty = _slot(srv, 5, "save", filename="empty.bin")   # never used: llama-server saves an empty prompt
        assert empty["n_saved"] == 0
        assert _slot(srv, 5, "restore", filename="empty.bin")["n_restored"] == 0
        assert [s.id for s in srv.services.store.sessions()] == [web]   # nothing made


def test_a_busy_slot_is_saved_once_its_run_ends(backend, tmp_path):
    with _server(backend, tmp_path, "a") as srv:
        ended = {}

        def stream():
            # (long enough that the poll below sees it run on a machine many times faster than this one)
            body = {"prompt": _ids(backend, 30, seed=4), "n_predict": 1000, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", srv.url + "/completion", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    ended["at"] = time.monotonic()

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while not httpx.get(srv.url + "/slots").json()[0]["is_processing"]:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        saved = _slot(srv, 0, "save", filename="busy.bin")
        at = time.monotonic()
        t.join()
        assert at >= ended["at"] - 0.5   # answered after the run's last line, not while it ran
        sid = srv.services.engine.slots.slots[0].last["session_id"]
        assert saved["n_saved"] == len(srv.services.store.get(sid).fed) >= 30 + 999


def test_id_slot_runs_a_request_on_that_slot_so_each_slot_saves_its_own_conversation(backend, tmp_path):
    """A client keeping one conversation per slot (llama-server's id_slot): restore each into its slot,
    continue each there, save each slot again: each file holds its own conversation."""
    a, b = _ids(backend, 40, seed=11), _ids(backend, 60, seed=12)
    with _server(backend, tmp_path, "a") as srv:
        for slot, prompt in ((0, a), (1, b)):
            body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "id_slot": slot}
            assert httpx.post(srv.url + "/completion", json=body, timeout=120).json()["id_slot"] == slot
            _slot(srv, slot, "save", filename=f"conv{slot}.bin")
        assert _complete(srv, _ids(backend, 10, seed=13), n=1)["id_slot"] == 0   # none named: the lowest free
        r = httpx.post(srv.url + "/completion", json={"prompt": a, "n_predict": 1, "id_slot": 8}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot"
    with _server(backend, tmp_path, "b") as srv:
        held = {slot: _slot(srv, slot, "restore", filename=f"conv{slot}.bin")["n_restored"] for slot in (1, 0)}
        for slot in (1, 0):   # slot 1's conversation first: with the lowest free slot it would run on slot 0
            sid = srv.services.engine.slots.slots[slot].last["session_id"]
            follow = list(srv.services.store.get(sid).fed) + _ids(backend, 5, seed=14 + slot)
            body = {"prompt": follow, "n_predict": 3, "temperature": 0, "id_slot": slot}
            out = httpx.post(srv.url + "/completion", json=body, timeout=120).json()
            assert out["id_slot"] == slot and out["tokens_cached"] == held[slot]
        for slot in (0, 1):
            sid = srv.services.engine.slots.slots[slot].last["session_id"]
            again = _slot(srv, slot, "save", filename=f"conv{slot}.bin")
            assert again["n_saved"] == len(srv.services.store.get(sid).fed) > held[slot]
        assert _slot(srv, 0, "save", filename="x.bin")["n_saved"] != _slot(srv, 1, "save", filename="y.bin")["n_saved"]


def test_the_openai_routes_take_id_slot_too(backend, tmp_path):
    with _server(backend, tmp_path, "a") as srv:
        model = srv.services.model_id
        body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "id_slot": 3,
                "n": 2}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        sid = r.headers["X-Session-Id"]
        assert srv.services.engine.slots.slots[3].last["session_id"] == sid   # the first choice's
        assert _slot(srv, 3, "save", filename="chat.bin")["n_saved"] == len(srv.services.store.get(sid).fed)
        bad = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "a", "id_slot": 99}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "id_slot"


def test_a_request_for_a_busy_slot_waits_for_it_and_holds_up_no_other(backend, tmp_path):
    with _server(backend, tmp_path, "a") as srv:
        ended, out = {}, {}

        def post(key, body):
            out[key] = httpx.post(srv.url + "/completion", json=body, timeout=120).json()
            ended[key] = time.monotonic()

        long = threading.Thread(target=post, args=("long", {"prompt": _ids(backend, 20, seed=20), "n_predict": 1000,
                                                            "temperature": 0, "ignore_eos": True, "id_slot": 1}))
        long.start()
        deadline = time.monotonic() + 60
        while not httpx.get(srv.url + "/slots").json()[1]["is_processing"]:
            assert time.monotonic() < deadline and long.is_alive()
            time.sleep(0.01)
        pinned = threading.Thread(target=post, args=("pinned", {"prompt": _ids(backend, 20, seed=21), "n_predict": 1,
                                                                "id_slot": 1}))
        pinned.start()
        post("free", {"prompt": _ids(backend, 20, seed=22), "n_predict": 1})
        long.join()
        pinned.join()
        assert out["long"]["id_slot"] == out["pinned"]["id_slot"] == 1 and out["free"]["id_slot"] == 0
        assert ended["free"] < ended["long"]   # (the pinned one ran on slot 1: after the long one left it)


def test_a_slot_answers_for_its_callers_sessions_only(backend, tmp_path):
    with _server(backend, tmp_path, "a", api_keys=["key-a", "key-b"]) as srv:
        a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
        _complete(srv, _ids(backend, 30, seed=5), n=2, headers=a)
        sid = srv.services.engine.slots.slots[0].last["session_id"]
        # /slots shows b whether a's slot runs, nothing of a's request (its settings, stops, seed, counts)
        seen = {k: httpx.get(srv.url + "/slots", headers=h, timeout=60).json()[0] for k, h in (("a", a), ("b", b))}
        assert "params" in seen["a"] and seen["a"]["localheap"]["session_id"] == sid
        assert set(seen["b"]) == {"id", "is_processing", "n_ctx", "speculative"}, seen["b"]
        assert _slot(srv, 0, "save", headers=b, filename="b.bin")["n_saved"] == 0
        assert _slot(srv, 0, "erase", headers=b)["n_erased"] == 0 and sid in srv.services.store
        assert _slot(srv, 0, "save", headers=a, filename="a.bin")["n_saved"] > 0   # b's erase left a's hold as it was
        restored = _slot(srv, 1, "restore", headers=b, filename="b.bin")
        assert restored["n_restored"] == 0
        # a's file is not b's to read (as if missing) nor to replace
        assert "no slot file" in _slot(srv, 1, "restore", 400, headers=b, filename="a.bin")["error"]["message"]
        assert "another API key" in _slot(srv, 1, "save", 400, headers=b, filename="a.bin")["error"]["message"]
        assert _slot(srv, 1, "restore", headers=a, filename="a.bin")["n_restored"] > 0


def test_a_save_the_disk_refuses_leaves_the_file_as_it_was(backend, tmp_path, monkeypatch):
    from localheap.sessions import slotfiles

    with _server(backend, tmp_path, "a") as srv:
        _complete(srv, _ids(backend, 30, seed=6), n=2)
        _slot(srv, 0, "save", filename="keep.bin")
        before = (tmp_path / "slots" / "keep.bin").read_bytes()
        _complete(srv, _ids(backend, 50, seed=7), n=2)

        class Full:   # the slot file's rename refused (the module's own os: a checkpoint's writes go on)
            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def replace(*a, **kw):
                raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(slotfiles, "os", Full())
        r = httpx.post(srv.url + "/slots/0", params={"action": "save"}, json={"filename": "keep.bin"}, timeout=60)
        assert r.status_code == 507 and r.json()["error"]["code"] == "slot_save_path_unwritable", r.text
        monkeypatch.undo()
        assert (tmp_path / "slots" / "keep.bin").read_bytes() == before
        assert sorted(p.name for p in (tmp_path / "slots").iterdir()) == ["keep.bin"]   # no temp file left


def _tar(path, members: dict) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_names_files_and_slots_that_are_no_good_are_400s(backend, tmp_path):
    slots = tmp_path / "slots"
    with _server(backend, tmp_path, "a") as srv:
        _complete(srv, _ids(backend, 20, seed=8), n=2)
        _slot(srv, 0, "save", filename="good.bin")
        for name in ("../x.bin", "a/b", "", " a", "a.", ".hidden", "a\x00b", "x" * 256, None):
            body = {"filename": name} if name is not None else {}
            assert _slot(srv, 0, "save", 400, **body)["error"]["param"] == "filename"
        assert _slot(srv, "x", "save", 400, filename="a")["error"]["message"] == "Invalid slot ID"
        assert _slot(srv, 8, "save", 400, filename="a")["error"]["param"] == "id_slot"
        assert _slot(srv, 0, "jump", 400, filename="a")["error"]["param"] == "action"
        assert "no slot file" in _slot(srv, 0, "restore", 400, filename="missing.bin")["error"]["message"]

        (slots / "noise.bin").write_bytes(np.random.default_rng(0).bytes(5000))
        assert _slot(srv, 0, "restore", 400, filename="noise.bin")["error"]["param"] == "filename"
        with tarfile.open(slots / "good.bin") as tar:
            manifest = json.loads(tar.extractfile("localheap-slot.json").read())
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        other = {**members, "localheap-slot.json": json.dumps({**manifest, "model": "another/model"}).encode()}
        _tar(slots / "other.bin", other)
        assert "another/model" in _slot(srv, 0, "restore", 400, filename="other.bin")["error"]["message"]
        n = manifest["tokens"]
        escape = {"localheap-slot.json": members["localheap-slot.json"], f"{n}.tokens": members[f"{n}.tokens"],
                  f"{n}.pages/../../../../outside.txt": b"x", f"{n}.safetensors": members[f"{n}.safetensors"]}
        _tar(slots / "escape.bin", escape)
        _slot(srv, 0, "restore", 400, filename="escape.bin")
        assert not list(tmp_path.rglob("outside.txt"))
        torn = {**members, f"{n}.tokens": members[f"{n}.tokens"][:-4]}
        _tar(slots / "torn.bin", torn)
        _slot(srv, 0, "restore", 400, filename="torn.bin")
        outside = np.frombuffer(members[f"{n}.tokens"], np.int32).copy()
        outside[-1] = backend.vocab_size   # an id this model has not
        _tar(slots / "outside.bin", {**members, f"{n}.tokens": outside.tobytes()})
        assert "vocabulary" in _slot(srv, 0, "restore", 400, filename="outside.bin")["error"]["message"]
        assert len(srv.services.store) == 1   # none of those made a session
        leftovers = [p for p in (tmp_path / "a" / "checkpoints").iterdir() if p.name != ".slot-staging"]
        assert all(p.name in srv.services.store for p in leftovers)   # nor left an extraction behind
        assert not list((tmp_path / "a" / "checkpoints").glob(".slot-staging/*"))


def test_a_slot_file_whose_heap_cannot_be_read_is_restored_from_its_tokens(backend, tmp_path):
    """The tokens are the truth (as for a checkpoint): a heap file cut short is read again from them."""
    slots = tmp_path / "slots"
    with _server(backend, tmp_path, "a") as srv:
        _complete(srv, _ids(backend, 150, seed=9), n=2)
        n = _slot(srv, 0, "save", filename="good.bin")["n_saved"]
    with tarfile.open(slots / "good.bin") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    members[f"{n}.safetensors"] = members[f"{n}.safetensors"][:200]
    _tar(slots / "cut.bin", members)
    with _server(backend, tmp_path, "b") as srv:
        restored = _slot(srv, 0, "restore", filename="cut.bin")
        s = srv.services.store.get(restored["localheap"]["session_id"])
        assert restored["n_restored"] == n == len(s.fed) and srv.services.store.rebuilt == 1
        assert _complete(srv, list(s.fed) + _ids(backend, 5, seed=10), n=2)["tokens_cached"] == n


def test_without_a_slot_save_path_every_action_is_llama_servers_501(backend, tmp_path):
    with _server(backend, tmp_path, "a", slot_save_path=None) as srv:
        for action in ("save", "restore", "erase"):
            r = _slot(srv, 0, action, 501, filename="a.bin")
            assert r["error"]["message"].startswith("This server does not support slots action. Start it with "
                                                    "`--slot-save-path`")


def test_serve_makes_the_slot_directory_before_the_model_loads(tmp_path):
    from localheap.cli import build_parser
    from localheap.commands.serve import settings_from_args

    def parse(*args):
        return settings_from_args(build_parser().parse_args(["serve", *args]))

    assert parse().slot_save_path is None
    slots = tmp_path / "x" / "slots"
    slots.mkdir(parents=True)
    (slots / ".a.bin.0123abcd.localheap-tmp").write_bytes(b"a save a crash cut short")
    (slots / "a.bin").write_bytes(b"kept")
    assert parse("--slot-save-path", str(slots)).slot_save_path == slots
    assert sorted(p.name for p in slots.iterdir()) == ["a.bin"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--slot-save-path"):
        parse("--slot-save-path", str(tmp_path / "file" / "slots"))
