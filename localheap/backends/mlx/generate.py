"""The MLX generation loop over a heap: chunked prefill, pipelined decode.

Mirrors mlx-lm's generate_step (all prompt tokens but the last are prefilled in
chunks, the last one produces the first logits) so that with a budget at least as
large as the context the tokens are exactly mlx-lm's. The heap makes room before
every forward pass, so RoPE offsets are final before the model rotates anything.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from ...dry import dry_state
from ...grammar import IfLast, if_last_mlx
from ...generation import (ADAPTIVE_PEAK, ADAPTIVE_SHARPNESS, ADAPTIVE_WIDTH, DYNATEMP_FLOOR, MIROSTAT_M,
                           SCORED_BLOCK, LogprobRecorder, ProgressFn, SamplingParams, TokenLogprob,
                           check_logit_bias, handoff, scored_rows)
from .. import paging
from . import recall
from .compiled import compiled_step
from .heapcache import HeapPromptCache


class Sampler:
    """A request's next token on MLX: mlx-lm's sampler (greedy: its greedy_sampler) given the
    log-softmax of the logits after what this server adds, each on the logits before their
    logsumexp, where mlx-lm's generate_step applies its logits processors: logit_bias, the
    repetition penalty, OpenAI's presence and frequency penalties, DRY (in llama.cpp's order), a
    constraint. The logprobs recorder sees the raw logprobs. Called as sample(logits [1, vocab],
    their logprobs or None); kept lazy (no host sync) unless a constraint must see the token."""

    def __init__(self, params: SamplingParams):
        self.base = make_sampler(temp=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                 min_p=params.min_p, xtc_probability=params.xtc_probability,
                                 xtc_threshold=params.xtc_threshold, xtc_special_tokens=[])
        self.adaptive = AdaptiveP(params, self.next_key) if params.adaptive else None
        self.post = params.logprobs is not None and params.logprobs.post   # (the chain's distribution recorded)
        self.drawn = None   # [1, vocab] the log-distribution the last draw was from (post, plain draws)
        # a seeded draw steps a generator of its own, as mlx's global one steps once seeded (the same
        # draws alone), so rows of one batch that sample at random draw what each draws alone (n's
        # choices: seed + i): the categorical draw, XTC's coin, mirostat's and adaptive-p's draws
        self.key = mx.random.key(params.seed) if params.seed is not None and not params.greedy else None
        if params.dynamic_temperature or self.adaptive is not None or (self.post and not params.greedy) or \
                self.key is not None:
            self.base = chained_sampler(params, self._draw if self.adaptive is None else self.adaptive.sample,
                                        self.next_key)
        self.mirostat = Mirostat(params, self.next_key) if params.mirostatted else None
        self.cuts = [] if params.greedy or self.mirostat is not None else \
            ([lambda lp, n=params.top_n_sigma: top_n_sigma(lp, n)] if params.top_n_sigma > 0.0 else []) + \
            ([lambda lp, m=params.typical_p: typical(lp, m)] if params.typical_p < 1.0 else [])
        self.plain = params.plain_greedy   # the batch argmaxes it with the others
        self.temperature = params.temperature
        self.bias, self.vector = params.logit_bias, None
        self.repeat = params.repeat_penalty if params.repeating else None
        self.last_n = params.repeat_last_n
        self.window = mx.array(params.window(params.repeat_last_n), dtype=mx.uint32) if params.windowed else None
        self.penalized = params.penalized
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.counted = params.penalized and params.windowed_penalties   # counts follow the window's ids
        self.counts = None   # [vocab] float32: how often this reply (or the window) has each id (penalized)
        self.dry = dry_state(params)
        self.constraint, self.recorder = params.constraint, params.logprobs

    def __call__(self, logits: mx.array, logprobs: Optional[mx.array] = None) -> mx.array:
        scores = logits
        if self.bias:
            if self.vector is None:
                self.vector = bias_vector(self.bias, logits.shape[-1])
            scores = scores + self.vector
        if self.repeat is not None and self.window.size:
            scores = repeat_penalized(scores, self.window, self.repeat)
        if self.counted and self.counts is None:
            self.counts = mx.array(window_counts(np.array(self.window), logits.shape[-1]))
        if self.counts is not None:
            scores = scores - (self.presence * (self.counts > 0).astype(mx.float32) + self.frequency * self.counts)
        if self.dry is not None:
            ids, amounts = self.dry.penalties()
            if ids.size:
                dense = np.zeros(logits.shape[-1], dtype=np.float32)
                dense[ids] = amounts
                scores = scores - mx.array(dense)
        if self.constraint is not None:
            scores = masked(scores, self.constraint.allowed())
        lp = logprobs if logprobs is not None and scores is logits else \
            scores - mx.logsumexp(scores, axis=-1, keepdims=True)
        for cut in self.cuts:   # before mlx-lm's own (top-p, min-p, XTC, top-k, then temperature)
            lp = cut(lp)
        y = self.base(lp) if self.mirostat is None else self.mirostat.sample(lp * (1.0 / self.temperature))
        if self.penalized:
            if self.counts is None:
                self.counts = mx.zeros((logits.shape[-1],), dtype=mx.float32)
            self.counts = self.counts.at[y.reshape(-1)].add(1.0)
        if self.window is not None:
            self.window = mx.concatenate([self.window, y.reshape(-1).astype(mx.uint32)])
            if self.last_n > 0 and self.window.size > self.last_n:
                if self.counted:   # the id that leaves the window leaves the counts
                    self.counts = self.counts.at[self.window[:-self.last_n]].add(-1.0)
                self.window = self.window[-self.last_n:]
        if self.constraint is not None:
            handoff(self.constraint, y)
        if self.dry is not None:   # on the host: DRY matches the ids themselves
            self.dry.push(y.item())
        if self.recorder is not None and self.post:   # the chain's own distribution (greedy: one id)
            drawn = None if self.temperature == 0.0 else self.mirostat.drawn if self.mirostat is not None else \
                self.adaptive.drawn if self.adaptive is not None else self.drawn
            self.recorder.add(post_entry(drawn, y, self.recorder.top))
        elif self.recorder is not None:
            raw = logprobs if logprobs is not None else logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            self.recorder.add(recorded_entry(raw, y, self.recorder.top))
        return y

    def _draw(self, x: mx.array) -> mx.array:
        """mlx-lm's categorical draw, the log-distribution kept for a post-sampling recorder."""
        if self.post:
            self.drawn = x - mx.logsumexp(x, axis=-1, keepdims=True)
        return mx.random.categorical(x, key=self.next_key())

    def next_key(self) -> Optional[mx.array]:
        """The key of this request's next draw: seeded, the one mlx's generator would give it (split:
        the next key, and the one drawn with); unseeded, None (the global generator)."""
        if self.key is None:
            return None
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return keys[1]


