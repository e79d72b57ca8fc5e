"""Backend-agnostic heap logic (numpy only; never imports mlx or torch)."""

from .config import POLICIES, POSITION_MODES, HeapConfig, HeapConfigError
from .layer import HeapOverflow, LayerHeap, MergePlan, RepackPlan
from .pages import PageGeometry, PageStore
from .recall import PageWriter, score_pages, select_pages
from .policies import SlotView, make_policy, max_pool1d
from .selection import protected_mask, select_keep
from .stats import HeapStats, LayerStats, combine, format_bytes, kv_bytes_per_token

__all__ = [
    "POLICIES", "POSITION_MODES", "HeapConfig", "HeapConfigError", "HeapOverflow", "LayerHeap",
    "MergePlan", "PageGeometry", "PageStore", "PageWriter", "score_pages", "select_pages",
    "RepackPlan", "SlotView", "make_policy", "max_pool1d", "protected_mask", "select_keep",
    "HeapStats", "LayerStats", "combine", "format_bytes", "kv_bytes_per_token",
]
