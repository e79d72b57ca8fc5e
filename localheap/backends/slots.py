"""What both backends' heap layers share: handing their score buffers to a SlotView, and
rolling back their newest tokens."""

from __future__ import annotations


class PendingView:
    """Mixin for a heap layer with `heap` (LayerHeap), optional `scores` / `counts` / `window`
    buffers [H_kv, capacity] and `_geometry_scores()`; works on mlx arrays and torch tensors alike."""

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
        for name in ("scores", "counts", "window"):
            arr = getattr(self, name)
            if arr is not None and new < old:
                arr[:, new:old] = 0
