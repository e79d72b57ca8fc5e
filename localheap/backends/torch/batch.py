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

from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from itertools import accumulate
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import eager_mask, sdpa_mask, sliding_window_causal_mask_function

from ...generation import ProgressFn, SamplingParams
from .. import paging
from ..slots import row_error
from . import attention, graphed
from .cache import HeapCache, SlidingLayer
from .generate import Sampler, prefill, prefill_turn, recall_begin, recall_due, recall_end
from .layer import HeapLayer
from .lean import batch_linear, lean_packed, lean_static
from .select import plan_eviction
from .slab import DecodeSlab, slab_key


class DecodeRow:
    """One session in the decode batch: its heap, its sampler, and the token it sampled last
    (on the device, not yet fed; `token` is its host copy). A row made with `prompt` has no
    token yet: its first step feeds the prompt (riding in the batch where no recall is due)."""

    def __init__(self, cache: HeapCache, sampler: Sampler, logits: Optional[torch.Tensor] = None,
                 prompt: Optional[list[int]] = None, max_tokens: int = 1 << 62):
        self.cache, self.sampler = cache, sampler
        self.slab: Optional[DecodeSlab] = None   # the slab its heap is a row of, while it is
        self.prompt = prompt                     # tokens to feed before the first sample
        self.recalling: Optional[Future] = None  # its prompt's recall, picking on another thread
        self.logits = self.next = self.token = None
        self.left = max_tokens                  # tokens it may still sample
        self.ahead: Optional[tuple] = None       # its next step, queued: (logits, token [1]) or (error, None)
        if logits is not None:
            self.sampled(logits)

    def sampled(self, logits: torch.Tensor, token: Optional[torch.Tensor] = None, host: Optional[int] = None) -> None:
        """logits: [vocab] fp32 the next token is (or was, `token` [1] on the device) sampled from."""
        self.logits = logits
        self.next = self.sampler.sample(logits) if token is None else token
        self.token = int(self.next) if host is None else host
        self.prompt = None
        self.left -= 1

    @property
    def waiting(self) -> bool:
        """It did not advance in the last step: its prompt's recall is still picking."""
        return self.recalling is not None


def start_row(model, cache: HeapCache, prompt: Sequence[int], params: SamplingParams,
              progress: Optional[ProgressFn] = None, cancelled=None, defer: bool = False) -> DecodeRow:
    """A turn's last prompt tokens (>= 1) and the first token sampled after them: fed now on its
    own (recall included), or with `defer` by the row's first step_rows."""
    if len(prompt) == 0:
        raise ValueError("generation needs at least one new prompt token")
    sampler = Sampler(params, cache.device)
    if defer:
        return DecodeRow(cache, sampler, prompt=list(prompt), max_tokens=params.max_tokens)
    return DecodeRow(cache, sampler, prefill_turn(model, cache, prompt, progress, cancelled), max_tokens=params.max_tokens)


def _rides(row: DecodeRow) -> bool:
    """A deferred prompt rides in the batch unless it is due a recall or exceeds the append room."""
    n = len(row.prompt)
    return n <= row.cache.cfg.append_room and not paging.needs_recall(row.cache, [n])


def batchable(cache: HeapCache) -> bool:
    """Caches whose every layer is a heap or transformers' sliding window (gemma3, gpt-oss: such a
    session attends as a lone part, its sliding layers masked as the model masks them alone)."""
    return all(isinstance(layer, (HeapLayer, SlidingLayer)) for layer in cache.layers)


