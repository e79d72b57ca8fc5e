"""Many heaps in one forward pass on MLX: the decode batch, with prefill chunks riding in it.

Every token of the step is a row of its own, [N, 1] (a decode token per decoding session, and the
n tokens of each riding prefill chunk): every per-token part of the model (embeddings, norms,
projections, MLP, logits) runs once over the N rows, RoPE rotates each token at its own position
(an offset array [N]: mlx's rope takes one per row, bit for bit the scalar offset). Attention:
with `slabs`, the decoding rows whose heaps can share a buffer are read as one batch from a
DecodeSlab (slab.py: one scatter and one masked pass per layer for all of them); the other parts
(a heap that cannot join a slab, a prefill chunk) attend over their own heap exactly as the
single-session path does (attention.heap_sdpa; a chunk with the causal mask its heap gives alone).
Either way each heap keeps its own slots, positions, eviction events, scores, recall region and
page store (mlx's CPU backend: tokens, logprobs and heaps bit for bit as alone; tests allow 1e-4 on
logprobs elsewhere: tests/test_mlx_batch.py). The logits of a chunk's tokens are computed with the
rest (the model's head runs over all N rows) but never read.
Knows nothing about sessions or requests: rows are (cache, sampler, next token).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from itertools import accumulate
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.sample_utils import greedy_sampler

from ...generation import ProgressFn, SamplingParams
from .. import paging
from ..slots import row_error
from . import attention
from .cache import HeapKVCache
from .generate import decode_step, prefill_turn, recall_begin, recall_due, recall_end, Sampler
from .heapcache import HeapPromptCache
from .slab import DecodeSlab, seated_slab, slab_key


class DecodeRow:
    """One session in the decode batch: its heap, its sampler, and the token it feeds next
    (`next` [1] on the device; `token` its host copy once sampled). A row made with `prompt` has
    no token yet: its first step feeds the prompt (all but the last token as alone, recall
    included; the last one rides in the batch)."""

    def __init__(self, cache: HeapPromptCache, params: SamplingParams, prompt: Sequence[int]):
        self.cache, self.sample = cache, Sampler(params)   # (seeded: every draw with its own key)
        self.prompt: Optional[list[int]] = list(prompt)
        self.next: Optional[mx.array] = None
        self.token: Optional[int] = None
        self.logprobs: Optional[mx.array] = None   # [vocab] the last token was sampled from
        self.recalling: Optional[Future] = None   # its prompt's recall, picking on another thread
        self.left = params.max_tokens   # tokens it may still sample
        self.ahead: Optional[tuple[mx.array, mx.array]] = None   # its next step, queued: (token [1], logprobs)

    def took(self, token: mx.array, logprobs: mx.array, host: Optional[int] = None) -> None:
        """The token this step sampled ([1] on the device; `host`: its id, read already)."""
        self.next, self.logprobs, self.left = token, logprobs, self.left - 1
        self.token = token.item() if host is None else host

    @property
    def waiting(self) -> bool:
        """It did not advance in the last step: its prompt's recall is still picking."""
        return self.recalling is not None

    def feed_prompt(self, model, progress: Optional[ProgressFn] = None, cancelled=None,
                    picker: Optional[Executor] = None) -> None:
        """The prompt's head into the heap (prefill_turn: chunks, recall), its last token pending.
        With `picker`, a prompt due a recall is fed up to its question and probed now, its pick
        runs on the picker (the row waits), and the call that finds the pick done merges it and
        feeds the question: prefill_turn's three parts."""
        chunk = self.cache.cfg.chunk
        if self.recalling is not None:
            if not self.recalling.done():
                return
            question, self.recalling = self.recalling.result(), None
            recall_end(model, self.cache, question, chunk)
            self.next = mx.array(question.tokens[-1:], dtype=mx.uint32)
            return
        if self.prompt is None:
            return
        prompt, self.prompt = self.prompt, None
        if picker is None or not recall_due(self.cache, prompt, chunk):
            prefill_turn(model, self.cache, prompt, chunk, progress, cancelled)
            self.next = mx.array(prompt[-1:], dtype=mx.uint32)
            return
        self.recalling = paging.pick_beside(picker, self.cache, recall_begin(model, self.cache, prompt, chunk,
                                                                             progress, cancelled))


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
    """Caches whose every layer is a heap or mlx-lm's rotating sliding window (gemma3, gpt-oss:
    such a session attends as a lone part, each layer at its own offset, a riding chunk with the
    mask its window gives alone)."""
    return all(isinstance(c, (HeapKVCache, RotatingKVCache)) for c in cache)


