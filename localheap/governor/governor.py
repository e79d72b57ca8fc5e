"""Governor: turns memory and thermal readings into decisions the engine applies.

It never touches sessions or tensors: it is told which sessions are resident and
idle (least recently used first) and answers admit / spill these / reject.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, Sequence

from .budget import MemoryPlan
from .thermal import read_thermal_state


@dataclass
class MemoryReading:
    rss: int                 # this process's resident set
    allocator_active: int    # backend allocator: live tensors
    allocator_cache: int     # backend allocator: freed but held
    available: int           # the system's available memory
    swap_used: int


class Sensors(Protocol):
    def memory(self) -> MemoryReading: ...
    def thermal(self) -> str: ...


class SystemSensors:
    """psutil for the process and the system, the backend for its allocator."""

    def __init__(self, backend_memory: Callable[[], dict] = lambda: {}, thermal_every_s: float = 5.0):
        import psutil
        self._proc = psutil.Process()
        self._psutil = psutil
        self._backend_memory = backend_memory
        self._thermal_every = thermal_every_s
        self._thermal = ("unknown", 0.0)

    def memory(self) -> MemoryReading:
        vm = self._psutil.virtual_memory()
        try:
            swap = self._psutil.swap_memory().used
        except Exception:
            swap = 0
        alloc = self._backend_memory() or {}
        return MemoryReading(rss=self._proc.memory_info().rss, allocator_active=int(alloc.get("active", 0)),
                             allocator_cache=int(alloc.get("cache", 0)), available=vm.available, swap_used=swap)

    def thermal(self) -> str:
        state, at = self._thermal
        if time.monotonic() - at > self._thermal_every:
            self._thermal = (read_thermal_state(), time.monotonic())
        return self._thermal[0]


@dataclass
class Admission:
    action: str                       # "admit" | "reject"
    spill: list[str] = field(default_factory=list)   # sessions to save to disk first, LRU first
    reason: str = ""
    retry_after_s: int = 0


@dataclass
class Throttle:
    state: str
    chunk: int              # prefill chunk to use
    pause_s: float          # sleep between chunks / decode bursts

    @property
    def active(self) -> bool:
        return self.pause_s > 0 or self.state in ("serious", "critical")


class Governor:
    """Holds the RAM budget as a promise and slows down when the machine is hot."""

    SYSTEM_MARGIN = 256 * 1024**2   # never take the system's last 256 MiB

    def __init__(self, plan: MemoryPlan, sensors: Sensors):
        self.plan = plan
        self.sensors = sensors
        self.spilled_total = 0
        self.rejected_total = 0

    def admit(self, resident: int, idle_lru: Sequence[str], new_heap: bool = True,
              extra: Optional[Mapping[str, int]] = None, size: Optional[int] = None) -> Admission:
        """May one more heap become resident? `resident` heaps are in RAM now; `idle_lru`
        are those that may be spilled (not serving a request), least recently used first;
        `extra`: bytes resident sessions hold beyond the planned heap, by id (a recall
        session's page summaries past the planned context, MemoryPlan.recall_extra). With
        `new_heap` False, which idle sessions to spill so the resident ones fit the plan
        (a session grew); that is never refused. `size`: the new heap's bytes where it is smaller
        than a session's (an embedding's, sized to its input)."""
        extra = extra or {}
        heap, free = self.plan.heap, self.plan.free_for_heaps
        add = (heap if size is None else min(size, heap)) if new_heap else 0
        cost = lambda sid: heap + extra.get(sid, 0)   # noqa: E731  what spilling `sid` frees
        used = resident * heap + sum(extra.values())
        need, freed = 0, 0
        while used - freed + add > free and need < len(idle_lru):       # by the plan
            freed += cost(idle_lru[need])
            need += 1
        short = used - freed + add > free
        if not new_heap:
            self.spilled_total += need
            return Admission("admit", spill=list(idle_lru[:need]),
                             reason=f"recall summaries grew: spilling {need} idle session(s)" if need else "")
        reading = getattr(self.sensors, "admission_memory", self.sensors.memory)()   # every rank's, on ranks
        while reading.rss + add - freed > self.plan.budget and need < len(idle_lru):  # by measurement
            freed += cost(idle_lru[need])
            need += 1
        if reading.available - add + freed < self.SYSTEM_MARGIN and need < len(idle_lru):
            freed += cost(idle_lru[need])
            need += 1   # the system itself is short: free one more rather than swap
        if short:
            self.rejected_total += 1
            busy = resident - len(idle_lru)
            return Admission("reject", reason=(
                f"over the RAM budget: {resident} heaps resident ({busy} busy), room for "
                f"{self.plan.max_resident}; try again when a request finishes"), retry_after_s=2)
        self.spilled_total += need
        return Admission("admit", spill=list(idle_lru[:need]),
                         reason=f"spilling {need} idle session(s) to disk" if need else "")

    def throttle(self, chunk: int) -> Throttle:
        state = self.sensors.thermal()
        if state == "critical":
            return Throttle(state, max(16, chunk // 4), 0.25)
        if state == "serious":
            return Throttle(state, max(16, chunk // 2), 0.05)
        return Throttle(state, chunk, 0.0)

    def snapshot(self) -> dict:
        r = self.sensors.memory()
        return {"ram_budget_bytes": self.plan.budget, "rss_bytes": r.rss, "allocator_active_bytes": r.allocator_active,
                "allocator_cache_bytes": r.allocator_cache, "system_available_bytes": r.available,
                "swap_used_bytes": r.swap_used, "weights_bytes": self.plan.weights, "heap_bytes": self.plan.heap,
                "runtime_bytes": self.plan.overhead, "activation_bytes": self.plan.activations,
                "max_resident_heaps": self.plan.max_resident, "spilled_total": self.spilled_total,
                "rejected_total": self.rejected_total, "thermal_state": self.sensors.thermal()}


def backend_limits(plan: MemoryPlan, platform: Optional[str] = None) -> dict:
    """Limits to set on the backend allocator so it cannot outgrow the budget."""
    model_and_heaps = plan.budget - 300 * 1024**2   # leave the interpreter its share
    return {"memory_limit": max(model_and_heaps, plan.weights + plan.heap + plan.activations),
            "cache_limit": min(512 * 1024**2, max(64 * 1024**2, plan.heap)),
            "wired_limit": plan.weights + plan.heap * max(1, plan.max_resident)}
