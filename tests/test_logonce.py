"""Warnings about what clients send, once a name (server/logonce.py): bounded in what they log and keep."""

import logging

from localheap.server import logonce


def test_each_name_once_cut_short_and_a_bounded_number_kept(caplog, monkeypatch):
    monkeypatch.setattr(logonce, "_SEEN", {})
    msg = "options ignored: %s"
    with caplog.at_level(logging.WARNING, "localheap.server"):
        logonce.warn_once(msg, ["a", "b", "a"])
        logonce.warn_once(msg, ["a", "b"])
        logonce.warn_once(msg, ["x" * 10_000])
        lines = [r.getMessage() for r in caplog.records]
        assert lines[0] == "options ignored: a, b" and len(lines) == 2
        assert len(lines[1]) < 200 and lines[1].endswith("...")
        caplog.clear()
        logonce.warn_once(msg, [f"name{i}" for i in range(5000)])   # a client inventing names
        logonce.warn_once(msg, ["another"])
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "no more are" in lines[0] and len(lines[0]) < 2000
    assert len(logonce._SEEN[msg]) < logonce.SEEN + 2