class RowsLayer:
    """Layer i of a packed step: mlx-lm's cache protocol over its parts. Every token is a row of
    its own ([N, 1] in, so RoPE takes a position per token: `offset` [N]). The first rows are the
    slabs' (one token per seated heap, in row order: appended and attended as one batch each);
    then lone parts, a decode token or a prefill chunk's n tokens into its own heap layer, whose
    queries attend over it as alone (a chunk causally, with the mask its heap gives alone)."""

    def __init__(self, index: int, slabs: list, layers: list, lengths: list[int]):
        self.index, self.slabs, self.layers = index, slabs, layers
        seated = [len(slab.members) for slab in slabs]
        # read before the layer appends anything: positions and masks as each heap alone
        offsets = [o for slab in slabs for o in slab.offsets(index)]
        offsets += [o for layer, n in zip(layers, lengths) for o in range(layer.offset, layer.offset + n)]
        self.offset = mx.array(offsets, dtype=mx.int32)
        self.masks = [layer.make_mask(n) for layer, n in zip(layers, lengths)]
        ends = list(accumulate(seated + lengths))
        self.bounds = [(e - n, e) for e, n in zip(ends, seated + lengths)]
        self.fetched: list = []

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        assert N == 1, "a packed step feeds one token per row"
        return None   # each part masks its own

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys/values: [N, H_kv, 1, D], each token rotated at its own position: a slab's rows go
        into its buffers in one scatter, a lone part's into its heap as [1, H_kv, n, D]."""
        lone = self.bounds[len(self.slabs):]
        for slab, (a, b) in zip(self.slabs, self.bounds):
            slab.append(self.index, keys[a:b], values[a:b])
        self.fetched = [layer.update_and_fetch(_part(keys, a, b), _part(values, a, b))
                        for layer, (a, b) in zip(self.layers, lone)]
        return keys, values

    def attend_rows(self, queries: mx.array, scale: float, **kwargs) -> mx.array:
        """queries: [N, H_q, 1, D] -> [N, H_q, 1, D]: a slab's rows as one batch, a lone part over
        its own heap as alone."""
        outs = [slab.attend(self.index, queries[a:b], scale, **kwargs) for slab, (a, b) in zip(self.slabs, self.bounds)]
        lone = self.bounds[len(self.slabs):]
        outs += [attention.heap_sdpa(_part(queries, a, b), k, v, layer, scale, mask, **kwargs).transpose(2, 1, 0, 3)
                 for (k, v), layer, mask, (a, b) in zip(self.fetched, self.layers, self.masks, lone)]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _part(x: mx.array, a: int, b: int) -> mx.array:
    """Rows a..b of a packed [N, H, 1, D] as one sequence [1, H, b - a, D]."""
    return x[a:b].transpose(2, 1, 0, 3)


