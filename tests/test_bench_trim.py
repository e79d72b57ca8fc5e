"""`localheap bench trim` on a tiny random model: a client that trims its oldest messages to fit its
window, through two servers sharing the model (--cache-reuse on and off), turn by turn."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")


def test_cutting_reads_only_each_new_turn_where_reading_again_reads_the_window(model_dirs, capsys, torch_one_thread):
    from localheap.cli import main

    rc = main(["bench", "trim", "--model", str(model_dirs("llama")), "--backend", "torch", "--budget", "96",
               "--slack", "32", "--recent", "16", "--turns", "8", "--window", "160", "--question", "30",
               "--answer", "10", "--cache-reuse", "8", "--threads", "1", "--facts", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "trim" and "read: reuse" in out
    rows = result["rows"]
    assert [r["turn"] for r in rows] == list(range(1, 9))
    trimmed = [r for r in rows if r["messages"] < 2 * r["turn"]]
    assert trimmed and result["cuts"] == len(trimmed) == result["trimmed_turns"]
    for before, r in zip(rows, rows[1:]):
        if r in trimmed:   # the window slid: one arm cut its session, the other read the history again
            assert r["again_read"] == r["prompt"] and r["again_session"] != before["again_session"]
            assert r["reuse_session"] == before["reuse_session"]
        assert r["reuse_read"] < 60   # the new question, its template and the last reply's last token
    assert result["total"]["reuse"]["sessions"] == 1
    found = result["facts"]
    for arm in ("reuse", "again"):
        assert len(found[arm]["keys"]) == 2
        assert found[arm]["hits"] == sum(g == k for g, (_, k) in zip(found[arm]["keys"], found["planted"]))


def test_keys_in_the_middle_turns_message_must_stay_in_the_window(model_dirs, capsys, torch_one_thread):
    """--facts-in message: the keys open the middle turn's user message; asked at the end in each
    arm (the window still holds that message: checked, and a window too short for it is an error)."""
    from localheap.cli import main

    args = ["bench", "trim", "--model", str(model_dirs("llama")), "--backend", "torch", "--budget", "96", "--slack",
            "32", "--recent", "16", "--turns", "6", "--question", "30", "--answer", "10", "--cache-reuse", "8",
            "--threads", "1", "--facts", "2", "--facts-in", "message"]
    assert main(args + ["--window", "200"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["facts_in"] == "message" and "the middle turn's message" in out
    assert all(len(result["facts"][arm]["keys"]) == 2 for arm in ("reuse", "again"))
    assert result["cuts"] >= 1
    assert main(args + ["--window", "120"]) != 0
    assert "no longer holds" in capsys.readouterr().err


def test_a_run_that_trimmed_no_turn_says_so_rather_than_a_ratio_over_nothing():
    from localheap.bench.report import table
    from localheap.bench.trim import report
    from localheap.heap import HeapConfig

    arm = {"read": 10, "seconds": 1.0, "trimmed_s": 0.0, "sessions": 1}
    result = {"rows": [], "total": {"reuse": arm, "again": arm}, "cuts": 0, "trimmed_turns": 0, "facts": None,
              "read_ratio": 1.0, "seconds_ratio": 1.0, "trimmed_seconds_ratio": None}
    text = report(result, HeapConfig(budget=64, recent=8, slack=16), 10, 8, table)
    assert "no turn was trimmed" in text and "0 trimmed turns" not in text
