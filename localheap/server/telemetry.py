"""Live state for the web UI and /metrics: every session's heap, process memory against
the RAM budget, throughput. Reads published snapshots only; never waits on the engine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Iterator, Optional

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..backends.paging import FAULTS
from ..sessions.diskbudget import dir_bytes
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
        "activation_bytes": gov.get("activation_bytes"),
        "max_resident_heaps": gov.get("max_resident_heaps"),
        "spilled_total": gov.get("spilled_total", 0),
        "rejected_total": gov.get("rejected_total", 0),
    }


def history(svc: Services, owner: Optional[str] = None) -> dict:
    """What a page that just (re)loaded cannot have seen: every session's sparkline points
    [tokens seen, resident] and the throughput samples [time, decode, prefill] (tokens/s)."""
    return {"sessions": {s.id: [list(p) for p in s.history] for s in svc.store.sessions() if s.owner == owner},
            "throughput": [list(t) for t in svc.throughput.samples]}


def heap_snapshot(svc: Services, owner: Optional[str] = None, with_history: bool = False) -> dict:
    """One message of /v1/heap/events: the sessions of `owner` (the caller's key); the first
    of each stream carries the history."""
    c, eng, gov = svc.engine.counters, svc.engine, governor(svc)
    snap = {
        "time": round(time.time(), 3),
        "model": svc.model_id,
        "sessions": svc.store.infos_of(owner),
        "memory": memory(svc, gov),
        "thermal": gov.get("thermal_state", "unknown"),
        "throughput": {"decode_tokens_per_s": round(c.decode.rate(), 1),
                       "prefill_tokens_per_s": round(c.prefill.rate(), 1)},
        "engine": {"active": eng.active, "waiting": eng.waiting, "in_flight": eng.in_flight},
    }
    if with_history:
        snap["history"] = history(svc, owner)
    return snap


def page_rows(pages: list[dict]) -> list[tuple]:
    """The recall tier's page stores, summed over sessions (recall on)."""
    def total(key: str) -> int:
        return sum(p[key] for p in pages)

    return [
        ("pages_stored", "gauge", "pages of evicted KV on disk (one page: page_size tokens of one layer)",
         [("", total("pages"))]),
        ("pages_dropped_total", "counter", "pages dropped to stay inside --disk-budget or the RAM budget's pages per session",
         [("", total("pages_dropped"))]),
        ("pages_disk_bytes", "gauge", "bytes of the live pages on disk", [("", total("disk_bytes"))]),
        ("pages_summary_bytes", "gauge", "RAM for the page summaries and spans", [("", total("summary_bytes"))]),
        ("recalls_total", "counter", "questions that recalled pages", [("", total("recalls"))]),
        ("recalled_tokens_total", "counter", "tokens recalled into heaps (per layer)",
         [("", total("recalled_tokens"))]),
    ]


class MetricsCollector:
    """/metrics through prometheus_client: localheap_* read from the engine's counters and
    published snapshots at scrape time (never waiting on the engine)."""

    def __init__(self, svc: Services):
        self.svc = svc

    def collect(self):
        svc = self.svc
        c, eng, gov = svc.engine.counters, svc.engine, governor(svc)
        mem = memory(svc, gov)
        thermal = gov.get("thermal_state", "unknown")
        infos = svc.store.infos()
        states = {"resident": 0, "spilled": 0, "empty": 0}
        for s in infos:
            states[s["state"]] = states.get(s["state"], 0) + 1
        heaps = [s["heap"] for s in infos if s["heap"]]
        counters = [
            ("requests", "requests accepted by the engine", c.requests),
            ("requests_finished", "requests that ran to the end", c.finished),
            ("requests_cancelled", "requests cancelled (client gone)", c.cancelled),
            ("requests_failed", "requests that failed (errors, not refusals)", c.failed),
            ("requests_rejected", "requests refused with 503 (queue full, over the RAM budget)", c.rejected),
            ("prompt_tokens", "prompt tokens of all requests", c.prompt_tokens),
            ("cached_tokens", "prompt tokens reused from sessions", c.cached_tokens),
            ("prefill_tokens", "tokens prefilled", c.prefill_tokens),
            ("completion_tokens", "tokens generated", c.completion_tokens),
            ("session_saves_failed", "saves of a session the disk refused (full, read-only), retries included",
             c.save_failures),
            ("session_spills", "heaps saved to disk", svc.store.spills),
            ("session_restores", "heaps loaded from disk", svc.store.restores),
            ("session_rollbacks", "sessions rolled back to a prompt's shared prefix (a rewritten or regenerated turn)",
             svc.store.rollbacks),
            ("session_rewinds", "of those, heaps rewound past an eviction (--rewind)", svc.store.rewinds),
            ("session_rollbacks_refused", "rewinds and cuts the page store's disk refused (the prompt read into a "
             "new session)", svc.store.rollbacks_refused),
            ("session_cuts", "sessions cut to a client's trimmed history (--cache-reuse)", svc.store.cuts),
            ("budget_spills", "idle heaps spilled to stay in budget", mem["spilled_total"]),
            ("budget_rejections", "heap admissions the RAM budget refused (each may be retried in the queue)",
             mem["rejected_total"]),
            ("disk_reclaimed_pages", "pages dropped from idle sessions to stay inside --disk-total",
             svc.store.disk.reclaimed.pages),
            ("disk_reclaimed_checkpoints", "checkpoints removed from idle sessions to stay inside --disk-total",
             svc.store.disk.reclaimed.checkpoints),
            ("disk_reclaimed_sessions", "idle sessions deleted to stay inside --disk-total",
             svc.store.disk.reclaimed.sessions),
            ("disk_reclaimed_bytes", "bytes freed in the sessions directory to stay inside --disk-total",
             svc.store.disk.reclaimed.bytes),
            ("pages_corrupt", "page records that failed their check when read (tombstoned; recall went on without them)",
             FAULTS.pages_corrupt),
            ("recall_failed", "questions (or layers of one) answered without recall after an internal failure of it",
             FAULTS.recall_failed),
            ("sessions_rebuilt", "sessions whose unreadable heap or page store was rebuilt from their tokens",
             svc.store.rebuilt),
        ]
        for name, help_, value in counters:
            yield CounterMetricFamily(f"localheap_{name}", help_, value=value)
        gauges = [
            ("requests_active", "requests being served round-robin", eng.active),
            ("requests_waiting", "requests queued", eng.waiting),
            ("decode_tokens_per_second", "decode throughput (5 s window, or the last slow step)", round(c.decode.rate(), 3)),
            ("prefill_tokens_per_second", "prefill throughput (5 s window, or the last slow chunk)", round(c.prefill.rate(), 3)),
            ("heap_tokens_seen", "tokens fed into all heaps", sum(h["tokens_seen"] for h in heaps)),
            ("heap_tokens_resident", "tokens resident in all heaps", sum(h["resident"] for h in heaps)),
            ("heap_tokens_evicted", "tokens evicted from all heaps", sum(h["evicted"] for h in heaps)),
            ("heap_tokens_recalled", "recalled tokens resident in all heaps (per layer)",
             sum(h.get("recalled", 0) for h in heaps)),
            ("kv_bytes", "KV bytes of resident heaps", mem["kv_bytes"]),
            ("weights_bytes", "model weight bytes", mem["weights_bytes"]),
            ("process_rss_bytes", "resident set size of the server process", mem["rss_bytes"]),
            ("ram_budget_bytes", "configured RAM budget (0 = none)", mem["ram_budget_bytes"] or 0),
            ("allocator_active_bytes", "backend allocator: live tensors", mem["allocator_active_bytes"]),
            ("allocator_cache_bytes", "backend allocator: freed, held", mem["allocator_cache_bytes"]),
            ("system_available_bytes", "memory the system has available", mem["system_available_bytes"]),
            ("swap_used_bytes", "swap in use on the system", mem["swap_used_bytes"]),
            ("heap_bytes", "bytes one session heap allocates", mem["heap_bytes"] or 0),
            ("runtime_bytes", "runtime share of the budget (measured at start)", mem["runtime_bytes"] or 0),
            ("activation_bytes", "planned prefill activation peak (of the runtime share)",
             mem["activation_bytes"] or 0),
            ("max_resident_heaps", "heaps the RAM budget holds at once", mem["max_resident_heaps"] or 0),
            ("max_prompt_tokens", "largest prompt one request may hold (from the RAM budget)",
             svc.settings.max_prompt_tokens or 0),
            ("heap_observers", "open /v1/heap/events streams", svc.observers),
            ("disk_total_bytes", "--disk-total: bytes the sessions directory may hold (0 = no bound)",
             svc.store.disk.total),
            ("disk_used_bytes", "bytes under the sessions directory (hard links once)", dir_bytes(svc.store.spill_dir)),
            ("degraded", "things /health reports as degraded (e.g. sessions whose page-out fails)",
             len(svc.store.degraded)),
            ("sessions_unsaved", "sessions whose latest turn is not on disk (kept in memory, retried)",
             len(eng.unsaved)),
            ("background_responses", "background /v1/responses queued or running",
             svc._backgrounds.running if svc._backgrounds is not None else 0),
            ("conversations", "/v1/conversations kept", len(svc._conversations) if svc._conversations is not None else 0),
        ]
        for name, help_, value in gauges:
            yield GaugeMetricFamily(f"localheap_{name}", help_, value=value)
        for name, kind, help_, samples in page_rows([h["pages"] for h in heaps if h.get("pages")]):
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"localheap_{name.removesuffix('_total')}", help_, value=samples[0][1])
        yield from llamacpp_metrics(c, eng)
        by_state = GaugeMetricFamily("localheap_sessions", "sessions by state", labels=["state"])
        for k, v in sorted(states.items()):
            by_state.add_metric([k], v)
        yield by_state
        temp = GaugeMetricFamily("localheap_thermal_state", "thermal state (1 for the current one)", labels=["state"])
        for s in ("nominal", "fair", "serious", "critical", "unknown"):
            temp.add_metric([s], int(s == thermal))
        yield temp


