"""DecodeSlab on MLX: the decode batch's heaps in one buffer per layer, attended as one batch.

Row r of `buffers[i]["keys"]` / `["values"]` [R, H_kv, capacity, D] (and of each score array
[R, H_kv, capacity]) holds heap layer i of the session seated in row r. mlx has no views to write
through, so while a heap is seated the slab owns its buffers: the layer's attributes read its row
and write into it (cache.RowArray, Seat), and everything that works on one heap (eviction's gather
and re-rotation, page-out, recall's merge, rollback, stats, save) works unchanged on a seated one,
touching no other row. A heap joins when its session steps in the batch (one copy in) and leaves
when its run ends or it sits a step out (one copy out; the last row moves into the hole), so a
step copies nothing: per layer, one scatter per buffer writes the B new tokens, and one batched
pass masked per row attends all B rows (attention.explicit_attention where it is mlx's own
formulation, the policy's mass from its probabilities; else mlx's fused sdpa and a batched side
pass). Rows share the heap config and buffer shapes.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..slots import SCORE_ARRAYS
from . import attention

KV = ("keys", "values")


def slab_key(cache) -> Optional[tuple]:
    """What rows of one slab share; None where a heap cannot join one (a per-layer position shift:
    pyramid budgets; query statistics: the geometry policy; sliding layers; nothing fed yet)."""
    cfg = cache.cfg
    layers = cache.heap_layers
    if not cache.only_heap_layers or cfg.profile != "uniform" or cfg.needs_query_stats:
        return None
    if any(layer.seat is not None or layer.own.get("keys") is None for layer in layers):
        return None
    return cfg, tuple((tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype,
                       tuple(n for n in SCORE_ARRAYS if getattr(layer, n) is not None)) for layer in layers)


class Seat:
    """Heap layer `layer` of the cache in row `r` of `slab`: what cache.RowArray reads and writes."""

    def __init__(self, slab: "DecodeSlab", layer: int, r: int):
        self.slab, self.layer, self.r = slab, layer, r

    def row(self, name: str) -> Optional[mx.array]:
        buf = self.slab.buffers[self.layer].get(name)
        if buf is None:
            return None
        return buf[self.r: self.r + 1] if name in KV else buf[self.r]

    def put(self, name: str, slots: slice, value: mx.array) -> None:
        """row[..., slots] = value along the slot axis (keys/values [1, H_kv, n, D], scores [H_kv, n])."""
        buf = self.slab.buffers[self.layer][name]
        if name in KV:
            buf[self.r: self.r + 1, :, slots, :] = value
        else:
            buf[self.r, :, slots] = value


def seated_slab(cache) -> Optional["DecodeSlab"]:
    seat = cache.heap_layers[0].seat if cache.heap_layers else None
    return None if seat is None else seat.slab


class DecodeSlab:
    """Rows of decoding heaps sharing a slab_key; `members[r]` is the cache in row r."""

    def __init__(self, key: tuple):
        self.key = key
        self.members: list = []
        self.buffers: list[dict] = []    # per heap layer: name -> [R, ...] array
        self.rows = 0                    # allocated rows (R)
        self._index_of: Optional[tuple] = None
        self._index: tuple = ()

    # -- membership: one copy in, one copy out ------------------------------------------
    def join(self, cache) -> int:
        assert slab_key(cache) == self.key
        if len(self.members) == self.rows:
            self.reserve(len(self.members) + 1)
        r = len(self.members)
        self.members.append(cache)
        for i, layer in enumerate(cache.heap_layers):
            for name, buf in self.buffers[i].items():
                own = layer.own.pop(name)   # the slab's row is the heap's buffer now
                if name in KV:
                    buf[r: r + 1] = own
                else:
                    buf[r] = own
            layer.seat = Seat(self, i, r)
        return r

    def leave(self, cache) -> None:
        r = next(i for i, c in enumerate(self.members) if c is cache)
        last = len(self.members) - 1
        out = [{name: mx.array(buf[r: r + 1] if name in KV else buf[r]) for name, buf in bufs.items()}
               for bufs in self.buffers]                           # copies, not views of the slab
        moved = [] if r == last else [{name: mx.array(buf[last]) for name, buf in bufs.items()}
                                      for bufs in self.buffers]
        mx.eval(out, moved)   # before the move, which then updates the slab's buffers in place
        for layer, own in zip(cache.heap_layers, out):
            layer.seat = None
            layer.own.update(own)
        if r != last:   # keep rows 0..B-1 dense: the last row moves into the hole
            for bufs, rows in zip(self.buffers, moved):
                for name, row in rows.items():
                    bufs[name][r] = row
            self.members[r] = self.members[last]
            for layer in self.members[r].heap_layers:
                layer.seat.r = r
        self.members.pop()
        if not self.members:   # an idle slab holds no memory
            self.buffers, self.rows = [], 0

    def reserve(self, rows: int) -> None:
        """Room for `rows` members: one allocation for the rows joining in one step (a power of
        two), not one per join (each copies the rows already in)."""
        if rows > self.rows:
            self._grow(1 << (rows - 1).bit_length())

    def _grow(self, rows: int) -> None:
        old, self.buffers = self.buffers, []
        for i, (kshape, vshape, dtype, scores) in enumerate(self.key[1]):
            _, H, cap, D = kshape
            bufs = {"keys": mx.zeros((rows, H, cap, D), dtype), "values": mx.zeros((rows,) + vshape[1:], dtype)}
            for name in scores:
                bufs[name] = mx.zeros((rows, H, cap), mx.float32)
            if old:
                for name, buf in bufs.items():
                    buf[: self.rows] = old[i][name]
            self.buffers.append(bufs)
        self.rows = rows
        mx.eval(self.buffers)

    def arrays(self) -> list:
        """What a step evaluates, so each step's updates land in place."""
        return [buf for bufs in self.buffers for buf in bufs.values()]

    # -- one decode step -----------------------------------------------------------------
    def offsets(self, i: int) -> list[int]:
        """The position each row's token is rotated at in layer i (read before the append)."""
        return [cache.heap_layers[i].offset for cache in self.members]

    def append(self, i: int, keys: mx.array, values: mx.array) -> None:
        """keys/values: [B, H_kv, 1, D], row b's new token, each into its heap's next slot."""
        slots = tuple(cache.heap_layers[i].heap.append(1)[0] for cache in self.members)
        bufs = self.buffers[i]
        for name, new in (("keys", keys), ("values", values)):
            R, H, cap, D = bufs[name].shape
            flat = bufs[name].reshape(R * H * cap, D)     # a view: the scatter updates in place
            flat[self._step_index(slots, H, cap)[0]] = new.reshape(-1, D)
            bufs[name] = flat.reshape(R, H, cap, D)

    def _step_index(self, slots: tuple, H: int, cap: int) -> tuple:
        """(flat index [B*H] of each row's new slot, mask, T) for this step; the layers of a step
        share them (uniform budgets: every layer appends at the same slot), built once.
        mask: None when every row holds T slots, else [B, 1, 1, T] bool, True on a row's slots."""
        if self._index_of != (slots, H, cap):
            B, T = len(slots), max(slots) + 1
            at = np.asarray(slots)
            flat = (np.arange(B)[:, None] * H + np.arange(H)[None, :]) * cap + at[:, None]
            mask = None
            if min(slots) != T - 1:
                mask = mx.array(np.arange(T)[None, :] <= at[:, None])[:, None, None, :]
            self._index_of = (slots, H, cap)
            self._index = mx.array(flat.reshape(-1).astype(np.int32)), mask, T
        return self._index

    def attend(self, i: int, queries: mx.array, scale: float, sinks=None, **kwargs) -> mx.array:
        """queries: [B, H_q, 1, D], row b at its own position -> [B, H_q, 1, D]; each row's
        attention mass goes into its policy's score arrays."""
        B, Hq, _, D = queries.shape
        bufs = self.buffers[i]
        H, cap = bufs["keys"].shape[1:3]
        _, mask, T = self._index
        keys, values = bufs["keys"][:B, :, :T], bufs["values"][:B, :, :T]        # [B, H_kv, T, D]
        G = Hq // H
        cfg = self.key[0]
        if cfg.needs_attention and sinks is None and not kwargs \
                and attention.explicit_matches_stock(str(queries.dtype).split(".")[-1], str(mx.default_device())):
            rank = None if mask is None else (mask[:, :, None] if G > 1 else mask)   # to [B, H, G, 1, T]
            out, probs = attention.explicit_attention(queries, keys, values, scale, rank)
            self._accumulate(bufs, probs[:, :, :, 0, :], G, T, mask)
            return out
        if sinks is not None:
            kwargs["sinks"] = sinks
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, **kwargs)
        if cfg.needs_attention:   # the side pass: the queries against every row's keys, float32
            q = queries.astype(mx.float32).reshape(B, H, G, D) * scale
            logits = q @ keys.astype(mx.float32).swapaxes(-1, -2)               # [B, H_kv, G, T]
            if mask is not None:
                logits = mx.where(mask, logits, -mx.inf)
            self._accumulate(bufs, mx.softmax(logits, axis=-1, precise=True), G, T, mask)
        return out

    def _accumulate(self, bufs: dict, probs: mx.array, G: int, T: int, mask) -> None:
        """HeapKVCache.observe for one query per row: probs [B, H_kv, G, T], zero past a row's slots."""
        B = probs.shape[0]
        names = [n for n in ("scores", "window") if n in bufs]
        if names:
            mass = probs.astype(mx.float32).sum(axis=2)                          # [B, H_kv, T]
            for name in names:   # .at[].add: no view of the buffer is alive at the write, so it is in place
                bufs[name] = bufs[name].at[:B, :, :T].add(mass)
        if "counts" in bufs:
            seen = mx.full((B, 1, T), float(G)) if mask is None else mx.where(mask[:, 0], float(G), 0.0)
            bufs["counts"] = bufs["counts"].at[:B, :, :T].add(seen)
