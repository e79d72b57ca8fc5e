"""What both backends' heap layers and caches share: handing their score buffers to a SlotView,
rolling back their newest tokens, splitting an eviction event into stacked groups, and keeping a
decode batch row's own failure apart from the others'."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np


def row_error(fn: Callable[[], object]) -> Optional[Exception]:
    """Run one batch row's own host-side work: its error, if any (the other rows still step)."""
    try:
        fn()
    except Exception as e:
        return e
    return None


def group_by_shape(layers: list, keep_of) -> dict:
    """(resident, keep) -> the layers that evict with those sizes, so each group selects as one stacked op."""
    groups: dict[tuple[int, int], list] = {}
    for layer in layers:
        groups.setdefault((layer.heap.resident, keep_of(layer.heap)), []).append(layer)
    return groups


def split_keep_indices(flat: np.ndarray, shapes: list) -> list:
    """One event's keep indices, fetched in one transfer as `flat`, back into one [H_kv, keep]
    array per layer; `shapes` are the groups' [B, H_kv, keep] in the order they were flattened."""
    out, at = [], 0
    for B, H, k in shapes:
        block = flat[at:at + B * H * k].reshape(B, H, k).astype(np.int64, copy=False)
        out.extend(block[b] for b in range(B))
        at += B * H * k
    return out


class HeapRollback:
    """Mixin for a model cache with `heap_layers` (each with `heap` and `truncate`), `tokens_seen`,
    and `only_heap_layers` (False where sliding or stock layers sit beside them)."""

    def rollback_floor(self) -> int:
        """Fewest tokens the cache can be rolled back to exactly: the latest repack of any heap
        layer; no rollback at all with other layers (a sliding window cannot bring back what it dropped)."""
        if not self.only_heap_layers:
            return self.tokens_seen
        return max(layer.heap.repacked_at for layer in self.heap_layers)

    def truncate(self, seen: int) -> None:
        """Forget every token after the first `seen` (rollback_floor() <= seen)."""
        assert self.rollback_floor() <= seen <= self.tokens_seen, (seen, self.rollback_floor(), self.tokens_seen)
        for layer in self.heap_layers:
            layer.truncate(seen)


SCORE_ARRAYS = ("scores", "counts", "window")


class PendingView:
    """Mixin for a heap layer with `heap` (LayerHeap), optional `scores` / `counts` / `window`
    buffers [H_kv, capacity], `qsum` / `qcount`, `_geometry_scores()` and `_copy` (an array's
    copy); works on mlx arrays and torch tensors alike."""

    def pending_view(self) -> dict:
        """Device arrays for a SlotView, each [H_kv, resident]."""
        n = self.heap.resident
        out = {}
        if self.scores is not None:
            out["attention"] = self.scores[:, :n]
        if self.counts is not None:
            out["counts"] = self.counts[:, :n]
        if self.window is not None:
            out["window"] = self.window[:, :n]
        if self.heap.cfg.needs_query_stats:
            out["geometry"] = self._geometry_scores()
        return out

    def truncate(self, seen: int) -> None:
        """Roll the layer back to its first `seen` tokens (exact back to heap.repacked_at).

        K/V of the dropped slots are overwritten by the next append; their score slots are
        cleared, since new tokens add onto them. Scores of the kept slots keep the attention
        the dropped queries paid them, as they would after any turn."""
        old = self.heap.resident
        new = self.heap.truncate(seen)
        for name in SCORE_ARRAYS:
            arr = getattr(self, name)
            if arr is not None and new < old:
                arr[:, new:old] = 0
                setattr(self, name, arr)   # an MLX slab row is a copy: write it back (a torch view: no-op)

    def snapshot(self) -> dict:
        """What a recall probe's forward changes, for `rollback` (slots past `resident` are free anyway)."""
        arrays = {n: self._copy(getattr(self, n)) for n in SCORE_ARRAYS if getattr(self, n) is not None}
        return {"counters": (self.heap.resident, self.heap.seen), "qsum": self.qsum, "qcount": self.qcount, **arrays}

    def rollback(self, snap: dict) -> None:
        self.heap.resident, self.heap.seen = snap["counters"]
        self.qsum, self.qcount = snap["qsum"], snap["qcount"]   # qsum is rebound, never edited in place
        for name in SCORE_ARRAYS:
            if name in snap:
                setattr(self, name, snap[name])
