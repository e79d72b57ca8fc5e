"""Many heaps in one forward pass on MLX: the decode batch.

The decoding sessions' next tokens are stacked as rows [B, 1]: every per-token part of the
model (embeddings, norms, projections, MLP, logits) runs once over the B rows, RoPE rotates each
row at its own heap's offset (an offset array [B]: mlx's rope takes one per row, bit for bit the
scalar offset), and attention runs per row over that session's own heap exactly as the
single-session path runs it (attention.heap_sdpa: same formulation, same scores for the policy).
So each heap keeps its own buffers, slots, positions, eviction events, scores, recall region and
page store; only the per-token matmuls may sum in another order with B (greedy tokens equal in
float32, logits within a tolerance: tests/test_mlx_batch.py).
A prefill chunk in the step cannot stack with one-token rows: it runs as its own forward, built
lazily beside the batch and evaluated with it (one evaluation per step, no shared matmuls).
Knows nothing about sessions or requests: rows are (cache, sampler, next token).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from ...generation import ProgressFn, SamplingParams
from . import attention
from .generate import prefill_turn, sampler_for
from .heapcache import HeapPromptCache


class DecodeRow:
    """One session in the decode batch: its heap, its sampler, and the token it feeds next
    (`next` [1] on the device; `token` its host copy once sampled). A row made with `prompt` has
    no token yet: its first step feeds the prompt (all but the last token as alone, recall
    included; the last one rides in the batch)."""

    def __init__(self, cache: HeapPromptCache, params: SamplingParams, prompt: Sequence[int]):
        if params.seed is not None:   # the global generator, seeded at the turn's start as alone
            mx.random.seed(params.seed)
        self.cache, self.sample = cache, sampler_for(params)
        self.prompt: Optional[list[int]] = list(prompt)
        self.next: Optional[mx.array] = None
        self.token: Optional[int] = None
        self.logprobs: Optional[mx.array] = None   # [vocab] the last token was sampled from

    def feed_prompt(self, model, progress: Optional[ProgressFn] = None, cancelled=None) -> None:
        """The prompt's head into the heap (prefill_turn: chunks, recall), its last token pending."""
        if self.prompt is not None:
            prompt, self.prompt = self.prompt, None
            prefill_turn(model, self.cache, prompt, self.cache.cfg.chunk, progress, cancelled)
            self.next = mx.array(prompt[-1:], dtype=mx.uint32)


def start_row(model, cache: HeapPromptCache, prompt: Sequence[int], params: SamplingParams,
              progress: Optional[ProgressFn] = None, cancelled=None, defer: bool = False) -> DecodeRow:
    """A turn's last prompt tokens (>= 1) and the first token sampled after them: fed now on its
    own, or with `defer` by the row's first step_rows."""
    if len(prompt) == 0:
        raise ValueError("generation needs at least one new prompt token")
    row = DecodeRow(cache, params, prompt)
    if not defer:
        row.feed_prompt(model, progress, cancelled)
        error = step_rows(model, [row])[0]
        if error is not None:
            raise error
    return row


def batchable(cache: HeapPromptCache) -> bool:
    """Caches whose every layer is a heap (a sliding-window layer's cache is mlx-lm's own)."""
    return cache.only_heap_layers


class RowsLayer:
    """Layer i of a stacked step: mlx-lm's cache protocol over the B rows' heap layer i. The
    model rotates row b at offset[b], hands each row's new K/V to its heap, then attends here."""

    def __init__(self, layers: list):
        self.layers = layers
        self.offset = mx.array([layer.offset for layer in layers])   # [B], read before the append
        self.fetched: list = []

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        assert N == 1, "a stacked step feeds one token per row"
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys/values: [B, H_kv, 1, D]; row b's go into heap b (its own buffer and slots)."""
        self.fetched = [layer.update_and_fetch(keys[b: b + 1], values[b: b + 1])
                        for b, layer in enumerate(self.layers)]
        return keys, values

    def attend_rows(self, queries: mx.array, scale: float, **kwargs) -> mx.array:
        """queries: [B, H_q, 1, D] -> [B, H_q, 1, D]: each row over its own heap, as alone."""
        outs = [attention.heap_sdpa(queries[b: b + 1], k, v, layer, scale, None, **kwargs)
                for b, ((k, v), layer) in enumerate(zip(self.fetched, self.layers))]
        return mx.concatenate(outs, axis=0)


