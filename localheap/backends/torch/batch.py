"""Many heaps in one forward pass: the decode batch, with a prefill chunk riding in it.

The sessions' new tokens are packed into one ragged sequence [1, N] (a decode token per
decoding session, optionally one prefill chunk of another session): every per-token part of
the model (embeddings, norms, projections, MLP, logits) runs once over all N tokens, while
attention runs per segment over that session's own heap, exactly as the single-session path
runs it (attention.heap_sdpa). So each heap keeps its own slots, positions, eviction events,
scores, recall region and page store; only the summation order of the per-token matmuls may
change with N (greedy tokens equal on the CPU in float32, logits within a tolerance: tests).
Each decoding session samples its logits row with its own Sampler.
Knows nothing about sessions or requests: rows are (cache, sampler, next token).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...generation import ProgressFn, SamplingParams
from .cache import HeapCache
from .generate import Sampler, prefill_turn


class DecodeRow:
    """One session in the decode batch: its heap, its sampler, and the token it sampled last
    (on the device, not yet fed; `token` is its host copy)."""

    def __init__(self, cache: HeapCache, sampler: Sampler, logits: torch.Tensor):
        self.cache, self.sampler = cache, sampler
        self.logits = logits               # [vocab] fp32 the token was sampled from
        self.next = sampler.sample(logits)  # [1] int64 on the device
        self.token = int(self.next)


def start_row(model, cache: HeapCache, prompt: Sequence[int], params: SamplingParams,
              progress: Optional[ProgressFn] = None, cancelled=None) -> DecodeRow:
    """A turn's prompt (>= 1 token, recall included) fed on its own, and its first token sampled."""
    if len(prompt) == 0:
        raise ValueError("generation needs at least one new prompt token")
    sampler = Sampler(params, cache.device)
    logits = prefill_turn(model, cache, prompt, progress, cancelled)
    return DecodeRow(cache, sampler, logits)


def batchable(cache: HeapCache) -> bool:
    """Caches whose every layer is a heap (no sliding-window layer: its mask is the model's)."""
    return cache.only_heap_layers


class PackedLayer(CacheLayerMixin):
    """One model layer of a packed step: writes each segment's new K/V into that segment's heap
    layer and keeps what each heap layer returned for the attention function."""

    is_sliding = False
    is_compileable = False

    def __init__(self, step: "PackedStep", index: int):
        super().__init__()
        self.step, self.index = step, index
        self.is_initialized = True
        self.resident: list = []   # per segment: (keys, values) [1, H_kv, T_i, D]

    def lazy_initialization(self, key_states, value_states) -> None:
        raise AssertionError("a packed step writes into the segments' heaps")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states: [1, H_kv, N, D], segment i at its own positions."""
        self.resident = [cache.layers[self.index].update(key_states[:, :, a:b], value_states[:, :, a:b])
                         for cache, (a, b) in zip(self.step.caches, self.step.bounds)]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0   # the model's mask is unused: each segment builds its own

    def get_max_length(self) -> int:
        return -1


class PackedStep(Cache):
    """past_key_values (and heap=) for one forward over several heaps' segments."""

    packed = True

    def __init__(self, caches: list[HeapCache], lengths: list[int], n_layers: int):
        assert len({id(c) for c in caches}) == len(caches), "a heap appears once per step"
        self.caches = caches
        ends = list(accumulate(lengths))
        self.bounds = [(e - n, e) for e, n in zip(ends, lengths)]
        super().__init__(layers=[PackedLayer(self, i) for i in range(n_layers)])

    def segments(self, layer_index: int):
        """(cache, query slice, (keys, values)) per segment, for the attention function."""
        for cache, (a, b), kv in zip(self.caches, self.bounds, self.layers[layer_index].resident):
            yield cache, slice(a, b), kv


def forward_packed(model, segments: list[tuple[HeapCache, torch.Tensor]]) -> torch.Tensor:
    """segments: (cache, ids [n_i] on the device), each cache with room made for its n_i tokens.
    Returns the fp32 logits [S, vocab] of each segment's last token."""
    caches = [c for c, _ in segments]
    lengths = [int(ids.shape[0]) for _, ids in segments]
    positions = torch.cat([c.position_ids(n) for c, n in zip(caches, lengths)], dim=1)   # [1, N]
    ids = torch.cat([ids for _, ids in segments])[None]                                  # [1, N]
    last = torch.tensor(lengths, device=ids.device).cumsum(0) - 1
    step = PackedStep(caches, lengths, len(caches[0].layers))
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, past_key_values=step, use_cache=True,
                    logits_to_keep=last, heap=step)
    return out.logits[0].to(dtype=torch.float32)


def step_rows(model, rows: list[DecodeRow], chunk: Optional[tuple[HeapCache, Sequence[int]]] = None
              ) -> list[Optional[Exception]]:
    """Feed each row's pending token (and `chunk`: (cache, ids) of a prefill, riding in the same
    forward) in one pass; each row then samples its next token with its own sampler.

    Returns one entry per row, then one for the chunk: None when it advanced, else the error that
    stopped it before the forward (making room: an eviction event or its page-out), which leaves
    the others untouched. An error in the forward itself raises (every segment is suspect).
    One host read per step: the rows' sampled ids together."""
    errors: list[Optional[Exception]] = []
    segments: list[tuple[HeapCache, torch.Tensor]] = []
    live: list[DecodeRow] = []
    for row in rows:
        errors.append(_make_room(row.cache, 1))
        if errors[-1] is None:
            segments.append((row.cache, row.next))
            live.append(row)
    if chunk is not None:
        cache, ids = chunk
        errors.append(_make_room(cache, len(ids)))
        if errors[-1] is None:
            segments.append((cache, torch.as_tensor(list(ids), dtype=torch.long, device=cache.device)))
    if not segments:
        return errors
    logits = forward_packed(model, segments)
    if live:
        tokens = [row.sampler.sample(logits[i]) for i, row in enumerate(live)]   # each [1]
        host = torch.cat(tokens).tolist()
        for i, (row, token, value) in enumerate(zip(live, tokens, host)):
            row.logits, row.next, row.token = logits[i], token, value
    return errors


def _make_room(cache: HeapCache, n: int) -> Optional[Exception]:
    try:
        cache.make_room(n)
    except Exception as e:   # this segment's own failure: the others still step
        return e
    return None