def window_counts(window: np.ndarray, vocab: int) -> np.ndarray:
    """[vocab] float32: how many times each id is in `window` (ids past the logits' vocabulary,
    which no sample can give, are left out)."""
    return np.bincount(window[window < vocab], minlength=vocab).astype(np.float32)


def bias_vector(bias: dict[int, float], vocab: int) -> mx.array:
    """OpenAI's logit_bias as a [vocab] float32 vector (an id past the vocabulary is an error)."""
    check_logit_bias(bias, vocab)
    dense = np.zeros(vocab, dtype=np.float32)
    dense[list(bias)] = list(bias.values())
    return mx.array(dense)


def repeat_penalized(scores: mx.array, window: mx.array, penalty: float) -> mx.array:
    """scores [1, vocab] with each id of `window` penalized (SamplingParams.repeating): divided by
    `penalty` where positive, multiplied where not; in the logits' dtype, as mlx-lm's processor."""
    hit = mx.zeros((scores.shape[-1],), dtype=mx.float32).at[window].add(1.0) > 0
    return mx.where(hit, mx.where(scores < 0, scores * penalty, scores / penalty), scores)


def chained_sampler(params: SamplingParams, select, next_key=lambda: None):
    """mlx-lm's sampler chain (its own top-p, min-p, XTC and top-k, in its order), the temperature
    (or the one llama.cpp's dynatemp gives what they leave: SamplingParams.dynamic_temperature),
    then `select` (mx.random.categorical, or adaptive-p's draw) on the scaled logprobs. XTC's coin
    is drawn with `next_key()` (None: mlx's global generator)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    def sample(lp: mx.array) -> mx.array:
        if 0.0 < params.top_p < 1.0:
            lp = apply_top_p(lp, params.top_p)
        if params.min_p > 0.0:
            lp = apply_min_p(lp, params.min_p)
        if params.xtc_probability > 0.0:
            lp = xtc(lp, params.xtc_probability, params.xtc_threshold, next_key())
        if params.top_k > 0:
            lp = apply_top_k(lp, params.top_k)
        t = dynamic_temperature(lp, params.temperature, params.dynatemp_range, params.dynatemp_exponent) \
            if params.dynamic_temperature else params.temperature
        return select(lp * (1.0 / t))

    return sample


def dynamic_temperature(lp: mx.array, temperature: float, spread: float, exponent: float) -> mx.array:
    """[1, 1] the temperature llama.cpp's dynatemp gives these scores."""
    x = lp.astype(mx.float32)
    finite = mx.isfinite(x)
    n = mx.maximum(finite.sum(axis=-1, keepdims=True), 2).astype(mx.float32)
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    entropy = -mx.where(finite, mx.exp(logp) * logp, 0.0).sum(axis=-1, keepdims=True)
    lo, hi = max(0.0, temperature - spread), temperature + spread
    return mx.maximum(lo + (hi - lo) * mx.clip(entropy / mx.log(n), 0, 1) ** exponent, DYNATEMP_FLOOR)