class PackedLayer(CacheLayerMixin):
    """One model layer of a packed step: writes each part's new K/V into its heaps (a slab's
    rows, or one heap layer) and keeps what each lone heap returned for the attention function."""

    is_sliding = False
    is_compileable = False

    def __init__(self, step: "PackedStep", index: int):
        super().__init__()
        self.step, self.index = step, index
        self.is_initialized = True
        self.resident: list = []   # per lone heap: (keys, values) [1, H_kv, T_i, D]

    def lazy_initialization(self, key_states, value_states) -> None:
        raise AssertionError("a packed step writes into the parts' heaps")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states: [1, H_kv, N, D], each part's tokens at their own positions."""
        self.resident = []
        for part, (a, b) in zip(self.step.parts, self.step.bounds):
            if isinstance(part, DecodeSlab):
                part.append(self.index, key_states[:, :, a:b], value_states[:, :, a:b])
            else:
                self.resident.append(part.layers[self.index].update(key_states[:, :, a:b], value_states[:, :, a:b]))
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0   # the model's mask is unused: each part masks its own

    def get_max_length(self) -> int:
        return -1


class PackedStep(Cache):
    """past_key_values (and heap=) for one forward over several parts: decode slabs (their rows'
    tokens, in row order) and lone heaps (a decode token, or a prefill chunk)."""

    packed = True

    def __init__(self, parts: list, lengths: list[int], n_layers: int):
        self.parts = parts
        ends = list(accumulate(lengths))
        self.bounds = [(e - n, e) for e, n in zip(ends, lengths)]
        super().__init__(layers=[PackedLayer(self, i) for i in range(n_layers)])

    def attend(self, module, query: torch.Tensor, stock=None, **kwargs) -> torch.Tensor:
        """query: [1, H_q, N, D] -> [1, N, H_q, D]: each part over its own heaps (or sliding
        window), through the model's stock attention (`stock`: its eager one where it has no sdpa)."""
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        stock = stock or attention.sdpa_attention_forward
        lone = iter(self.layers[module.layer_idx].resident)
        outs = []
        for part, (a, b) in zip(self.parts, self.bounds):
            if isinstance(part, DecodeSlab):
                outs.append(part.attend(module.layer_idx, query[:, :, a:b], scale))
            else:
                k, v = next(lone)
                layer = part.layers[module.layer_idx]
                mask = None if isinstance(layer, HeapLayer) else \
                    sliding_mask(layer, b - a, k.shape[2], query, eager=stock is not attention.sdpa_attention_forward)
                outs.append(attention._heap_sdpa(module, query[:, :, a:b], k, v, mask, part, stock=stock, **kwargs)[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def sliding_mask(layer: SlidingLayer, L: int, T: int, query: torch.Tensor, eager: bool) -> Optional[torch.Tensor]:
    """The mask transformers gives a sliding layer alone for L new tokens over its T keys (the
    window it held, then the L): None for one token (it sees every key), else causal within the
    window, boolean for sdpa, additive in the query's dtype for eager attention."""
    if L == 1:
        return None
    window = layer.sliding_window
    start = layer.cumulative_length - L            # tokens the layer had seen before these
    kw = dict(batch_size=1, q_length=L, kv_length=T, q_offset=start, kv_offset=max(start - window + 1, 0),
              mask_function=sliding_window_causal_mask_function(window), device=query.device)
    return eager_mask(dtype=query.dtype, **kw) if eager else sdpa_mask(local_size=window, **kw)


def forward_packed(model, parts: list, tokens: list[torch.Tensor]) -> torch.Tensor:
    """parts: DecodeSlab (one token per row, `tokens` [B] in row order) or HeapCache (`tokens`
    [n] ids), every heap with room made. Returns fp32 logits [N_parts', vocab]: each slab row's,
    then each lone heap's last token."""
    if len(parts) == 1 and isinstance(parts[0], DecodeSlab) and all(getattr(c, "cuda_graphs", False)
                                                                   for c in parts[0].members):
        lean = lean_static(model, parts[0].members)
        logits = None if lean is None else graphed.step(lean, parts[0], tokens[0])   # as a replayed CUDA graph
        if logits is not None:
            return logits
    lengths = [int(t.shape[0]) for t in tokens]
    positions = []
    for part, n in zip(parts, lengths):
        caches = part.members if isinstance(part, DecodeSlab) else [part]
        positions += [c.position_ids(1 if isinstance(part, DecodeSlab) else n) for c in caches]
    positions = torch.cat(positions, dim=1)                                               # [1, N]
    ids = torch.cat(tokens)[None]                                                         # [1, N]
    caches = [c for part in parts for c in (part.members if isinstance(part, DecodeSlab) else [part])]
    lean = lean_packed(model, caches)
    if lean is None and len(parts) == 1 and not isinstance(parts[0], DecodeSlab):   # one heap: its own forward, as alone
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=positions, **attention.cache_kwarg(model, parts[0]), use_cache=True,
                        logits_to_keep=1, heap=parts[0])
        return out.logits[0].to(dtype=torch.float32)
    keep = []
    for part, (a, b) in zip(parts, zip([0] + list(accumulate(lengths))[:-1], accumulate(lengths))):
        keep += list(range(a, b)) if isinstance(part, DecodeSlab) else [b - 1]
    first = parts[0].members[0] if isinstance(parts[0], DecodeSlab) else parts[0]
    step = PackedStep(parts, lengths, len(first.layers))
    keep = torch.tensor(keep, device=ids.device)
    if lean is not None:   # the same ops without transformers' module glue
        linear = batch_linear(lean.embed.weight) if len(caches) > 1 else F.linear   # one session: stock's op
        return lean.run(step, ids, positions, keep, linear)[0].to(dtype=torch.float32)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, **attention.cache_kwarg(model, step), use_cache=True,
                    logits_to_keep=keep, heap=step)
    return out.logits[0].to(dtype=torch.float32)


