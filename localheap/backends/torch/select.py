"""Eviction on the device: every evicting layer's scores, selection and plan as batched torch work.

`localheap/heap` (numpy) is the specification: `select_keep` here returns exactly the
keep sets of `heap.selection.select_keep` for the same scores, ties included (a stable
sort of the negated scores: the older slot wins a tie), and `layer_scores` is each
policy's `score` on the device. Nothing here reads a tensor back to the host; the one
transfer of an event (keep indices for the host's position table) is `EvictionPlan.host_indices`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ...heap import LayerHeap
from ..paging import policy_keep
from ..slots import group_by_shape, split_keep_indices
from . import slab_cpu


def select_keep(scores: torch.Tensor, keep: int, sinks: int, recent: int,
                by_sort: Optional[bool] = None, kernel: Optional[bool] = None) -> torch.Tensor:
    """scores: [..., n] (higher = keep). Returns [..., min(n, keep)] ascending int64 slot indices:
    the first `sinks` and last `recent` slots, plus the best-scoring others (older wins ties).
    `by_sort`: rank by a stable sort (the default off the CPU) or pick by selection (the default
    on the CPU: the same slots, in a quarter of the time there). `kernel` (the selection on the
    CPU): the C++ one of slab_cpu (None: where it is built; True: required; False: torch's)."""
    return select_and_drop(scores, keep, sinks, recent, by_sort, kernel)[0]


def select_and_drop(scores: torch.Tensor, keep: int, sinks: int, recent: int, by_sort: Optional[bool] = None,
                    kernel: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """select_keep's slots, and where the CPU kernel picked them also the dropped ones ([..., n - keep]
    ascending, what EvictionGroup.evicted_slots gives; else None): one pass for both."""
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    arange = torch.arange(n, device=scores.device)
    if n <= keep:
        return arange.expand(*lead, n).clone(), None
    lo = min(sinks, n)                                       # candidates are the contiguous middle [lo, hi)
    hi = max(lo, n - recent) if recent > 0 else n
    n_free = keep - (n - (hi - lo))
    assert n_free >= 0, f"keep={keep} smaller than protected slots={n - (hi - lo)}"
    if by_sort is None:
        by_sort = scores.device.type != "cpu"
    if not by_sort:
        module = slab_cpu.selects(scores) if kernel is not False else None
        if kernel and module is None:
            raise RuntimeError(f"the selection kernel is not available: {slab_cpu.unavailable() or 'not built yet'}")
        if module is not None:   # one pass per row: nth_element, then the kept and the dropped slots in order
            kept, dropped = module.select_rows(scores.reshape(-1, n).contiguous(), keep, lo, hi)
            return kept.reshape(*lead, keep), dropped.reshape(*lead, n - keep)
        return _keep_mask(scores[..., lo:hi], n_free, lo, n).nonzero()[:, -1].reshape(*lead, keep), None
    order = torch.sort(-scores[..., lo:hi], dim=-1, stable=True).indices[..., :n_free] + lo
    fixed = torch.cat([arange[:lo], arange[hi:]]).expand(*lead, n - (hi - lo))
    return torch.sort(torch.cat([fixed, order], dim=-1), dim=-1).values, None


def _keep_mask(cands: torch.Tensor, n_free: int, lo: int, n: int) -> torch.Tensor:
    """[..., n] bool: the slots outside the candidates [lo, lo + m) and the n_free best candidates,
    the stable sort's pick without a sort: the n_free-th best score found by selection, every
    candidate better than it, then of those tied with it the oldest that fit, then (as the sort
    ranks NaN below -inf) the oldest NaN scores that still fit. No host read."""
    mask = torch.ones(*cands.shape[:-1], n, dtype=torch.bool, device=cands.device)
    m = cands.shape[-1]
    if n_free < m:
        key = -cands   # ascending: the better first, as the sort ranks them
        nan = key.isnan()
        key = key.masked_fill(nan, float("inf"))
        if n_free == 0:
            pick = torch.zeros_like(nan)
        else:
            kth = torch.kthvalue(key, n_free, dim=-1, keepdim=True).values
            better, tied = key < kth, (key == kth) & ~nan
            room = n_free - better.sum(-1, keepdim=True)   # places left after the better ones
            pick = better | (tied & (tied.cumsum(-1) <= room))
            room = room - tied.sum(-1, keepdim=True)      # (only where kth is +inf: every number is in)
            pick |= nan & (nan.cumsum(-1) <= room)
        mask[..., lo: lo + m] = pick
    return mask


def layer_scores(layer) -> torch.Tensor:
    """[H_kv, resident] importance of one HeapLayer's slots: its policy's score, on the device.

    float64 where the numpy policy computes in float64 with rounding (normalized h2o, noise), so
    the ranking is the specification's; plain copies of float32 buffers rank the same either way."""
    heap: LayerHeap = layer.heap
    cfg, n, H = heap.cfg, heap.resident, heap.n_kv_heads
    dev = layer.device
    if cfg.policy == "h2o":
        scores = layer.scores[:, :n]
        if cfg.h2o_normalize:
            scores = scores.double() / layer.counts[:, :n].double().clamp(min=1.0)
    elif cfg.policy == "snapkv":
        window = layer.window[:, :n]
        k = cfg.pool_kernel
        # max over a centred window; -inf padding equals numpy's edge padding under a max
        scores = F.max_pool1d(window[:, None, :], k, stride=1, padding=k // 2)[:, 0] if k > 1 and n else window
    elif cfg.policy == "geometry":
        scores = layer._geometry_scores()
    elif cfg.policy == "streaming":
        # the policy scores by original position, which grows with the slot index in every head
        scores = torch.arange(n, device=dev, dtype=torch.float32).expand(H, n)
    elif cfg.policy == "random":
        scores = torch.from_numpy(heap.policy.rng.random((H, n))).to(dev)   # the policy's own draws
    else:
        raise AssertionError(cfg.policy)
    if cfg.noise > 0:
        scores = scores.double()
        spread = scores.std(dim=-1, keepdim=True, unbiased=False) + 1e-12
        draws = torch.from_numpy(heap.noise_rng.standard_normal((H, n))).to(dev)
        scores = scores + draws * cfg.noise * spread
    return scores


@dataclass
class EvictionGroup:
    """Layers that evict together with the same resident count and keep size."""

    layers: list                         # HeapLayer
    keep_indices: torch.Tensor           # [B, H_kv, keep] int64, ascending, on the device
    deltas: Optional[torch.Tensor]       # [B, H_kv, keep] RoPE position change (compact), else None
    scores: Optional[torch.Tensor] = None   # [B, H_kv, resident] what the selection ranked (page values)
    dropped: Optional[torch.Tensor] = None  # [B, H_kv, resident - keep] evicted_slots, where the selection gave them

    @property
    def evicted(self) -> torch.Tensor:
        """[B, H_kv, resident] bool, True for the slots this event drops (for a hook that pages them out)."""
        n = self.layers[0].heap.resident
        kept = torch.zeros(*self.keep_indices.shape[:2], n, dtype=torch.bool, device=self.keep_indices.device)
        return ~kept.scatter_(-1, self.keep_indices, True)

    def evicted_slots(self) -> torch.Tensor:
        """[B, H_kv, resident - keep] ascending slots this event drops (for a page-out)."""
        if self.dropped is not None:
            return self.dropped
        n, keep = self.layers[0].heap.resident, self.keep_indices.shape[-1]
        if self.keep_indices.device.type == "cpu":   # each row has n - keep of them, in order
            return self.evicted.nonzero()[:, -1].reshape(*self.keep_indices.shape[:2], n - keep)
        # a stable sort puts the True (evicted) slots first, in order
        return torch.sort(self.evicted.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., : n - keep]


@dataclass
class EvictionPlan:
    """One eviction event: every layer that must make room, as device tensors."""

    groups: list[EvictionGroup]

    def host_indices(self) -> list:
        """Keep indices per layer as numpy arrays, in ONE device-to-host transfer for the event."""
        flat = torch.cat([g.keep_indices.reshape(-1) for g in self.groups]).cpu().numpy()
        return split_keep_indices(flat, [tuple(g.keep_indices.shape) for g in self.groups])

    def host_indices_later(self) -> Callable[[], list]:
        """host_indices without waiting: on CUDA the copy to pinned memory starts now, behind the
        event's work on the stream, and the returned function waits for that copy alone (done
        long before, by the time the next event or anything else reads positions)."""
        flat = torch.cat([g.keep_indices.reshape(-1) for g in self.groups])
        shapes = [tuple(g.keep_indices.shape) for g in self.groups]
        done = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = flat
        got: list = []

        def resolve() -> list:
            if not got:
                if done is not None:
                    done.synchronize()
                got.append(split_keep_indices(host.numpy(), shapes))
            return got[0]

        return resolve

    def keeps(self) -> list[int]:
        """Each layer's kept slot count (host_indices' widths), known on the host."""
        return [int(g.keep_indices.shape[-1]) for g in self.groups for _ in g.layers]

    @property
    def layers(self) -> list:
        return [layer for g in self.groups for layer in g.layers]

    def part(self, layers: list) -> "EvictionPlan":
        """The plan of `layers` alone (one session's, from an event planned over several):
        each group's rows for them, as `plan_eviction(layers)` would have planned them."""
        wanted = {id(layer) for layer in layers}
        groups = []
        for g in self.groups:
            rows = [b for b, layer in enumerate(g.layers) if id(layer) in wanted]
            if len(rows) == len(g.layers):
                groups.append(g)
            elif rows:
                at = torch.tensor(rows, device=g.keep_indices.device)
                pick = (lambda t: None if t is None else t.index_select(0, at))
                groups.append(EvictionGroup([g.layers[b] for b in rows], pick(g.keep_indices),
                                            pick(g.deltas), pick(g.scores), pick(g.dropped)))
        return EvictionPlan(groups)


def plan_eviction(layers: list) -> EvictionPlan:
    """Score and select for all `layers` at once: one stacked sort per (resident, keep) group."""
    groups = []
    for (_, keep), shaped in group_by_shape(layers, policy_keep).items():
        for members in _same_rule(shaped):
            cfg = members[0].heap.cfg
            scores = torch.stack([pinned_scores(layer) for layer in members])         # [B, H_kv, n]
            idx, dropped = select_and_drop(scores, keep, cfg.sinks, cfg.recent)
            deltas = torch.arange(idx.shape[-1], device=idx.device) - idx if cfg.positions == "compact" else None
            groups.append(EvictionGroup(members, idx, deltas, scores, dropped))
    return EvictionPlan(groups)


def _same_rule(layers: list) -> list[list]:
    """Layers split by what the selection reads from their config (sessions may differ in it)."""
    rules: dict[tuple, list] = {}
    for layer in layers:
        cfg = layer.heap.cfg
        rules.setdefault((cfg.sinks, cfg.recent, cfg.positions), []).append(layer)
    return list(rules.values())


def pinned_scores(layer) -> torch.Tensor:
    """layer_scores, with recalled slots ranked first: they stay until the next recall (LayerHeap.plan)."""
    scores = layer_scores(layer)
    heap = layer.heap
    if heap.n_recalled:
        pinned = torch.as_tensor(heap.recalled[:, : heap.resident], device=layer.device)
        scores = scores.masked_fill(pinned, float("inf"))
    return scores
