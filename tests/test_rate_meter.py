"""RateMeter with explicit clocks: steady streams, sparse slow events, idle decay."""

from __future__ import annotations

import pytest

from localheap.engine.telemetry import RateMeter


def test_steady_decode_reads_its_rate_and_drops_to_zero_with_the_window():
    m = RateMeter(window_s=5.0)
    t = 100.0
    for _ in range(200):            # 20 tok/s for 10 s
        t += 0.05
        m.add(1, now=t, took=0.05)
    assert m.rate(now=t) == pytest.approx(20.0, rel=0.02)
    assert m.rate(now=t + 0.5) == pytest.approx(20.0 * 5 / 5.5, rel=0.02)
    assert m.rate(now=t + 5.01) == 0.0      # a finished stream reads 0 as before, not 30 s later


def test_slow_prefill_chunks_never_read_zero_between_them():
    # the issue: 512-token chunks over a 32K heap, 5 s each, back to back
    m = RateMeter(window_s=5.0)
    t = 0.0
    for _ in range(4):
        t += 5.0
        m.add(512, now=t, took=5.0)
    for dt in (0.0, 1.0, 2.5, 4.0, 4.99):   # between two chunks the UI samples every second
        r = m.rate(now=t + dt)
        assert 512 / 10.0 <= r <= 512 / 5.0 * 1.01, (dt, r)
    assert m.rate(now=t) == pytest.approx(1024 / 10.0)   # two chunks in the window: 2 x 512 in 10 s


def test_first_slow_chunk_is_timed_from_when_it_began():
    m = RateMeter(window_s=5.0)
    m.add(512, now=10.0, took=4.0)
    assert m.rate(now=10.5) == pytest.approx(512 / 4.5)   # not 512 / 0.5


def test_a_slow_event_decays_then_reads_zero_after_the_idle_period():
    m = RateMeter(window_s=5.0, idle_s=30.0)
    m.add(512, now=6.0, took=6.0)
    assert m.rate(now=6.0 + 17.0) == pytest.approx(512 / 23.0)   # 3 x 6 s: still counted
    assert m.rate(now=6.0 + 18.5) == 0.0
    m.add(512, now=100.0, took=20.0)                              # 3 x 20 s is capped at idle_s
    assert m.rate(now=129.0) > 0 and m.rate(now=130.5) == 0.0
    assert not m.events                                           # nothing kept past idle_s


def test_without_took_an_event_is_timed_from_the_one_before():
    m = RateMeter(window_s=5.0)
    m.add(512, now=0.0)
    m.add(512, now=6.0)
    assert m.rate(now=7.0) == pytest.approx(512 / 7.0)
    first = RateMeter()
    first.add(10, now=3.0)                                 # nothing to time it from: a 0.5 s floor
    assert first.rate(now=3.2) == pytest.approx(10 / 0.5)


def test_empty_meter_reads_zero():
    assert RateMeter().rate(now=1.0) == 0.0