def step_rows(model, rows: list[DecodeRow], chunks: Sequence[tuple[HeapCache, Sequence[int]]] = (),
              slabs: Optional[dict] = None, picker: Optional[Executor] = None,
              ahead: bool = False) -> list[Optional[Exception]]:
    """_step_rows, and with `ahead` (the engine's steps on CUDA: TorchBackend.step_rows) a row
    that steps alone (no other row, no chunk) has its next step queued before its token is read,
    as the generator pipelines on CUDA: the card computes it while the host reads this token and
    the engine sends it. A row whose step ran ahead takes that step's token in the next call, fed
    in no forward again; a step that stops it (EOS, a stop string, a cancel) leaves that token fed,
    as the generator does. Nothing runs ahead past the row's max_tokens. The caller ends such a row
    with end_row before anything else touches its heap."""
    if len(rows) == 1 and not chunks and rows[0].ahead is not None:   # one session, decoding: pipelined
        row = rows[0]
        (logits, token), row.ahead = row.ahead, None
        if token is None:   # the queued step could not make room: this step's error
            return [logits]
        row.sampled(logits, token, host=-1)   # its id read below, once the step after is queued
        if ahead:
            _run_ahead(model, row, slabs)
        row.token = int(token)
        return [None]
    fed = [row for row in rows if row.ahead is None]
    got = iter(_step_rows(model, fed, chunks, slabs, picker) if fed or chunks else [])
    errors = [None if row.ahead is not None else next(got) for row in rows] + list(got)
    for i, row in enumerate(rows):
        if row.ahead is not None:
            (logits, token), row.ahead = row.ahead, None
            if token is None:
                errors[i] = logits
            else:
                row.sampled(logits, token)
    if ahead and len(rows) == 1 and not chunks and errors[0] is None and rows[0].prompt is None \
            and not rows[0].waiting:
        _run_ahead(model, rows[0], slabs)
    return errors


def _run_ahead(model, row: DecodeRow, slabs: Optional[dict]) -> None:
    """Queue the row's next step without reading its token (row.ahead); not past its max_tokens."""
    if row.left <= 0:
        return
    error = _step_rows(model, [row], (), slabs, None, read=False)[0]
    if error is not None:
        row.ahead = (error, None)


