"""`localheap bench slots` on a tiny random model: a session's next turn on fresh servers, its slot
file restored first against the prompt read again, interleaved; each arm's reuse as it must be."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")


def test_the_restored_arm_reads_only_the_follow_up_and_the_other_reads_it_all(model_dirs, capsys, torch_one_thread):
    from localheap.cli import main

    rc = main(["bench", "slots", "--model", str(model_dirs("llama")), "--backend", "torch", "--budget", "96",
               "--slack", "32", "--recent", "16", "--recall", "on", "--contexts", "64,300", "--repeats", "2",
               "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "slots" and "read / restore" in out
    assert [r["tokens"] for r in result["rows"]] == [64, 300]
    for r in result["rows"]:
        assert r["restore_cached"] == r["tokens"] and r["read_cached"] == 0
        assert all(len(v) == 2 for v in r["times"].values()) and r["file_mib"] > 0
    assert result["rows"][1]["file_mib"] > result["rows"][0]["file_mib"]   # past the heap: the page store too