def xtc(lp: mx.array, probability: float, threshold: float, key: Optional[mx.array]) -> mx.array:
    """mlx-lm's apply_xtc (with chance `probability`, every id over `threshold` but the least likely
    of them cut), its coin drawn with `key` (None: mlx's global generator, as apply_xtc draws)."""
    coin = mx.random.uniform(0, 1, key=key)
    probs = mx.softmax(lp, -1)
    mask = probs > mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    return mx.where(coin > probability, lp, mx.where(mask, -mx.inf, lp))


class Mirostat:
    """Mirostat 1 or 2 (SamplingParams.mirostatted) on MLX: mu an array beside the step (lazy, no
    host sync), the draw mlx-lm's categorical over the ids it keeps, with `next_key()` (None: mlx's
    global generator)."""

    def __init__(self, params: SamplingParams, next_key=lambda: None):
        self.next_key = next_key
        self.version, self.tau, self.eta = params.mirostat, params.mirostat_tau, params.mirostat_eta
        self.mu = mx.array(2.0 * self.tau, dtype=mx.float32)

    def keep(self, scores: mx.array) -> mx.array:
        """[1, vocab] bool: the ids it may draw this step (scores: logits after temperature)."""
        x = scores.astype(mx.float32)
        logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if self.version == 2:
            keep = -logp / math.log(2.0) <= self.mu
        else:
            vocab = logp.shape[-1]
            m = min(MIROSTAT_M, vocab)
            ranked = -mx.sort(-logp, axis=-1)[0]                                  # log p, the likeliest first
            top = ranked[:m]
            i = mx.arange(m - 1, dtype=mx.float32)
            t = mx.log((i + 2) / (i + 1))
            b = top[:-1] - top[1:]
            b = mx.where(mx.isfinite(b), b, 0.0)   # (ids cut already: p 0)
            s_hat = (t * b).sum() / (t * t).sum()
            eps = s_hat - 1
            k = ((eps * mx.power(2.0, self.mu)) / (1 - mx.power(float(vocab), -eps))) ** (1 / s_hat)
            k = mx.clip(mx.where(mx.isnan(k), 1.0, k), 1, vocab).astype(mx.int32)
            keep = logp >= ranked[k - 1]                                          # the k likeliest (ties: all)
        return keep | (logp == logp.max(axis=-1, keepdims=True))                # the likeliest id at least

    def sample(self, scores: mx.array) -> mx.array:
        x = mx.where(self.keep(scores), scores.astype(mx.float32), -mx.inf)
        logp = self.drawn = x - mx.logsumexp(x, axis=-1, keepdims=True)
        y = mx.random.categorical(logp, key=self.next_key())
        self.mu = self.mu - self.eta * (-logp[0, y[0]] / math.log(2.0) - self.tau)
        return y