def _step_rows(model, rows: list[DecodeRow], chunks: Sequence[tuple[HeapCache, Sequence[int]]] = (),
               slabs: Optional[dict] = None, picker: Optional[Executor] = None,
               read: bool = True) -> list[Optional[Exception]]:
    """Feed each row's pending token (and `chunks`: (cache, ids) of prefills, riding in the same
    forward) in one pass; each row then samples its next token with its own sampler.

    With `slabs` (slab_key -> DecodeSlab, kept by the caller between steps) rows whose heaps can
    share a buffer are read as one batch (slab.py); the others attend one by one.
    With `picker`, a prompt due a recall is probed in the step (recall_begin) and its pick runs on
    the picker while this and later steps go on without it (row.waiting); the step that finds the
    pick done merges it and feeds the prompt alone, as prefill_turn would have.
    Returns one entry per row, then one per chunk: None when it advanced (or waits), else the
    error that stopped it before the forward (making room: an eviction event or its page-out),
    which leaves the others untouched. An error in the forward itself raises (every part is
    suspect). One host read per step: the rows' sampled ids together (none with `read` False:
    each row keeps (logits, token on the device) as its `ahead`)."""
    errors: list[Optional[Exception]] = [None] * (len(rows) + len(chunks))
    feeding: list[int] = []
    alone = [i for i, row in enumerate(rows) if row.prompt is not None and not _rides(row)]
    if picker is not None and alone and len(alone) == len(rows) and not chunks:
        # nothing else to step: wait for a pick rather than spin beside it
        picks = [rows[i].recalling for i in alone if rows[i].recalling is not None]
        if len(picks) == len(alone):
            wait(picks, return_when=FIRST_COMPLETED)
    for i, row in enumerate(rows):
        if i not in alone:
            feeding.append(i)
        elif picker is None:   # fed alone (recall first): the row has its first token
            errors[i] = row_error(lambda: row.sampled(prefill_turn(model, row.cache, row.prompt)))
        else:
            errors[i] = row_error(lambda: _recall_row(model, row, picker))
    needs = [(rows[i].cache, 1 if rows[i].prompt is None else len(rows[i].prompt)) for i in feeding]
    needs += [(cache, len(ids)) for cache, ids in chunks]
    for i, error in zip(feeding + list(range(len(rows), len(errors))), make_rooms(needs)):
        errors[i] = error
    live: list[DecodeRow] = []
    starting: list[DecodeRow] = []   # deferred prompts riding as lone parts
    for i in feeding:
        row = rows[i]
        if errors[i] is not None:
            leave_slab(row)
        elif row.prompt is not None and (len(row.prompt) > 1 or slabs is None):
            starting.append(row)
        else:
            if row.prompt is not None:   # one token: it rides in the slab like a sampled one
                row.next = torch.as_tensor(row.prompt, dtype=torch.long, device=row.cache.device)
            live.append(row)
    if slabs is not None:
        _seat(live, slabs)
    parts, tokens, order = [], [], []
    for slab in {id(r.slab): r.slab for r in live if r.slab is not None}.values():
        members = {id(r.cache): r for r in live if r.slab is slab}
        seated = [members[id(c)] for c in slab.members]
        parts.append(slab)
        tokens.append(torch.cat([r.next for r in seated]))
        order += seated
    for row in live + starting:
        if row.slab is None:
            parts.append(row.cache)
            tokens.append(row.next if row.prompt is None else
                          torch.as_tensor(row.prompt, dtype=torch.long, device=row.cache.device))
            order.append(row)
    for (cache, ids), error in zip(chunks, errors[len(rows):]):
        if error is None:
            parts.append(cache)
            tokens.append(torch.as_tensor(list(ids), dtype=torch.long, device=cache.device))
    if not parts:
        return errors
    logits = forward_packed(model, parts, tokens)
    if order:
        sampled = sample_rows([row.sampler for row in order], logits[: len(order)])   # [rows]
        if not read:
            for i, row in enumerate(order):
                row.ahead = (logits[i], sampled[i: i + 1])
            return errors
        host = sampled.tolist()
        for i, (row, value) in enumerate(zip(order, host)):
            row.sampled(logits[i], sampled[i: i + 1], value)
    return errors


