"""What both backends' heap layers and caches share: handing their score buffers to a SlotView,
rolling back their newest tokens, splitting an eviction event into stacked groups, and keeping a
decode batch row's own failure apart from the others'."""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from ..sessions.errors import RollbackRefused
from .paging import release_recalled


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


REWIND_FILL = 0.5   # a rewind keeps at least this share of the heap's tokens before the point (else: read again)


def rewind_least(heap) -> int:
    """Fewest tokens every KV head of a heap layer keeps in a rewind: REWIND_FILL of its heap,
    and past its sinks and recalled tokens."""
    return max(heap.cfg.sinks + heap.n_recalled + 1, math.ceil(REWIND_FILL * heap.keep))


class HeapRollback:
    """Mixin for a model cache with `heap_layers` (each with `heap`, `truncate` and `rewind`),
    `tokens_seen`, `only_heap_layers` (False where sliding or stock layers sit beside them),
    `stock_layers()`, `host_scores(layer)`, `cfg` and `pages` / `writer` (recall's page store, or None).

    Every point back to the latest repack is exact (truncate). Below it, one point more: the mark,
    where the latest turn's prompt was read and its reply not begun, which the next turn comes back
    to when the chat template rewrites the reply (reasoning dropped, a tool call re-serialized).
    Where the reply evicted, the heap layers come back by a rewind: they forget the tokens after
    the mark and keep the older ones they hold (less what the reply's evictions took, which went to
    the page store with recall on), the heap a different eviction would have left. Reading the
    conversation again would choose a heap of the same budget anew; the rewind spares that read.
    It needs every heap layer to keep at least REWIND_FILL of its heap (`rewind_floor`). Only to
    the mark: a request that shares less (another conversation with the same system prompt, an
    edited earlier message) never undoes more of a long session than its latest reply.

    A stock layer (a sliding window) cannot bring back what it dropped, so `mark()` keeps its
    state, and a cache with such layers rolls back to its mark only (`rollback_mark`)."""

    mark_at: Optional[int] = None   # tokens held at mark()
    _marked: Optional[list] = None  # the stock layers' state then (None with only heap layers)
    rewinds = 0                     # rewinds done (stats, tests)
    cuts = 0                        # cuts done (stats, tests)

    def rollback_floor(self) -> int:
        """Fewest tokens the cache can be rolled back to anywhere at or above: exactly back to the
        latest repack of any heap layer, by a rewind back to the mark; none below what it holds
        with other layers (see rollback_mark)."""
        if not self.only_heap_layers:
            return self.tokens_seen
        exact, at = self.heap_floor(), self.mark_at
        return at if at is not None and at < exact and self.rewindable(at) else exact

    def exact_floor(self) -> int:
        """rollback_floor() without rewinds (a sharded heap's ranks would pick apart)."""
        return self.heap_floor() if self.only_heap_layers else self.tokens_seen

    def heap_floor(self) -> int:
        return max(layer.heap.repacked_at for layer in self.heap_layers)

    def rewindable(self, seen: int) -> bool:
        lossy = self.rewind_floor()
        return lossy is not None and lossy <= seen

    def rewind_floor(self) -> Optional[int]:
        """Fewest tokens a rewind can keep: more than a heap holds (below that, reading the tokens
        again is cheap and evicts nothing: exact), and every heap layer's every KV head holds at
        least `rewind_least` tokens before it (None where one holds fewer in all, or --rewind off)."""
        if not self.cfg.rewind:
            return None
        floor = 0
        for layer in self.heap_layers:
            heap = layer.heap
            least = rewind_least(heap)
            if heap.resident < least:
                return None
            floor = max(floor, heap.keep + 1, int(heap.positions[:, least - 1].max()) + 1)   # positions ascend per head
        return floor

    def mark(self) -> None:
        """Remember this point (and the stock layers' state as it is now: window-sized, the sliding
        layers' K/V) so that the cache can come back here."""
        self._marked = None if self.only_heap_layers else \
            [(layer, self.copy_stock_state(vars(layer))) for layer in self.stock_layers()]
        self.mark_at = self.tokens_seen

    @property
    def saved_mark(self) -> Optional[int]:
        """The mark a heap file keeps: with only heap layers (the sliding layers' marked state
        stays in RAM, so a cache read back from disk has no mark)."""
        return self.mark_at if self.only_heap_layers else None

    def rollback_mark(self) -> Optional[int]:
        """The point below rollback_floor() a cache with stock layers can still be rolled back to,
        or None: its mark, with its heap layers truncated or rewound there."""
        at = self.mark_at
        if at is None or self._marked is None or at >= self.tokens_seen:
            return None
        return at if self.heap_floor() <= at or self.rewindable(at) else None

    def copy_stock_state(self, attrs: dict) -> dict:
        """A snapshot of a stock layer's attributes (torch's sliding layer rebinds new tensors on
        update, never edits one in place: a shallow copy is one; MLX's override copies its arrays)."""
        return dict(attrs)

    def _restore_marked(self) -> None:
        """The stock layers as they were at the mark (a copy: the mark stays usable)."""
        for layer, state in self._marked:
            vars(layer).clear()
            vars(layer).update(self.copy_stock_state(state))

    def truncate(self, seen: int) -> None:
        """Forget every token after the first `seen` (rollback_floor() <= seen, or seen == rollback_mark())."""
        to_mark = seen < self.tokens_seen and seen == self.rollback_mark()   # (only with stock layers)
        assert to_mark or self.rollback_floor() <= seen <= self.tokens_seen, \
            (seen, self.rollback_floor(), self.rollback_mark(), self.tokens_seen)
        if self.heap_floor() <= seen:
            for layer in self.heap_layers:
                layer.truncate(seen)
        else:
            self.rewind(seen)
        if to_mark:
            self._restore_marked()
        if self.mark_at is not None and self.mark_at > seen:
            self.mark_at, self._marked = None, None   # the tokens fed from here on are not the ones marked

    def rewind(self, seen: int) -> None:
        """The heap layers forget every token after the first `seen`, past their latest repack:
        first the page store (its pages holding such tokens tombstoned, the queued writes done:
        RollbackRefused if that fails, the heap untouched: the pages already forgotten only held
        tokens the recall tier may no longer bring back), then each layer's rewind."""
        if self.pages is not None:
            try:
                self.writer.drain()
                self.pages.forget_from(seen)
            except Exception as e:
                raise RollbackRefused(f"the page store did not forget the reply's pages: {e}") from e
        for layer in self.heap_layers:
            layer.rewind(seen, self.host_scores(layer))
        self.rewinds += 1

    def cuttable(self) -> bool:
        """Whether `cut` can take tokens out of the middle: RoPE positions in slot order (compact: a
        repack re-rotates the kept keys to their new places; absolute positions would keep the
        gap). A cache with sliding layers is cut where the spans allow it (cut_refusal)."""
        return self.cfg.positions == "compact"

    def stock_window(self, layer) -> int:
        """The tokens a stock (sliding-window) layer holds at most."""
        raise NotImplementedError

    def cut_refusal(self, spans: list) -> Optional[str]:
        """Why `spans` cannot be cut here (None: they can). A sliding layer cannot drop a span, but
        it runs at its own absolute positions (the heap's compact ones are not its), so it needs no
        change where its window lies in the last span: the spans must end where it stands (every
        token held) or at the mark (its state then is kept), and the last span must be at least
        a window long."""
        if self.only_heap_layers:
            return None
        end, last = spans[-1][1], spans[-1][1] - spans[-1][0]
        if end != self.tokens_seen and not (end == self.mark_at and self._marked is not None):
            return (f"a sliding-window layer keeps its state only as it is now ({self.tokens_seen} tokens) or at its "
                    f"mark, not at {end}")
        window = max(self.stock_window(layer) for layer in self.stock_layers())
        if last < window:
            return f"the last span kept ({last} tokens) is shorter than a sliding window ({window})"
        return None

    def cut(self, spans: list) -> int:
        """Keep only the tokens in `spans` (ascending disjoint [start, stop), the first from 0),
        joined end to end: what a client that trimmed old messages resends (--cache-reuse). The
        kept keys are re-rotated to their new positions; their K/V still carry what the cut
        tokens added to them (as llama.cpp's cache reuse, and unlike reading the shorter history
        again). With recall on, the page store is cut too (PageStore.cut: its tokens in the spans
        are recalled at their new places, the others forgotten), and the recalled slots are
        released first (their pages stay in the store). Each KV head is cut to the fewest any head
        keeps. Sliding layers are left as they are, or as they were at the mark where the spans end
        there (cut_refusal). Returns the tokens held now. RollbackRefused when the spans cannot be
        cut here, or the page store's disk refuses: the heap is as it was."""
        assert self.cuttable() and spans and spans[0][0] == 0, spans
        assert all(a < b <= c for (_, a), (b, c) in zip(spans, spans[1:])) and spans[-1][1] <= self.tokens_seen, spans
        refusal = self.cut_refusal(spans)
        if refusal is not None:
            raise RollbackRefused(refusal)
        to_mark = not self.only_heap_layers and spans[-1][1] < self.tokens_seen
        if self.pages is not None:
            try:
                self.writer.drain()
                self.pages.cut(spans)
            except Exception as e:
                raise RollbackRefused(f"the page store was not cut: {e}") from e
        release_recalled(self)
        for layer in self.heap_layers:
            layer.cut(spans, self.host_scores(layer))
        if to_mark:
            self._restore_marked()
        self.mark_at, self._marked = None, None
        self.cuts += 1
        return self.tokens_seen


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

    def rewind(self, seen: int, scores: np.ndarray) -> None:
        """Roll the layer back to its first `seen` tokens past its latest repack (LayerHeap.rewind_plan):
        a repack on the device that keeps only older slots. scores: [H_kv, resident] on the host."""
        plan, dropped = self.heap.rewind_plan(seen, scores)
        self.heap.seen = seen   # before apply: the repack is booked at `seen`, the floor from now on
        self.repack(plan, evicting=False)
        self.heap.evicted += dropped

    def cut(self, spans: list, scores: np.ndarray) -> None:
        """Keep only the tokens in `spans`, renumbered end to end (HeapRollback.cut): a repack on
        the device that re-rotates the kept keys. scores: [H_kv, resident] on the host."""
        plan, dropped = self.heap.keep_plan(spans, scores)
        self.repack(plan, evicting=False)
        self.heap.renumber(spans)
        self.heap.evicted += dropped

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
