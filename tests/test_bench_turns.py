"""`localheap bench turns` on a tiny random model: a conversation whose template rewrites each reply,
past the heap, through two servers sharing the model (--rewind on and off), turn by turn."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")


def test_rewinding_reads_only_each_new_turn_where_reading_again_reads_the_conversation(model_dirs, capsys,
                                                                                       torch_one_thread):
    from localheap.cli import main

    rc = main(["bench", "turns", "--model", str(model_dirs("llama")), "--backend", "torch", "--budget", "96",
               "--slack", "32", "--recent", "16", "--turns", "6", "--question", "40", "--reasoning", "30",
               "--answer", "10", "--threads", "1", "--facts", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "turns" and result["heap"]["rewind"] is True and "read: rewind" in out
    rows = result["rows"]
    assert [r["turn"] for r in rows] == list(range(1, 7))
    for before, r in zip(rows, rows[1:]):
        grown = r["prompt"] - before["prompt"]   # this turn's answer sent back and its question
        assert r["again_read"] == r["prompt"] or r["again_session"] == before["again_session"]
        if r["rewind_session"] == before["rewind_session"]:
            assert r["rewind_read"] == grown   # only what is new since the reply began
    last = rows[-1]
    assert last["again_read"] == last["prompt"] > last["rewind_read"]   # past the heap: read again in full
    assert result["total"]["rewind"]["read"] < result["total"]["again"]["read"]
    assert result["total"]["rewind"]["sessions"] < result["total"]["again"]["sessions"]
    found = result["facts"]   # two keys planted in the first message, asked after the last turn in each arm
    assert len(found["planted"]) == 2 and "pass keys planted" in out
    for arm in ("rewind", "again"):
        assert len(found[arm]["keys"]) == 2
        assert found[arm]["hits"] == sum(g == k for g, (_, k) in zip(found[arm]["keys"], found["planted"]))
    assert found["rewind"]["read"] < last["rewind_read"] + 40 < found["again"]["read"]   # the first question:
    # rewound to where the last reply began, or the conversation read again
