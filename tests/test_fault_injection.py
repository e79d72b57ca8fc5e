"""Byte flips, truncations and deleted files in every kind of session file, under a real
`localheap serve` (demo model, torch, recall on): the restart goes on, nothing answers 500, a
session whose heap file or page-store state is bad is rebuilt from its tokens, one whose page
records are bad answers without them (tombstoned, counted in /metrics), one whose tokens are
gone is session_lost (410), and an untouched session answers as its untouched twin did."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

import numpy as np  # noqa: E402
from commit_server import OPS, Server  # noqa: E402

from localheap.heap.pages import PageGeometry, record_dtype  # noqa: E402

DEMO_PAGES = PageGeometry(4, 2, 32, 8, "f16")   # the demo model's page records under commit_server.FLAGS
SHORT = [("doc", OPS[0][1][: len(OPS[0][1]) // 3]), OPS[1]]   # enough to page out past the heap's 96 tokens


def flip(path, at=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_pages(root, sid):
    """The last payload byte of every record of every layer: each fails its data check when read."""
    size = record_dtype(DEMO_PAGES).itemsize
    for f in sorted((root / f"{sid}.pages").glob("layer*.pages")):
        data = bytearray(f.read_bytes())
        for end in range(size, len(data) + 1, size):
            data[end - 1] ^= 0xFF
        f.write_bytes(bytes(data))


def only(root, pattern):
    found = sorted(root.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


DAMAGE = {
    "heap_flip": lambda root, sid: flip(only(root, f"{sid}.*.safetensors")),
    "heap_truncated": lambda root, sid: truncate(only(root, f"{sid}.*.safetensors")),
    "heap_deleted": lambda root, sid: only(root, f"{sid}.*.safetensors").unlink(),
    "state_flip": lambda root, sid: flip(only(root, f"{sid}.pages/state.*.npz")),
    "state_deleted": lambda root, sid: only(root, f"{sid}.pages/state.*.npz").unlink(),
    "pages_flip": damage_pages,
    "pages_truncated": lambda root, sid: [truncate(f) for f in (root / f"{sid}.pages").glob("layer*.pages")],
    # a checkpoint's heap file carries no CRC (a flip in its tensors goes unseen): truncated here
    "checkpoint_truncated": lambda root, sid: [truncate(f) for f in (root / "checkpoints" / sid).glob("*.safetensors")],
    "tokens_deleted": lambda root, sid: only(root, f"{sid}.*.tokens").unlink(),
    "tokens_flip": lambda root, sid: flip(only(root, f"{sid}.*.tokens")),
}
REBUILT = {"heap_flip", "heap_truncated", "heap_deleted", "state_flip", "state_deleted"}
LOST = {"tokens_deleted", "tokens_flip"}


def test_every_kind_of_damaged_file_costs_its_session_at_most(tmp_path):
    root = tmp_path / "sessions"
    srv = Server(root)
    try:
        ids = {}
        for name in ["good", "twin", *DAMAGE]:
            ids[name] = srv.create()
            for op in SHORT:   # a document (pages, a checkpoint) and a question (a recall)
                srv.op(ids[name], op)
        r = srv.ask(ids["twin"])
        assert r.status_code == 200
        twin_answer = r.json()["choices"][0]["message"]["content"]
        held = {name: srv.tokens(sid) for name, sid in ids.items()}
    finally:
        srv.kill()
    for name, damage in DAMAGE.items():
        damage(root, ids[name])

    srv = Server(root)
    try:
        listed = srv.sessions()
        for name, sid in ids.items():
            r = srv.ask(sid)
            if name in LOST:
                assert r.status_code == 410 and "session_lost" in r.text, (name, r.status_code, r.text)
                continue
            assert r.status_code == 200, (name, r.status_code, r.text, srv.output())
            assert listed[sid]["tokens"] == held[name], name
            if name == "good":   # untouched: as its twin answered before the restart
                assert r.json()["choices"][0]["message"]["content"] == twin_answer
            if name == "checkpoint_truncated":   # a fork from the bad checkpoint reads its tokens again
                at = listed[sid]["checkpoints"][0]
                f = httpx.post(f"{srv.url}/v1/sessions/{sid}/fork", json={"tokens": at}, timeout=600)
                assert f.status_code == 201, f.text
                assert f.json()["tokens"] == at and srv.ask(f.json()["id"]).status_code == 200
        m = srv.metrics()
        out = srv.output()
    finally:
        srv.kill()
    index = {e["id"]: e for e in json.loads((root / "index.json").read_text())["sessions"]}
    for name in REBUILT:   # saved again once rebuilt: a heap file with its CRC in the index
        e = index[ids[name]]
        assert e["gen"] >= 1 and e["heap_crc"] is not None and (root / f"{ids[name]}.{e['gen']}.safetensors").exists()
    assert "Traceback" not in out and " 500 " not in out, out
    assert m["localheap_sessions_rebuilt_total"] == len(REBUILT) + 1, out   # and the fork's checkpoint
    assert m["localheap_pages_corrupt_total"] > 0 or m["localheap_recall_failed_total"] > 0, out
    assert np.isfinite(m["localheap_pages_corrupt_total"])