def step_rows(model, rows: list[DecodeRow], chunks: Sequence[tuple[HeapPromptCache, Sequence[int]]] = ()
              ) -> list[Optional[Exception]]:
    """Feed each row's pending token in one forward (and `chunks`: (cache, ids) of prefills,
    evaluated with it); each row then samples its next token with its own sampler.

    Returns one entry per row, then one per chunk: None when it advanced, else the error that
    stopped it before the forward (its prompt, or making room: an eviction event or its page-out),
    which leaves the others untouched. An error in the forward itself raises (every part is
    suspect). One evaluation and one host read per step."""
    errors = [_work(lambda: row.feed_prompt(model)) for row in rows] + [None] * len(chunks)
    needs = [(i, row.cache, 1) for i, row in enumerate(rows) if errors[i] is None]
    needs += [(len(rows) + j, cache, len(ids)) for j, (cache, ids) in enumerate(chunks)]
    for (i, _, _), error in zip(needs, make_room([(cache, n) for _, cache, n in needs])):
        errors[i] = error
    live = [row for row, error in zip(rows, errors) if error is None]
    pending = []
    for (cache, ids), error in zip(chunks, errors[len(rows):]):
        if error is None:
            model(mx.array(list(ids), dtype=mx.uint32)[None], cache=cache)   # lazy: evaluated below
            pending += [c.state for c in cache]
    if not live:
        mx.eval(pending)
        return errors
    caches = [row.cache for row in live]
    layers = [RowsLayer([c[i] for c in caches]) for i in range(len(caches[0]))]
    ids = mx.concatenate([row.next for row in live])[:, None]                    # [B, 1]
    logits = model(ids, cache=layers)[:, -1, :]                                 # [B, vocab]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = sample_rows([row.sample for row in live], logprobs)                 # [B]
    mx.eval(tokens, logprobs, pending, [c.score_arrays() for c in caches])
    for b, (row, token) in enumerate(zip(live, tokens.tolist())):
        row.next, row.token, row.logprobs = tokens[b: b + 1], token, logprobs[b]
    return errors


def make_room(needs: list[tuple[HeapPromptCache, int]]) -> list[Optional[Exception]]:
    """Room in each heap for its n new tokens, as its make_room would make it; the eviction
    events that fall on this step (several heaps') are evaluated together, one evaluation, then
    each heap reads its own back. Per heap: None, or the error that stopped its event."""
    staged: dict = {}

    def stage(i: int, cache: HeapPromptCache, n: int) -> None:
        plan = cache.room_plan(n)
        if plan is not None:
            staged[i] = cache.stage_repack(plan)

    errors = [_work(lambda: stage(i, cache, n)) for i, (cache, n) in enumerate(needs)]
    if staged:
        try:
            mx.eval([s.arrays for s in staged.values()])
        except Exception:
            pass   # whose event failed: each heap's own evaluation below says, alone
        for i, s in staged.items():
            errors[i] = _work(lambda: (mx.eval(s.arrays), needs[i][0].finish_repack(s)))
    return errors


def sample_rows(samplers: list, logprobs: mx.array) -> mx.array:
    """Each row's next token [B] from logprobs [B, vocab]: greedy rows in one argmax, the others
    (temperature, top-p/k, constraints) with their own sampler, in row order."""
    if all(s is greedy_sampler for s in samplers):
        return greedy_sampler(logprobs)
    return mx.concatenate([s(logprobs[b: b + 1]).reshape(1) for b, s in enumerate(samplers)])


def _work(fn) -> Optional[Exception]:
    """Run one row's own host-side work; its error, if any (the others still step)."""
    try:
        fn()
    except Exception as e:
        return e
    return None
