"""Fair admission under the RAM budget: jobs that need a heap wait in arrival order (FIFO)
for one to free up, up to a timeout, then 503 (OverBudget) counted as rejected; fake backend."""

from __future__ import annotations

import time

from test_engine import FakeBackend, drain, make_engine, run

from localheap.engine import AdmitAll, Failed, Finished, Generate, OverBudget, Started
from localheap.governor import Admission


class OneHeap(AdmitAll):
    """Room for one resident heap: an idle one is spilled for the newcomer, a busy one blocks."""

    def __init__(self):
        self.refusals = 0

    def admit(self, resident, idle_lru):
        if resident < 1:
            return Admission("admit")
        if idle_lru:
            return Admission("admit", spill=list(idle_lru[:resident]))
        self.refusals += 1
        return Admission("reject", reason="over the RAM budget", retry_after_s=2)


def test_jobs_waiting_for_ram_start_in_arrival_order():
    gov = OneHeap()
    eng, backend = make_engine(FakeBackend(step_s=0.002), governor=gov, admission_timeout=20)
    try:
        streams = {}
        for name in ("a", "b", "c", "d", "e"):
            # a long prompt for b: under first-retry-wins it was the one that lost every race
            text = name * (400 if name == "b" else 3)
            _, events = run(eng, Generate, text, max_tokens=60 if name == "a" else 20)
            streams[name] = events
            if name == "a":
                assert isinstance(events.get(timeout=5), Started)   # a holds the only heap
        for name in ("b", "c", "d", "e"):
            evs = drain(streams[name], 20)
            assert isinstance(evs[0], Started) and isinstance(evs[-1], Finished), (name, evs)
        drain(streams["a"], 20)
        # a session is created when its job starts (a job sent back to wait keeps none)
        sessions = sorted(eng.store.sessions(), key=lambda s: s.created)
        assert [chr(s.fed[0]) for s in sessions] == list("abcde")
        assert gov.refusals >= 1                      # they did wait for room
        assert eng.counters.rejected == 0 and eng.counters.failed == 0 and eng.counters.finished == 5
    finally:
        eng.stop()


def test_waiting_for_ram_times_out_with_503_counted_as_rejected():
    eng, _ = make_engine(FakeBackend(step_s=0.002), governor=OneHeap(), admission_timeout=0.3)
    try:
        _, qa = run(eng, Generate, "long", max_tokens=2000)     # ~4 s holding the heap
        assert isinstance(qa.get(timeout=5), Started)
        t0 = time.monotonic()
        evs = drain(run(eng, Generate, "late")[1], 10)
        waited = time.monotonic() - t0
        assert isinstance(evs[-1], Failed) and isinstance(evs[-1].error, OverBudget)
        assert 0.25 <= waited < 3.0, waited
        assert eng.counters.rejected == 1 and eng.counters.failed == 0
    finally:
        eng.stop()