def step_rows(model, rows: list[DecodeRow], chunks: Sequence[tuple[HeapPromptCache, Sequence[int]]] = (),
              slabs: Optional[dict] = None, picker: Optional[Executor] = None,
              ahead: bool = False) -> list[Optional[Exception]]:
    """_step_rows, and with `ahead` (the engine's steps: MLXBackend.step_rows) a row that steps
    alone (no other row, no chunk) has its next step queued before its token is read (_run_ahead:
    one session decodes pipelined, as the round-robin generator does). Its caller ends such a
    row with end_row before anything else touches its heap.
    A row whose step ran ahead takes that step's token in the next call, fed in no forward again
    (its K/V are in its heap already); a step that stops it (EOS, a stop string, a cancel) leaves
    that token fed, as the round-robin generator does (end_row waits for it)."""
    if len(rows) == 1 and not chunks and rows[0].ahead is not None:   # one session, decoding: pipelined
        row = rows[0]
        (y, logprobs), row.ahead = row.ahead, None
        row.took(y, logprobs, host=-1)   # its id read below, once the step after is queued
        if ahead:
            _run_ahead(model, row)
        row.token = y.item()
        return [None]
    ready = [row for row in rows if row.ahead is not None]
    fed = [row for row in rows if row.ahead is None]
    got = iter(_step_rows(model, fed, chunks, slabs, picker) if fed or chunks else [])
    errors = [None if row.ahead is not None else next(got) for row in rows] + list(got)
    for row in ready:
        (y, logprobs), row.ahead = row.ahead, None
        row.took(y, logprobs)
    if ahead and len(rows) == 1 and not chunks and errors[0] is None and not rows[0].waiting \
            and rows[0].prompt is None and rows[0].next is not None:
        _run_ahead(model, rows[0])
    return errors


def _step_rows(model, rows: list[DecodeRow], chunks: Sequence[tuple[HeapPromptCache, Sequence[int]]] = (),
               slabs: Optional[dict] = None, picker: Optional[Executor] = None) -> list[Optional[Exception]]:
    """Feed each row's pending token and `chunks` ((cache, ids) of prefills riding along) in one
    forward; each row then samples its next token with its own sampler.

    With `slabs` (slab_key -> DecodeSlab, kept by the caller between steps) rows whose heaps can
    share a buffer are read as one batch (slab.py); the others attend one by one.
    With `picker`, a prompt due a recall is probed in the step and its pick runs on the picker
    while this and later steps go on without it (row.waiting, out of its slab); the step that
    finds the pick done merges it, feeds the question and samples as alone.
    Returns one entry per row, then one per chunk: None when it advanced (or waits), else the
    error that stopped it before the forward (its prompt, or making room: an eviction event or
    its page-out), which leaves the others untouched. An error in the forward itself raises
    (every part is suspect). One evaluation and one host read per step."""
    if picker is not None and not chunks and rows and all(row.waiting for row in rows):
        wait([row.recalling for row in rows], return_when=FIRST_COMPLETED)   # nothing else to step
    errors = [row_error(lambda: row.feed_prompt(model, picker=picker)) for row in rows] + [None] * len(chunks)
    needs = [(i, row.cache, 1) for i, row in enumerate(rows) if errors[i] is None and not row.waiting]
    needs += [(len(rows) + j, cache, len(ids)) for j, (cache, ids) in enumerate(chunks)]
    for (i, _, _), error in zip(needs, make_room([(cache, n) for _, cache, n in needs])):
        errors[i] = error
    live = [row for row, error in zip(rows, errors) if error is None and not row.waiting]
    riding = [(cache, ids) for (cache, ids), error in zip(chunks, errors[len(rows):]) if error is None]
    if slabs is not None:
        _seat(live, slabs)
    used = list({id(s): s for s in (seated_slab(row.cache) for row in live) if s is not None}.values())
    by_cache = {id(row.cache): row for row in live}
    order = [by_cache[id(c)] for slab in used for c in slab.members]     # the slabs' rows, in row order
    order += [row for row in live if seated_slab(row.cache) is None]
    lone = order[sum(len(slab.members) for slab in used):]
    caches = [row.cache for row in lone] + [cache for cache, _ in riding]
    if not order and not caches:
        return errors
    lengths = [1] * len(lone) + [len(ids) for _, ids in riding]
    n_layers = len((order[0].cache if order else caches[0]))
    layers = [RowsLayer(i, used, [c[i] for c in caches], lengths) for i in range(n_layers)]
    ids = mx.concatenate([row.next for row in order] + [mx.array(list(t), dtype=mx.uint32) for _, t in riding])
    logits = model(ids[:, None], cache=layers)[: len(order), -1, :]            # [B, vocab]
    fed = [[c.state for c in cache] for cache in caches] + [slab.arrays() for slab in used]
    if not order:   # chunks alone: their logits are never evaluated
        mx.eval(fed)
        return errors
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = sample_rows([row.sample for row in order], logits, logprobs)        # [B]
    mx.eval(tokens, logprobs, fed, [c.score_arrays() for c in caches])
    for b, (row, token) in enumerate(zip(order, tokens.tolist())):
        row.took(tokens[b: b + 1], logprobs[b], token)
    return errors