def _recall_row(model, row: DecodeRow, picker: Executor) -> None:
    """A prompt fed alone, its recall's pick on `picker`: begun in one step, ended in the first
    step after the pick is done (the row has its first token then)."""
    if row.recalling is None:
        if not recall_due(row.cache, row.prompt):   # fed alone for its length: prefill_turn without recall
            row.sampled(prefill(model, row.cache, row.prompt))
            return
        row.recalling = paging.pick_beside(picker, row.cache, recall_begin(model, row.cache, row.prompt))
        return
    if not row.recalling.done():
        return
    question, row.recalling = row.recalling.result(), None
    row.sampled(recall_end(model, row.cache, question))


def sample_rows(samplers: list, logits: torch.Tensor) -> torch.Tensor:
    """Each row's next token [rows] from logits [rows, vocab]: the plain greedy rows in one argmax
    (argmax per row either way), the others (warpers, seeds, constraints, penalties, logit_bias,
    logprobs) with their own sampler."""
    plain = [i for i, s in enumerate(samplers) if s.plain]
    if len(plain) == len(samplers):
        return torch.argmax(logits, dim=-1)
    tokens = torch.empty(len(samplers), dtype=torch.long, device=logits.device)
    if plain:
        at = torch.tensor(plain, device=logits.device)
        tokens[at] = torch.argmax(logits[at], dim=-1)
    for i, sampler in enumerate(samplers):
        if i not in plain:
            tokens[i] = sampler.sample(logits[i])[0]
    return tokens


def _seat(rows: list[DecodeRow], slabs: dict) -> None:
    """Make each slab's members exactly this step's rows of it: rows left out of the step leave,
    rows that can join do."""
    stepping = {id(r.cache) for r in rows}
    for slab in slabs.values():
        for cache in [c for c in slab.members if id(c) not in stepping]:
            slab.leave(cache)   # its row's `slab` is cleared when it steps or ends (in_slab)
    joining: dict = {}
    for row in rows:
        if not in_slab(row):
            key = slab_key(row.cache)
            if key is not None:
                joining.setdefault(key, []).append(row)
    for key, incoming in joining.items():
        slab = slabs.setdefault(key, DecodeSlab(key))
        slab.reserve(len(slab.members) + len(incoming))
        for row in incoming:
            row.slab = slab
            slab.join(row.cache)


def in_slab(row: DecodeRow) -> bool:
    if row.slab is not None and not any(c is row.cache for c in row.slab.members):
        row.slab = None
    return row.slab is not None


def leave_slab(row: DecodeRow) -> None:
    """The row's heap gets buffers of its own again (its run ended, failed, or waits a step);
    a pick still running for it is waited for (it reads the heap's page store) and dropped, and
    so is the sample of a step queued ahead (its token stays fed)."""
    row.ahead = None
    if row.recalling is not None:
        wait([row.recalling])
        row.recalling = None
    if in_slab(row):
        row.slab.leave(row.cache)
    row.slab = None


def make_rooms(needs: list[tuple[HeapCache, int]]) -> list[Optional[Exception]]:
    """cache.make_room(n) for each (cache, n), the sessions' eviction events of this step scored
    and selected as one batched pass (plan_eviction over all their layers; the selection is per
    row, so each heap keeps exactly the slots it would alone), then applied heap by heap.
    Returns each one's error or None: a heap that fails leaves the others untouched."""
    errors: list[Optional[Exception]] = [None] * len(needs)
    due: dict[int, list] = {}
    for i, (cache, n) in enumerate(needs):
        try:
            layers = cache.due(n)
        except Exception as e:
            errors[i] = e
            continue
        if layers:
            due[i] = layers
    plan = None
    if len(due) > 1:
        try:
            plan = plan_eviction([layer for layers in due.values() for layer in layers])
        except Exception:
            plan = None   # each heap then plans its own event, and keeps its own error
    for i, layers in due.items():
        cache = needs[i][0]
        errors[i] = row_error(lambda: cache.repack(plan_eviction(layers) if plan is None else plan.part(layers)))
    return errors