class AdaptiveP:
    """llama.cpp's adaptive-p (SamplingParams.adaptive) on MLX: the EMA's weighted sum an array
    beside the step (lazy, no host sync); the draw mlx-lm's categorical, with `next_key()` (None:
    mlx's global generator)."""

    def __init__(self, params: SamplingParams, next_key=lambda: None):
        self.next_key = next_key
        self.target, self.decay = min(params.adaptive_target, 1.0), params.adaptive_decay
        self.weighted = mx.array(self.target / (1.0 - self.decay), dtype=mx.float32)
        self.total = 1.0 / (1.0 - self.decay)

    def distribution(self, scores: mx.array) -> tuple[mx.array, mx.array]:
        """([1, vocab] the ids' probabilities before, [1, vocab] the log-distribution it draws from)."""
        x = scores.astype(mx.float32)
        probs = mx.softmax(x, axis=-1)
        adapted = mx.clip(2.0 * self.target - self.weighted / self.total, 0.0, 1.0)
        d = mx.abs(probs - adapted) / ADAPTIVE_WIDTH
        logits = mx.where(mx.isfinite(x), ADAPTIVE_PEAK - ADAPTIVE_SHARPNESS * d * d / (1.0 + d), -mx.inf)
        return probs, logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def sample(self, scores: mx.array) -> mx.array:
        probs, drawn = self.distribution(scores)
        self.drawn = drawn
        y = mx.random.categorical(drawn, key=self.next_key())
        self.weighted = probs[0, y[0]] + self.decay * self.weighted
        self.total = 1.0 + self.decay * self.total
        return y


def top_n_sigma(lp: mx.array, n: float) -> mx.array:
    """lp [1, vocab] with the ids under max - n x std of the finite values at -inf (llama.cpp's
    top-n-sigma; on logprobs as on logits: a shift moves the max and the mean alike)."""
    x = lp.astype(mx.float32)
    finite = mx.isfinite(x)
    count = mx.maximum(finite.sum(axis=-1, keepdims=True), 1)
    mean = mx.where(finite, x, 0.0).sum(axis=-1, keepdims=True) / count
    std = mx.sqrt(mx.where(finite, (x - mean) ** 2, 0.0).sum(axis=-1, keepdims=True) / count)
    floor = x.max(axis=-1, keepdims=True) - n * std
    return mx.where(x < floor, -mx.inf, lp)


def typical(lp: mx.array, mass: float) -> mx.array:
    """Locally typical sampling as transformers' TypicalLogitsWarper: the ids whose surprise is
    closest to the entropy, as many as reach `mass` of probability (one at least); the rest -inf."""
    x = lp.astype(mx.float32)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    p = mx.exp(x)
    entropy = -mx.where(mx.isfinite(x), x * p, 0.0).sum(axis=-1, keepdims=True)
    shifted = mx.abs(-x - entropy)
    order = mx.argsort(shifted, axis=-1)
    cumulative = mx.cumsum(mx.take_along_axis(p, order, axis=-1), axis=-1)
    last = mx.minimum((cumulative < mass).sum(axis=-1, keepdims=True), x.shape[-1] - 1)
    bound = mx.take_along_axis(mx.take_along_axis(shifted, order, axis=-1), last, axis=-1)
    return mx.where(shifted > bound, -mx.inf, lp)


def masked(scores: mx.array, allowed) -> mx.array:
    """scores with the ids a constraint disallows at -inf (allowed None: all allowed; an IfLast:
    only where the token still on the device is one of its ids)."""
    if allowed is None:
        return scores
    if isinstance(allowed, IfLast):
        return if_last_mlx(scores, allowed)
    keep = np.zeros(scores.shape[-1], dtype=bool)
    n = min(len(allowed), keep.shape[0])
    keep[:n] = allowed[:n]
    return mx.where(mx.array(keep), scores, -mx.inf)


def recorded_entry(logprobs: mx.array, y: mx.array, top: int):
    """The sampled token's entry (generation.TokenLogprob) from the raw logprobs: a few values,
    evaluated asynchronously beside the step (so that nothing keeps the [vocab] row alive) and
    read when the engine asks."""
    row = logprobs.reshape(-1).astype(mx.float32)
    token = y.reshape(-1)[:1]
    chosen = row[token]
    ids = mx.zeros((0,), dtype=mx.uint32)
    if top:
        k = min(top, row.shape[0])
        ids = mx.argpartition(-row, kth=k - 1)[:k]
        ids = ids[mx.argsort(-row[ids])]   # the likeliest first
    values = row[ids]
    mx.async_eval(token, chosen, ids, values)

    def read() -> TokenLogprob:
        return TokenLogprob(int(token.item()), float(chosen.item()), list(zip(ids.tolist(), values.tolist())))

    return read


def post_entry(drawn: Optional[mx.array], y: mx.array, top: int):
    """The sampled token's entry after the sampler chain (LogprobRecorder.post): from the
    log-distribution `drawn` it was drawn from (None, greedy: the one id, probability 1), the top
    ones with a probability above 0 only, as llama-server's post_sampling_probs."""
    if drawn is None:
        token = y.reshape(-1)[:1]
        mx.async_eval(token)
        return lambda: TokenLogprob(int(token.item()), 0.0, [(int(token.item()), 0.0)] if top else [])
    read = recorded_entry(drawn, y, top)

    def filtered() -> TokenLogprob:
        e = read()
        return TokenLogprob(e.token, e.logprob, [(i, v) for i, v in e.top if v > -math.inf])

    return filtered


