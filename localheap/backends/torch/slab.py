"""DecodeSlab: the decode batch's heaps in one buffer per layer, read as one batch.

Row r of `keys[i]`/`values[i]` [R, H_kv, capacity_i, D] (and of each score array [R, H_kv,
capacity_i]) IS the heap layer i of the session in row r: while it decodes, that HeapLayer's
tensors are views of its row, so everything that works on one heap in place (eviction's gather
and re-rotation, page-out, stats) works unchanged, and a decode step attends all B rows in one
batched matmul, each row masked to its own resident slots. A heap joins when its session starts
decoding (one copy in) and leaves when the run ends (one copy out; the last row moves into the
hole), so the batch costs no copy per step. Rows share the heap config and buffer shapes.
Outputs follow the one-pass decode formulation (kernels/decode_attention's reference: scaled
matmul, softmax, matmul; the attention mass for the policy from the same probabilities), not
stock sdpa: logits within a tolerance of the heap alone (tests/test_torch_batch.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...heap import HeapConfig
from ..slots import SCORE_ARRAYS
from .cache import HeapCache


def slab_key(cache: HeapCache) -> Optional[tuple]:
    """What rows of one slab share; None where a heap cannot join one (a per-layer position shift:
    pyramid budgets; query statistics: the geometry policy; sliding layers)."""
    cfg: HeapConfig = cache.cfg
    if not cache.only_heap_layers or cfg.profile != "uniform" or cfg.needs_query_stats:
        return None
    shapes = tuple((tuple(layer.keys.shape), layer.keys.dtype, str(layer.device),
                    tuple(n for n in SCORE_ARRAYS if getattr(layer, n) is not None)) for layer in cache.heap_layers)
    return cfg, shapes


class DecodeSlab:
    """Rows of decoding heaps sharing a slab_key; `members[r]` is the cache in row r."""

    def __init__(self, key: tuple):
        self.key = key
        self.members: list[HeapCache] = []
        self.buffers: list[dict] = []    # per heap layer: name -> [R, ...] tensor
        self.rows = 0                    # allocated rows (R)

    # -- membership: one copy in, one copy out ------------------------------------------
    def join(self, cache: HeapCache) -> int:
        assert slab_key(cache) == self.key and not any(c is cache for c in self.members)
        if len(self.members) == self.rows:
            self._grow(max(1, 2 * self.rows))
        r = len(self.members)
        self.members.append(cache)
        for layer, bufs in zip(cache.heap_layers, self.buffers):
            for name, buf in bufs.items():
                own = getattr(layer, name)
                buf[r].copy_(own[0] if name in ("keys", "values") else own)
        self._bind(r)
        return r

    def leave(self, cache: HeapCache) -> None:
        r = next(i for i, c in enumerate(self.members) if c is cache)
        for layer, bufs in zip(cache.heap_layers, self.buffers):
            for name, buf in bufs.items():   # the heap gets buffers of its own again
                setattr(layer, name, buf[r: r + 1].clone() if name in ("keys", "values") else buf[r].clone())
        last = len(self.members) - 1
        if r != last:   # keep rows 0..B-1 dense: the last row moves into the hole
            for bufs in self.buffers:
                for buf in bufs.values():
                    buf[r].copy_(buf[last])
            self.members[r] = self.members[last]
            self._bind(r)
        self.members.pop()
        if not self.members:   # an idle slab holds no memory
            self.buffers, self.rows = [], 0

    def _grow(self, rows: int) -> None:
        old = self.buffers
        self.buffers = []
        for i in range(len(self.key[1])):
            shape, dtype, device, scores = self.key[1][i]
            _, H, cap, D = shape
            bufs = {"keys": torch.zeros(rows, H, cap, D, dtype=dtype, device=device),
                    "values": torch.zeros(rows, H, cap, D, dtype=dtype, device=device)}
            for name in scores:
                bufs[name] = torch.zeros(rows, H, cap, dtype=torch.float32, device=device)
            if old:
                for name, buf in bufs.items():
                    buf[: self.rows].copy_(old[i][name])
            self.buffers.append(bufs)
        self.rows = rows
        for r in range(len(self.members)):
            self._bind(r)

    def _bind(self, r: int) -> None:
        for layer, bufs in zip(self.members[r].heap_layers, self.buffers):
            for name, buf in bufs.items():
                setattr(layer, name, buf[r: r + 1] if name in ("keys", "values") else buf[r])

    # -- one decode step -----------------------------------------------------------------
    def append(self, layer_index: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """key_states/value_states: [1, H_kv, B, D], row b's new token (B = len(members))."""
        B = len(self.members)
        slots = [cache.heap_layers[layer_index].heap.append(1)[0] for cache in self.members]
        bufs = self.buffers[layer_index]
        rows = torch.arange(B, device=key_states.device)
        at = torch.tensor(slots, device=key_states.device)
        bufs["keys"][rows, :, at] = key_states[0].transpose(0, 1)       # [B, H_kv, D]
        bufs["values"][rows, :, at] = value_states[0].transpose(0, 1)
        self._resident = [s + 1 for s in slots]

    def attend(self, layer_index: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """query: [1, H_q, B, D], row b at its own position. Returns [1, B, H_q, D] (sdpa's layout)
        and adds each row's attention mass to its policy's score arrays."""
        B, (_, Hq, _, D) = len(self.members), query.shape
        bufs = self.buffers[layer_index]
        T = max(self._resident)
        keys, values = bufs["keys"][:B, :, :T], bufs["values"][:B, :, :T]         # [B, H_kv, T, D]
        H = keys.shape[1]
        q = query[0].transpose(0, 1).reshape(B, H, Hq // H, D)                    # [B, H_kv, G, D]
        logits = torch.matmul(q * scale, keys.transpose(-1, -2)).float()          # [B, H_kv, G, T]
        resident = torch.tensor(self._resident, device=query.device)
        valid = torch.arange(T, device=query.device)[None, :] < resident[:, None]  # [B, T]
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs.to(values.dtype), values)                        # [B, H_kv, G, D]
        self._accumulate(bufs, probs.sum(dim=2), valid, Hq // H, T)
        return out.reshape(B, Hq, D)[None]

    def _accumulate(self, bufs: dict, mass: torch.Tensor, valid: torch.Tensor, G: int, T: int) -> None:
        """HeapLayer.accumulate for one query per row: mass [B, H_kv, T] (zero past a row's slots)."""
        B = mass.shape[0]
        if "scores" in bufs:
            bufs["scores"][:B, :, :T] += mass
        if "window" in bufs:
            bufs["window"][:B, :, :T] += mass
        if "counts" in bufs:
            bufs["counts"][:B, :, :T] += G * valid[:, None, :].float()

