"""Governor decisions with fake sensors: every branch."""

import pytest

from localheap.governor import BudgetTooSmall, Governor, MemoryPlan, MemoryReading, parse_size
from localheap.governor.thermal import (from_macos_speed_limit, from_temperature, read_linux_sysfs,
                                        read_macos, read_thermal_state)

MiB, GiB = 1024**2, 1024**3


class FakeSensors:
    def __init__(self, rss=1 * GiB, available=8 * GiB, thermal="nominal"):
        self.rss, self.available, self.state = rss, available, thermal

    def memory(self):
        return MemoryReading(rss=self.rss, allocator_active=0, allocator_cache=0, available=self.available, swap_used=0)

    def thermal(self):
        return self.state


@pytest.mark.parametrize("text,expected", [("12G", 12 * GiB), ("512M", 512 * MiB), ("1.5GiB", int(1.5 * GiB)),
                                           ("4096", 4096), ("2gb", 2 * GiB), (" 3 K ", 3072)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "twelve", "12X", "-1G", "0"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def plan(budget=4 * GiB, weights=1 * GiB, heap=512 * MiB, overhead=512 * MiB):
    return MemoryPlan(budget=budget, weights=weights, heap=heap, overhead=overhead)


def test_plan_counts_resident_heaps():
    assert plan().max_resident == 5          # (4 - 1 - 0.5) GiB / 0.5 GiB


def test_budget_too_small_says_what_fits():
    with pytest.raises(BudgetTooSmall) as e:
        plan(budget=1900 * MiB, heap=512 * MiB).check(heap_tokens=4100, bytes_per_token=128 * 1024)
    msg = str(e.value)
    assert "would fit (--budget)" in msg and "--ram-budget" in msg


def test_budget_smaller_than_weights_says_use_a_smaller_model():
    with pytest.raises(BudgetTooSmall, match="smaller or more quantized model"):
        plan(budget=1 * GiB, weights=2 * GiB).check(heap_tokens=4100, bytes_per_token=128 * 1024)


def test_admit_when_room():
    g = Governor(plan(), FakeSensors())
    a = g.admit(resident=2, idle_lru=["a", "b"])
    assert a.action == "admit" and a.spill == []


def test_existing_heap_is_always_admitted():
    g = Governor(plan(), FakeSensors(rss=100 * GiB))
    assert g.admit(resident=5, idle_lru=[], new_heap=False).action == "admit"


def test_spill_lru_when_plan_is_full():
    g = Governor(plan(), FakeSensors())
    a = g.admit(resident=5, idle_lru=["old", "newer"])
    assert a.action == "admit" and a.spill == ["old"]
    assert g.spilled_total == 1


def test_spill_more_when_measured_rss_is_over():
    # plan says there is room, but the process is already at the budget
    g = Governor(plan(), FakeSensors(rss=4 * GiB))
    a = g.admit(resident=1, idle_lru=["x", "y", "z"])
    assert a.action == "admit" and a.spill == ["x"]


def test_spill_when_system_is_short_of_memory():
    g = Governor(plan(), FakeSensors(available=600 * MiB))
    a = g.admit(resident=1, idle_lru=["x"])
    assert a.spill == ["x"]


def test_reject_when_nothing_can_be_spilled():
    g = Governor(plan(), FakeSensors())
    a = g.admit(resident=5, idle_lru=[])
    assert a.action == "reject" and a.retry_after_s > 0 and "RAM budget" in a.reason
    assert g.rejected_total == 1


def test_grown_recall_sessions_count_what_they_hold_past_the_plan():
    g = Governor(plan(), FakeSensors(rss=0))    # room for 5 heaps of 512 MiB
    # three resident, "a" holding 1 GiB of page summaries past its planned heap: 3.5 heaps in all
    a = g.admit(resident=3, idle_lru=["a", "b"], extra={"a": GiB})
    assert a.action == "admit" and a.spill == ["a"]          # spilling "a" frees its heap and the 1 GiB
    assert g.admit(resident=3, idle_lru=["b"], extra={"busy": 2 * GiB}).action == "reject"
    # no new heap: after a session grew, the LRU idle ones go until the plan fits again
    grew = g.admit(resident=5, idle_lru=["b", "c", "d"], new_heap=False, extra={"busy": GiB})
    assert grew.action == "admit" and grew.spill == ["b", "c"]
    assert g.admit(resident=5, idle_lru=["b"], new_heap=False).spill == []


def test_a_heap_sized_to_its_input_is_charged_its_own_bytes():
    """An embedding's heap (sized to its input) takes the room it holds, not a session's heap:
    a full plan makes room for it without spilling anyone; one as big as a session's spills."""
    g = Governor(plan(), FakeSensors(rss=0))    # room for 5 heaps of 512 MiB: 4.9 of them resident
    a = g.admit(resident=4, idle_lru=["a"], extra={"busy": 460 * MiB}, size=8 * MiB)
    assert a.action == "admit" and a.spill == []
    assert g.admit(resident=4, idle_lru=["a"], extra={"busy": 460 * MiB}, size=512 * MiB).spill == ["a"]
    assert g.admit(resident=4, idle_lru=["a"], extra={"busy": 460 * MiB}, size=10 * GiB).spill == ["a"]   # (at most a heap)


@pytest.mark.parametrize("state,chunk,paused", [("nominal", 256, False), ("fair", 256, False),
                                                ("unknown", 256, False), ("serious", 128, True),
                                                ("critical", 64, True)])
def test_throttle_by_thermal_state(state, chunk, paused):
    t = Governor(plan(), FakeSensors(thermal=state)).throttle(256)
    assert t.chunk == chunk and (t.pause_s > 0) == paused and t.state == state


def test_snapshot_has_the_figures_the_ui_shows():
    snap = Governor(plan(), FakeSensors()).snapshot()
    for key in ("ram_budget_bytes", "rss_bytes", "thermal_state", "spilled_total", "max_resident_heaps"):
        assert key in snap


@pytest.mark.parametrize("temp,crit,state", [(40, 100, "nominal"), (75, 100, "fair"), (88, 100, "serious"),
                                             (99, 100, "critical"), (50, 0, "unknown")])
def test_temperature_mapping(temp, crit, state):
    assert from_temperature(temp, crit) == state


@pytest.mark.parametrize("out,state", [
    ("CPU_Speed_Limit \t= 100\n", "nominal"), ("CPU_Speed_Limit = 85", "fair"),
    ("CPU_Speed_Limit = 60", "serious"), ("CPU_Speed_Limit = 30", "critical"),
    ("Note: No thermal warning level has been recorded", "nominal"), ("garbage", "unknown"),
    ("CPU_Speed_Limit = x", "unknown")])
def test_macos_pmset_mapping(out, state):
    assert from_macos_speed_limit(out) == state


def test_macos_reader_never_raises():
    def broken():
        raise FileNotFoundError("pmset")
    assert read_macos(broken) == "unknown"


def test_linux_sysfs_reader(tmp_path):
    zone = tmp_path / "thermal_zone0"
    zone.mkdir()
    (zone / "temp").write_text("90000\n")
    (zone / "trip_point_0_type").write_text("critical\n")
    (zone / "trip_point_0_temp").write_text("100000\n")
    assert read_linux_sysfs(str(tmp_path)) == "serious"
    (zone / "temp").write_text("not a number")
    assert read_linux_sysfs(str(tmp_path)) == "unknown"
    assert read_linux_sysfs(str(tmp_path / "missing")) == "unknown"


def test_thermal_state_on_this_machine_is_a_known_state():
    assert read_thermal_state() in ("nominal", "fair", "serious", "critical", "unknown")
    assert read_thermal_state(platform="plan9") == "unknown"