def _run_ahead(model, row: DecodeRow) -> None:
    """Queue the row's next step (feed its token, sample the one after) without waiting for it, as
    mlx-lm's generate_step and the round-robin generator do: the device computes it while the host
    reads this step's token and the engine sends it. Not where the row has sampled its last token;
    a heap that cannot make room (an eviction's page-out) is left to the next step, which reports it."""
    if row.left <= 0:
        return
    try:
        leave_slab(row.cache)
        row.cache.make_room(1)
    except Exception:
        return   # the next step makes room again, and says why it cannot
    y, logprobs = decode_step(model, row.cache, row.next, row.sample)   # (its room made: no second event)
    mx.async_eval(y, logprobs, *row.cache.score_arrays())
    row.ahead = (y, logprobs)


def _seat(rows: list[DecodeRow], slabs: dict) -> None:
    """Make each slab's members exactly this step's rows of it: heaps not stepping leave, rows
    that can join do (a heap never fed yet joins on its next step)."""
    stepping = {id(r.cache) for r in rows}
    for slab in slabs.values():
        for cache in [c for c in slab.members if id(c) not in stepping]:
            slab.leave(cache)
    joining: dict = {}
    for row in rows:
        key = slab_key(row.cache)   # None when seated already
        if key is not None:
            joining.setdefault(key, []).append(row.cache)
    for key, incoming in joining.items():
        slab = slabs.setdefault(key, DecodeSlab(key))
        slab.reserve(len(slab.members) + len(incoming))
        for cache in incoming:
            slab.join(cache)


def leave_slab(cache: HeapPromptCache) -> None:
    """The heap gets buffers of its own again (its run ended, or it waits a step)."""
    slab = seated_slab(cache)
    if slab is not None:
        slab.leave(cache)


def end_row(row: DecodeRow) -> None:
    """The row's run ended (or failed): a step queued ahead lands (its token stays fed) and its
    sample is dropped, a pick still running for it is waited for (it reads the heap's page store)
    and dropped, and its heap leaves the batch."""
    if row.ahead is not None:
        mx.eval(row.ahead, [c.state for c in row.cache], row.cache.score_arrays())
        row.ahead = None
    if row.recalling is not None:
        wait([row.recalling])
        row.recalling = None
    leave_slab(row.cache)


def make_room(needs: list[tuple[HeapPromptCache, int]]) -> list[Optional[Exception]]:
    """Room in each heap for its n new tokens, as its make_room would make it; the eviction
    events that fall on this step (several heaps') are evaluated together, one evaluation, then
    each heap reads its own back. Per heap: None, or the error that stopped its event."""
    staged: dict = {}

    def stage(i: int, cache: HeapPromptCache, n: int) -> None:
        plan = cache.room_plan(n)
        if plan is not None:
            staged[i] = cache.stage_repack(plan)

    errors = [row_error(lambda: stage(i, cache, n)) for i, (cache, n) in enumerate(needs)]
    if staged:
        try:
            mx.eval([s.arrays for s in staged.values()])
        except Exception:
            pass   # whose event failed: each heap's own evaluation below says, alone
        for i, s in staged.items():
            errors[i] = row_error(lambda: (mx.eval(s.arrays), needs[i][0].finish_repack(s)))
    return errors


def sample_rows(samplers: list, logits: mx.array, logprobs: mx.array) -> mx.array:
    """Each row's next token [B] from logits [B, vocab] and their logprobs: plain greedy rows in
    one argmax where all are, else each with its own sampler, in row order."""
    if all(s.plain for s in samplers):
        return greedy_sampler(logprobs)
    return mx.concatenate([s(logits[b: b + 1], logprobs[b: b + 1]).reshape(1) for b, s in enumerate(samplers)])
