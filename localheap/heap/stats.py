"""Heap statistics: what a session's cache holds, for the CLI, the API and the UI."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V bytes one token costs across all layers."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


@dataclass
class LayerStats:
    layer: int
    capacity: int
    budget: int
    resident: int
    seen: int
    evicted: int
    evictions: int
    sinks: int
    recent: int
    recalled: int = 0      # resident slots holding recalled pages

    @property
    def heavy_hitters(self) -> int:
        """Resident slots kept for their score (neither sink nor recent window)."""
        return max(0, self.resident - self.sinks - self.recent - self.recalled)

    @property
    def free(self) -> int:
        return self.capacity - self.resident


@dataclass
class HeapStats:
    """Totals over the heap layers of one session (seen/resident are per layer, like a context)."""

    tokens_seen: int
    resident: int          # max over layers
    evicted: int           # tokens dropped by the busiest layer
    capacity: int          # max over layers
    kv_bytes: int          # allocated K/V bytes across all layers (does not grow)
    evictions: int
    layers: list[LayerStats] = field(default_factory=list)
    recalled: int = 0                  # resident recalled slots (max over layers)
    pages: Optional[dict] = None       # the page store's counters (recall on), else None

    def to_dict(self, per_layer: bool = True) -> dict:
        """dataclasses.asdict's dict (the pages' nested values copied too), with each layer's
        heavy_hitters and free, or without the layers. Built field by field: a busy session
        republishes its stats ten times a second, and asdict's generic walk took ~0.1 ms of the
        engine thread each time."""
        d: dict = {}
        for name in _HEAP_FIELDS:
            if name == "layers":
                if per_layer:
                    d["layers"] = [{**{n: getattr(ls, n) for n in _LAYER_FIELDS},
                                    "heavy_hitters": ls.heavy_hitters, "free": ls.free} for ls in self.layers]
            elif name == "pages":
                d["pages"] = _copied(self.pages)
            else:
                d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        text = (
            f"tokens seen {self.tokens_seen:,} | resident {self.resident:,}/{self.capacity:,} | "
            f"evicted {self.evicted:,} | KV {format_bytes(self.kv_bytes)}"
        )
        if self.pages is not None:
            p, last = self.pages, self.pages.get("last_recall")
            text += (f" | on disk {p['tokens_on_disk']:,} tokens ({format_bytes(p['disk_bytes'])}, "
                     f"{p['pages_dropped']:,} pages dropped) | recalled {self.recalled:,}")
            if last:
                text += f" in {last['ms']:.0f} ms"
        return text


_HEAP_FIELDS = tuple(f.name for f in fields(HeapStats))
_LAYER_FIELDS = tuple(f.name for f in fields(LayerStats))


def _copied(value):
    """A copy of plain data (dicts, lists, tuples of numbers and strings), as asdict makes of it."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def combine(layer_stats: list[LayerStats], kv_bytes: int, pages: Optional[dict] = None) -> HeapStats:
    return HeapStats(
        tokens_seen=max((s.seen for s in layer_stats), default=0),
        resident=max((s.resident for s in layer_stats), default=0),
        evicted=max((s.evicted for s in layer_stats), default=0),
        capacity=max((s.capacity for s in layer_stats), default=0),
        kv_bytes=kv_bytes,
        evictions=max((s.evictions for s in layer_stats), default=0),
        layers=layer_stats,
        recalled=max((s.recalled for s in layer_stats), default=0),
        pages=pages,
    )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
