"""Live state for the web UI and /metrics: every session's heap, process memory against
the RAM budget, throughput. Reads published snapshots only; never waits on the engine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import psutil

from .services import Services

_PROCESS = psutil.Process()
log = logging.getLogger("localheap.server")
THROUGHPUT_SAMPLES = 300    # seconds of activity kept (idle seconds are not recorded)
SAMPLE_INTERVAL_S = 1.0


class ThroughputHistory:
    """Decode and prefill rates, one sample a second while the engine works: what the web UI
    shows again after a reload (the live rates read 0 once the engine is idle)."""

    def __init__(self, maxlen: int = THROUGHPUT_SAMPLES):
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=maxlen)

    def sample(self, svc: Services) -> None:
        c = svc.engine.counters
        decode, prefill = round(c.decode.rate(), 1), round(c.prefill.rate(), 1)
        if decode or prefill:
            self.samples.append((round(time.time(), 1), decode, prefill))

    async def run(self, svc: Services) -> None:
        """Sample until cancelled (the app's lifespan owns this task)."""
        while True:
            try:
                self.sample(svc)
            except Exception:   # a meter read racing the engine thread: skip this second
                log.debug("throughput sample failed", exc_info=True)
            await asyncio.sleep(SAMPLE_INTERVAL_S)


def governor(svc: Services) -> dict:
    return svc.governor.snapshot() if svc.governor is not None else {}


def memory(svc: Services, gov: dict) -> dict:
    infos = svc.store.infos()
    kv = sum((s["heap"] or {}).get("kv_bytes", 0) for s in infos if s["state"] == "resident")
    return {
        "rss_bytes": gov.get("rss_bytes", _PROCESS.memory_info().rss),
        "ram_budget_bytes": gov.get("ram_budget_bytes", svc.settings.ram_budget),
        "weights_bytes": svc.backend.weights_bytes,
        "kv_bytes": kv,
        "system_available_bytes": gov.get("system_available_bytes", psutil.virtual_memory().available),
        "swap_used_bytes": gov.get("swap_used_bytes", 0),
        "allocator_active_bytes": gov.get("allocator_active_bytes", 0),
        "allocator_cache_bytes": gov.get("allocator_cache_bytes", 0),
        "heap_bytes": gov.get("heap_bytes"),
        "runtime_bytes": gov.get("runtime_bytes"),
        "max_resident_heaps": gov.get("max_resident_heaps"),
        "spilled_total": gov.get("spilled_total", 0),
        "rejected_total": gov.get("rejected_total", 0),
    }


def history(svc: Services) -> dict:
    """What a page that just (re)loaded cannot have seen: every session's sparkline points
    [tokens seen, resident] and the throughput samples [time, decode, prefill] (tokens/s)."""
    return {"sessions": {s.id: [list(p) for p in s.history] for s in svc.store.sessions()},
            "throughput": [list(t) for t in svc.throughput.samples]}


def heap_snapshot(svc: Services, with_history: bool = False) -> dict:
    """One message of /v1/heap/events (the first of each stream carries the history)."""
    c, eng, gov = svc.engine.counters, svc.engine, governor(svc)
    snap = {
        "time": round(time.time(), 3),
        "model": svc.model_id,
        "sessions": svc.store.infos(),
        "memory": memory(svc, gov),
        "thermal": gov.get("thermal_state", "unknown"),
        "throughput": {"decode_tokens_per_s": round(c.decode.rate(), 1),
                       "prefill_tokens_per_s": round(c.prefill.rate(), 1)},
        "engine": {"active": eng.active, "waiting": eng.waiting, "in_flight": eng.in_flight},
    }
    if with_history:
        snap["history"] = history(svc)
    return snap


def page_rows(pages: list[dict]) -> list[tuple]:
    """The recall tier's page stores, summed over sessions (recall on)."""
    def total(key: str) -> int:
        return sum(p[key] for p in pages)

    return [
        ("pages_stored", "gauge", "pages of evicted KV on disk (one page: page_size tokens of one layer)",
         [("", total("pages"))]),
        ("pages_dropped_total", "counter", "pages dropped to stay inside --disk-budget",
         [("", total("pages_dropped"))]),
        ("pages_disk_bytes", "gauge", "bytes of the live pages on disk", [("", total("disk_bytes"))]),
        ("pages_summary_bytes", "gauge", "RAM for the page summaries", [("", total("summary_bytes"))]),
        ("recalls_total", "counter", "questions that recalled pages", [("", total("recalls"))]),
        ("recalled_tokens_total", "counter", "tokens recalled into heaps (per layer)",
         [("", total("recalled_tokens"))]),
    ]


def prometheus(svc: Services) -> str:
    """/metrics in the Prometheus text exposition format."""
    c, eng, gov = svc.engine.counters, svc.engine, governor(svc)
    mem = memory(svc, gov)
    thermal = gov.get("thermal_state", "unknown")
    infos = svc.store.infos()
    states = {"resident": 0, "spilled": 0, "empty": 0}
    for s in infos:
        states[s["state"]] = states.get(s["state"], 0) + 1
    heaps = [s["heap"] for s in infos if s["heap"]]
    rows = [
        ("requests_total", "counter", "requests accepted by the engine", [("", c.requests)]),
        ("requests_finished_total", "counter", "requests that ran to the end", [("", c.finished)]),
        ("requests_cancelled_total", "counter", "requests cancelled (client gone)", [("", c.cancelled)]),
        ("requests_failed_total", "counter", "requests that failed", [("", c.failed)]),
        ("requests_rejected_total", "counter", "requests refused with 503 (queue full)", [("", c.rejected)]),
        ("requests_active", "gauge", "requests being served round-robin", [("", eng.active)]),
        ("requests_waiting", "gauge", "requests queued", [("", eng.waiting)]),
        ("prompt_tokens_total", "counter", "prompt tokens of all requests", [("", c.prompt_tokens)]),
        ("cached_tokens_total", "counter", "prompt tokens reused from sessions", [("", c.cached_tokens)]),
        ("prefill_tokens_total", "counter", "tokens prefilled", [("", c.prefill_tokens)]),
        ("completion_tokens_total", "counter", "tokens generated", [("", c.completion_tokens)]),
        ("decode_tokens_per_second", "gauge", "decode throughput (5 s window)", [("", round(c.decode.rate(), 3))]),
        ("prefill_tokens_per_second", "gauge", "prefill throughput (5 s window)", [("", round(c.prefill.rate(), 3))]),
        ("sessions", "gauge", "sessions by state",
         [(f'{{state="{k}"}}', v) for k, v in sorted(states.items())]),
        ("session_spills_total", "counter", "heaps saved to disk", [("", svc.store.spills)]),
        ("session_restores_total", "counter", "heaps loaded from disk", [("", svc.store.restores)]),
        ("heap_tokens_seen", "gauge", "tokens fed into all heaps", [("", sum(h["tokens_seen"] for h in heaps))]),
        ("heap_tokens_resident", "gauge", "tokens resident in all heaps", [("", sum(h["resident"] for h in heaps))]),
        ("heap_tokens_evicted", "gauge", "tokens evicted from all heaps", [("", sum(h["evicted"] for h in heaps))]),
        ("heap_tokens_recalled", "gauge", "recalled tokens resident in all heaps (per layer)",
         [("", sum(h.get("recalled", 0) for h in heaps))]),
        *page_rows([h["pages"] for h in heaps if h.get("pages")]),
        ("kv_bytes", "gauge", "KV bytes of resident heaps", [("", mem["kv_bytes"])]),
        ("weights_bytes", "gauge", "model weight bytes", [("", mem["weights_bytes"])]),
        ("process_rss_bytes", "gauge", "resident set size of the server process", [("", mem["rss_bytes"])]),
        ("ram_budget_bytes", "gauge", "configured RAM budget (0 = none)", [("", mem["ram_budget_bytes"] or 0)]),
        ("allocator_active_bytes", "gauge", "backend allocator: live tensors", [("", mem["allocator_active_bytes"])]),
        ("allocator_cache_bytes", "gauge", "backend allocator: freed, held", [("", mem["allocator_cache_bytes"])]),
        ("system_available_bytes", "gauge", "memory the system has available", [("", mem["system_available_bytes"])]),
        ("swap_used_bytes", "gauge", "swap in use on the system", [("", mem["swap_used_bytes"])]),
        ("heap_bytes", "gauge", "bytes one session heap allocates", [("", mem["heap_bytes"] or 0)]),
        ("runtime_bytes", "gauge", "runtime share of the budget (measured at start)", [("", mem["runtime_bytes"] or 0)]),
        ("max_resident_heaps", "gauge", "heaps the RAM budget holds at once", [("", mem["max_resident_heaps"] or 0)]),
        ("budget_spills_total", "counter", "idle heaps spilled to stay in budget", [("", mem["spilled_total"])]),
        ("budget_rejections_total", "counter", "requests refused with 503 (over budget)", [("", mem["rejected_total"])]),
        ("thermal_state", "gauge", "thermal state (1 for the current one)",
         [(f'{{state="{s}"}}', int(s == thermal)) for s in ("nominal", "fair", "serious", "critical", "unknown")]),
    ]
    lines = []
    for name, kind, help_, samples in rows:
        lines += [f"# HELP localheap_{name} {help_}", f"# TYPE localheap_{name} {kind}"]
        lines += [f"localheap_{name}{labels} {value}" for labels, value in samples]
    return "\n".join(lines) + "\n"
