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
from ...kernels.dispatch import CheckedKernel
from ..slots import SCORE_ARRAYS
from . import slab_cpu
from .cache import HeapCache


def slab_key(cache: HeapCache) -> Optional[tuple]:
    """What rows of one slab share; None where a heap cannot join one (per-layer buffer shapes:
    pyramid budgets; query statistics: the geometry policy; sliding layers). Rows whose layers sit
    at other positions than their session's (staggered evictions) are rotated on per layer."""
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
        self._index_of: Optional[list[int]] = None   # the step's slots that `_index` was built for
        self._index: tuple = ()
        self._resident: Optional[torch.Tensor] = None   # [B] int64: each row's slots this step
        self.graphs: dict = {}           # rows -> graphed.SlabGraph over these buffers (--cuda-graphs)

    # -- membership: one copy in, one copy out ------------------------------------------
    def join(self, cache: HeapCache) -> int:
        assert slab_key(cache) == self.key and not any(c is cache for c in self.members)
        if len(self.members) == self.rows:
            self.reserve(len(self.members) + 1)
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
            self.buffers, self.rows, self.graphs = [], 0, {}

    def reserve(self, rows: int) -> None:
        """Room for `rows` members: one allocation for the rows joining in one step (a power of
        two), not one per join (each copies the rows already in)."""
        if rows > self.rows:
            self._grow(1 << (rows - 1).bit_length())

    def _grow(self, rows: int) -> None:
        old = self.buffers
        self.buffers, self.graphs = [], {}   # graphs read the buffers they were captured over
        for i in range(len(self.key[1])):
            shape, dtype, device, scores = self.key[1][i]
            _, H, cap, D = shape
            # rows are written whole when a heap joins, and only members' rows are read: no zeroing
            bufs = {"keys": torch.empty(rows, H, cap, D, dtype=dtype, device=device),
                    "values": torch.empty(rows, H, cap, D, dtype=dtype, device=device)}
            for name in scores:
                bufs[name] = torch.empty(rows, H, cap, dtype=torch.float32, device=device)
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
        slots = tuple(cache.heap_layers[layer_index].heap.append(1)[0] for cache in self.members)
        bufs = self.buffers[layer_index]
        key_states = self._own_positions(layer_index, key_states)
        rows, at, self._mask = self._step_index(slots, key_states.device)
        bufs["keys"][rows, :, at] = key_states[0].transpose(0, 1)       # [B, H_kv, D]
        bufs["values"][rows, :, at] = value_states[0].transpose(0, 1)
        self._T = max(slots) + 1

    def _own_positions(self, layer_index: int, x: torch.Tensor) -> torch.Tensor:
        """x: [1, heads, B, D], row b rotated at its session's model-wide position. A row whose
        layer sits at another position (HeapCache.position_ids' rope_delta: staggered evictions)
        is rotated on by it, as the heap alone rotates its keys and query (one rotation per
        distinct shift, with the same call: the same bits). Only staggered heaps shift (slab_key
        keeps pyramid budgets out), so an unstaggered slab's step skips the look."""
        if not self.key[0].stagger:
            return x
        layers = [cache.heap_layers[layer_index] for cache in self.members]
        shifts = {layer.rope_delta for layer in layers} - {0}
        if not shifts:
            return x
        x = x.clone()
        for shift in shifts:
            rows = torch.tensor([b for b, layer in enumerate(layers) if layer.rope_delta == shift], device=x.device)
            x[:, :, rows] = layers[0].rope.rotate(x[:, :, rows], shift)
        return x

    def _step_index(self, slots: tuple, device) -> tuple:
        """(rows [B], slots [B], mask) for this step's appends; the layers of a step share them
        (uniform budgets: every layer appends at the same slot), so they are built once per step.
        mask: None when every row holds T slots, else [B, 1, 1, T] bool, True past a row's slots."""
        if self._index_of != slots:
            B, T = len(slots), max(slots) + 1
            resident = torch.tensor(slots, device=device) + 1
            mask = None
            if min(slots) != T - 1:
                mask = (torch.arange(T, device=device)[None, :] >= resident[:, None])[:, None, None, :]
            self._index_of = slots
            self._index = torch.arange(B, device=device), resident - 1, mask
            self._resident = resident
        return self._index

    def attend(self, layer_index: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """query: [1, H_q, B, D], row b at its own position. Returns [1, B, H_q, D] (sdpa's layout)
        and adds each row's attention mass to its policy's score arrays. One pass over the keys
        (logits, mask, softmax) and one over the values for all B rows together: slab_cpu's kernel
        where it is built and fits, else torch's batched matmuls (attend_reference)."""
        B, (_, Hq, _, D) = len(self.members), query.shape
        bufs = self.buffers[layer_index]
        query = self._own_positions(layer_index, query)
        T = self._T
        H = bufs["keys"].shape[1]
        q = query[0].transpose(0, 1).reshape(B, H, Hq // H, D) * scale            # [B, H_kv, G, D]
        args = (q, bufs["keys"], bufs["values"], self._resident, T, self._mask)
        if slab_cpu.fits(q.dtype, bufs["keys"], Hq // H) and slab_cpu.load() is not None:
            out, mass = _KERNEL((H, Hq // H, D), *args)
        else:
            out, mass = attend_reference(*args)
        self._accumulate(bufs, mass, Hq // H, T)
        return out.reshape(B, Hq, D)[None]

    def _accumulate(self, bufs: dict, mass: torch.Tensor, G: int, T: int) -> None:
        """HeapLayer.accumulate for one query per row: mass [B, H_kv, T], the G query heads'
        probabilities summed (zero past a row's slots)."""
        B = mass.shape[0]
        for name in ("scores", "window"):
            if name in bufs:
                bufs[name][:B, :, :T] += mass
        if "counts" in bufs:
            seen = torch.full((B, 1, T), float(G), device=mass.device)
            if self._mask is not None:
                seen.masked_fill_(self._mask[:, 0], 0.0)
            bufs["counts"][:B, :, :T] += seen


def attend_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, resident: torch.Tensor,
                     T: int, mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H_kv, G, D] scaled; keys, values: the slab's [R, H_kv, capacity, D]; row b attends its
    slots 0..resident[b]-1 (mask: [B, 1, 1, T] True past them, None when all hold T).
    Returns out [B, H_kv, G, D] and the attention mass [B, H_kv, T] float32: the G queries'
    probabilities summed (zero past a row's slots)."""
    B = q.shape[0]
    keys, values = keys[:B, :, :T], values[:B, :, :T]                         # [B, H_kv, T, D]
    logits = torch.matmul(q, keys.transpose(-1, -2)).float()                  # [B, H_kv, G, T]
    if mask is not None:
        logits.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    mass = probs.sum(dim=2) if probs.shape[2] > 1 else probs[:, :, 0]            # [B, H_kv, T]
    return torch.matmul(probs.to(values.dtype), values), mass


def _kernel(q, keys, values, resident, T, mask):
    return tuple(slab_cpu.load().attend(q.contiguous(), keys, values, resident, T))


def _agree(got, want, key) -> bool:
    """The kernel sums in another order than the matmuls: float32 ulps, far inside the batch's
    1e-4 logits tolerance (tests/test_torch_batch.py)."""
    return (torch.allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
            and torch.allclose(got[1], want[1], rtol=1e-3, atol=1e-6))


_KERNEL = CheckedKernel("slab attention", _kernel, attend_reference, _agree)