def prefill(model, cache: HeapPromptCache, tokens: Sequence[int], chunk: int,
            progress: Optional[ProgressFn] = None, cancelled=None) -> None:
    """Feed tokens into the cache in chunks, evicting before each once the heap is full
    (peak = sinks + budget + chunk)."""
    total, done = len(tokens), 0
    arr = mx.array(list(tokens), dtype=mx.uint32)
    while done < total:
        if cancelled is not None and cancelled():
            raise InterruptedError("prefill cancelled")
        n = min(chunk, total - done)
        cache.make_room(n)
        model(arr[done:done + n][None], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
        if progress is not None:
            progress(done, total)


def prefill_scored(model, cache: HeapPromptCache, tokens: Sequence[int], following: int, chunk: int,
                   vocab: int, recorder: LogprobRecorder) -> None:
    """Feed `tokens` as `prefill` does, the logits of every position evaluated: each position's
    log-probability of the token after it (the next in `tokens`; after the last, `following`) and
    the recorder's top alternatives go into `recorder` in order, as TokenLogprob (the logits less
    their logsumexp in the model's dtype, as a sampled token's: _step, recorded), SCORED_BLOCK
    rows at a time."""
    arr = mx.array(list(tokens) + [following], dtype=mx.uint32)
    total, rows = len(tokens), scored_rows(chunk, vocab)
    for a in range(0, total, rows):
        n = min(rows, total - a)
        cache.make_room(n)
        logits = model(arr[a:a + n][None], cache=cache)[0]   # [n, vocab]
        mx.eval(logits, [c.state for c in cache])
        for b in range(0, n, SCORED_BLOCK):
            block = logits[b:b + SCORED_BLOCK]
            logprobs = (block - mx.logsumexp(block, axis=-1, keepdims=True)).astype(mx.float32)
            targets = arr[a + b + 1:a + min(b + SCORED_BLOCK, n) + 1]
            chosen = mx.take_along_axis(logprobs, targets[:, None].astype(mx.int32), axis=-1)[:, 0]
            top = min(recorder.top, logprobs.shape[-1])
            ids = values = None
            if top:
                ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
                values = mx.take_along_axis(logprobs, ids, axis=-1)
                order = mx.argsort(-values, axis=-1)   # the likeliest first
                ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
            mx.eval(chosen, *([ids, values] if top else []))
            tops = zip(ids.tolist(), values.tolist()) if top else (([], []) for _ in range(targets.shape[0]))
            for token, value, (ids_i, values_i) in zip(targets.tolist(), chosen.tolist(), tops):
                recorder.add(TokenLogprob(token, value, list(zip(ids_i, values_i))))


def prefill_pooled(model, cache: HeapPromptCache, tokens: Sequence[int], chunk: int, pool) -> None:
    """Feed `tokens` as `prefill` does, through the model's body alone (no output head): each
    chunk's last hidden states (after the final norm) go to `pool` (embedding.Pooler) as their
    float32 sum and last row."""
    arr = mx.array(list(tokens), dtype=mx.uint32)
    total = len(tokens)
    for a in range(0, total, chunk):
        n = min(chunk, total - a)
        cache.make_room(n)
        hidden = model.model(arr[a:a + n][None], cache=cache)[0].astype(mx.float32)   # [n, hidden]
        summed, last = hidden.sum(axis=0), hidden[-1]
        mx.eval(summed, last, [c.state for c in cache])
        pool.add(np.array(summed), n, np.array(last))


def embed_rows(model, rows: Sequence[Sequence[int]]) -> list[tuple]:
    """Short inputs in one forward of the model's body, no cache: right-padded (causal attention:
    a row's tokens never see the padding after them, their positions are their own). Each row's
    (float32 sum of its last hidden states, tokens, last one) for an embedding.Pooler."""
    longest = max(len(r) for r in rows)
    ids = np.zeros((len(rows), longest), dtype=np.uint32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = list(r)
    hidden = model.model(mx.array(ids)).astype(mx.float32)   # [B, L, H]
    parts = [(hidden[i, :len(r)].sum(axis=0), hidden[i, len(r) - 1]) for i, r in enumerate(rows)]
    mx.eval(parts)
    return [(np.array(total), len(r), np.array(last)) for (total, last), r in zip(parts, rows)]


def prefill_turn(model, cache: HeapPromptCache, prompt: list, chunk: int,
                 progress: Optional[ProgressFn] = None, cancelled=None) -> None:
    """All of a turn's prompt but its last token (which the first step feeds). With recall on and
    something evicted, the last `obs_window` tokens (the question) are held back: the rest is
    fed, the question recalls pages, then is fed itself. Otherwise exactly `prefill` of
    prompt[:-1] (so a heap that never evicts stays mlx-lm's cache)."""
    if not recall_due(cache, prompt, chunk):
        prefill(model, cache, prompt[:-1], chunk, progress, cancelled)
        return
    question = recall_begin(model, cache, prompt, chunk, progress, cancelled)
    paging.recall_pick(cache, question.recalling)
    recall_end(model, cache, question, chunk, progress, cancelled)


def recall_due(cache: HeapPromptCache, prompt: list, chunk: int) -> bool:
    """Whether prefill_turn(prompt) recalls (something was or will be evicted)."""
    return paging.needs_recall(cache, paging.prefill_chunks(len(prompt) - 1, chunk) + [1])


def recall_begin(model, cache: HeapPromptCache, prompt: list, chunk: int, progress: Optional[ProgressFn] = None,
                 cancelled=None) -> paging.Question:
    """The turn's body fed, its question probed (paging.recall_begin); the pick is next."""
    body, question = paging.split_question(cache, prompt)
    prefill(model, cache, body, chunk, paging.progress_from(progress, 0, len(prompt) - 1), cancelled)
    began = paging.recall_begin(cache, len(question), lambda: recall.probe(model, cache, question))
    return paging.Question(question, len(body), len(prompt) - 1, began)


def recall_end(model, cache: HeapPromptCache, question: paging.Question, chunk: int,
               progress: Optional[ProgressFn] = None, cancelled=None) -> None:
    """The pick merged (paging.recall_end), then the question fed but its last token (the first
    step's)."""
    paging.recall_end(cache, question.recalling)
    prefill(model, cache, question.tokens[:-1], chunk, paging.progress_from(progress, question.fed, question.total),
            cancelled)


def decode_step(model, cache: HeapPromptCache, tokens: mx.array, sampler, share=None):
    compiled = compiled_step(model, cache) if getattr(cache, "compile_decode", False) and tokens.shape[0] == 1 else None
    if compiled is not None:
        logits = compiled(cache, tokens)   # [1, vocab]; the heap's own work inside, uncompiled
    else:
        cache.make_room(tokens.shape[0])
        logits = model(tokens[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    y = sampler(logits, logprobs)
    return (y if share is None else share(y)), logprobs.squeeze(0)


def generate_tokens(model, cache: HeapPromptCache, prompt: Sequence[int], params: SamplingParams,
                    progress: Optional[ProgressFn] = None, cancelled=None, share=None) -> Iterator[int]:
    """Yield generated token ids. `prompt` holds the tokens not yet in the cache (>= 1).
    `share`: what every rank makes of a sampled token (distributed: rank 0's, on every rank)."""
    for token, _ in generate_steps(model, cache, prompt, params, progress, cancelled, share):
        yield token


def generate_steps(model, cache: HeapPromptCache, prompt: Sequence[int], params: SamplingParams,
                   progress: Optional[ProgressFn] = None, cancelled=None,
                   share=None) -> Iterator[tuple[int, mx.array]]:
    """Yield (token id, logprobs [vocab]) like mlx-lm's generate_step."""
    if len(prompt) == 0:
        raise ValueError("generation needs at least one new prompt token")
    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = Sampler(params)
    chunk = cache.cfg.chunk
    prompt = list(prompt)
    prefill_turn(model, cache, prompt, chunk, progress, cancelled)
    if params.max_tokens == 0:
        return
    y, lp = decode_step(model, cache, mx.array(prompt[-1:], dtype=mx.uint32), sampler, share)
    mx.async_eval(y, lp, *cache.score_arrays())
    for n in range(params.max_tokens):
        if n + 1 < params.max_tokens:
            next_y, next_lp = decode_step(model, cache, y, sampler, share)
            mx.async_eval(next_y, next_lp, *cache.score_arrays())
        yield y.item(), lp
        if n + 1 < params.max_tokens:
            y, lp = next_y, next_lp