def llamacpp_metrics(c, eng) -> Iterator:
    """llama-server's metric names (its dashboards read them) from the engine's counters: prompt
    tokens read (not reused from a session) and predicted tokens, the seconds of the engine steps
    that ran them (a step that both decodes and reads a prompt counts in both; a short prompt read
    in the reply's first step counts there), decode steps, runs active and waiting."""
    decode, prefill = c.decode, c.prefill
    for name, help_, value in (
            ("prompt_tokens", "Number of prompt tokens processed.", c.prompt_tokens - c.cached_tokens),
            ("prompt_seconds", "Prompt process time", prefill.seconds_total),
            ("tokens_predicted", "Number of generation tokens processed.", c.completion_tokens),
            ("tokens_predicted_seconds", "Predict process time", decode.seconds_total),
            ("n_decode", "Total number of decode steps (llama_decode() calls that sampled)", decode.calls)):
        yield CounterMetricFamily(f"llamacpp:{name}", help_, value=value)
    for name, help_, value in (
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", prefill.average),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", decode.average),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
             decode.tokens_total / decode.calls if decode.calls else 0.0),
            ("requests_processing", "Number of requests processing.", eng.active),
            ("requests_deferred", "Number of requests deferred.", eng.waiting)):
        yield GaugeMetricFamily(f"llamacpp:{name}", help_, value=value)


def metrics_registry(svc: Services) -> CollectorRegistry:
    """One registry per app (tests run several apps in one process): localheap_* plus the
    process_* metrics (CPU, memory, open files) prometheus_client reads from /proc."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(svc))
    ProcessCollector(registry=registry)
    return registry


def prometheus(registry: CollectorRegistry) -> bytes:
    """/metrics in the Prometheus text exposition format."""
    return generate_latest(registry)
