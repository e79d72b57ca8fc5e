"""From a loaded backend and a RAM budget to a checked plan and a running governor."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import psutil

from ..heap import HeapConfig
from .activations import prefill_activations, recall_plan_tokens, recall_summary_bytes, recall_token_bytes
from .budget import MemoryPlan, request_room
from .governor import Governor, SystemSensors, backend_limits

log = logging.getLogger("localheap.governor")

DEFAULT_SHARE = 0.75          # no --ram-budget: promise at most 75% of physical memory
# What neither the RSS measured at start nor the planned activations see: modules and caches
# the first requests load (routes, tokenizer, templates), allocator slack between chunks,
# thread stacks. Small: the activations themselves are computed, not covered by a margin.
RUNTIME_FLOOR = 32 * 1024**2


def default_budget() -> int:
    return int(psutil.virtual_memory().total * DEFAULT_SHARE)


def plan_for(backend: Any, cfg: HeapConfig, ram_budget: Optional[int]) -> MemoryPlan:
    """Weights + one heap per resident session + runtime, against the budget.

    Runtime is measured, not guessed: the process's RSS now (model loaded) minus the
    weights, plus 10% of the weights, the prefill activation peak computed from the model's
    shapes and the heap config (governor/activations.py), a small floor, and room for the
    prompts of requests in flight (which sets the prompt-token limit). With recall on, each
    heap also counts its page summaries at a base context (RECALL_BASE_TOKENS or what
    --disk-budget holds); a session past it counts what it grew by (MemoryPlan.recall_extra),
    and none grows past what the budget holds with it alone (MemoryPlan.recall_max_tokens).
    Raises BudgetTooSmall (with what would fit) when not even one heap fits.
    """
    budget = ram_budget or default_budget()
    rss = psutil.Process().memory_info().rss
    shapes = backend.model_shapes()

    weights = int(backend.weights_bytes)
    requests = request_room(budget)

    def plan_at(c: HeapConfig) -> MemoryPlan:
        activations = prefill_activations(shapes, c).total
        overhead = max(0, rss - weights) + weights // 10 + RUNTIME_FLOOR + activations + requests
        heap = int(backend.heap_bytes(c)) + recall_summary_bytes(shapes, c)
        return MemoryPlan(budget=budget, weights=weights, heap=heap, overhead=overhead, requests=requests,
                          activations=activations, recall_base_tokens=recall_plan_tokens(shapes, c),
                          recall_token_bytes=recall_token_bytes(shapes, c))

    plan = plan_at(cfg)
    fits = None if plan.max_resident >= 1 else largest_budget(cfg, lambda c: plan_at(c).max_resident >= 1)
    return plan.check(heap_tokens=cfg.layer_capacity(cfg.budget), bytes_per_token=backend.kv_bytes_per_token(),
                      fits_budget=fits)


def largest_budget(cfg: HeapConfig, fits: Callable[[HeapConfig], bool]) -> int:
    """The largest --budget under cfg's for which fits(cfg with it) (0: none). The prefill's
    activations grow with the heap, so what fits is searched, not divided out."""
    lo, hi = 0, cfg.budget - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            ok = fits(cfg.with_(budget=mid, recent=min(cfg.recent, mid),
                                recall_budget=min(cfg.recall_budget, max(1, mid // 2))))
        except ValueError:   # (a HeapConfigError: too small a budget for the other settings)
            ok = False
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    return lo


def governor_for(backend: Any, plan: MemoryPlan) -> Governor:
    """A governor on this machine's sensors; the backend's allocator limits set from the plan."""
    apply = getattr(backend, "apply_limits", None)
    if apply is not None:
        apply(backend_limits(plan))
    return Governor(plan, SystemSensors(backend_memory=getattr(backend, "memory", dict)))
