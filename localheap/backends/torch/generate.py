"""The torch generation loop over a heap: chunked prefill, one forward per decode step.

Mirrors transformers' generate (prompt fed whole, or in `prefill_chunk_size` chunks
from the start; logits of the last position only; fp32 logits; argmax when greedy,
its temperature / top-k / top-p warpers and multinomial otherwise), so that with a
budget at least as large as the context the tokens are exactly transformers'. The
heap makes room before every forward pass, so RoPE positions are final first.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence

import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper, TypicalLogitsWarper)

from ...dry import dry_state
from ...grammar import IfLast, if_last_torch
from ...generation import (ADAPTIVE_PEAK, ADAPTIVE_SHARPNESS, ADAPTIVE_WIDTH, DYNATEMP_FLOOR, MIROSTAT_M,
                           SCORED_BLOCK, LogprobRecorder, ProgressFn, SamplingParams, TokenLogprob,
                           check_logit_bias, handoff, scored_rows)
from .. import paging
from . import recall
from .attention import cache_kwarg
from .cache import HeapCache
from .lean import lean_step


def forward(model, cache: HeapCache, tokens: torch.Tensor) -> torch.Tensor:
    """tokens: [L] ids on the model's device, L <= the append room. Returns the last position's logits [vocab] fp32."""
    n = tokens.shape[0]
    if n == 1 and (lean := lean_step(model, cache)) is not None:
        return lean(cache, tokens)   # the same ops without transformers' module glue
    cache.make_room(n)
    with torch.no_grad():
        out = model(input_ids=tokens[None], position_ids=cache.position_ids(n), **cache_kwarg(model, cache),
                    use_cache=True, logits_to_keep=1, heap=cache)
    return out.logits[0, -1].to(dtype=torch.float32, copy=True)


def prefill(model, cache: HeapCache, tokens: Sequence[int], progress: Optional[ProgressFn] = None,
            cancelled=None) -> Optional[torch.Tensor]:
    """Feed tokens in prefill chunks, evicting before each once the heap is full
    (peak = sinks + budget + chunk); returns the last logits."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=cache.device)
    total, done, logits = ids.shape[0], 0, None
    while done < total:
        if cancelled is not None and cancelled():
            raise InterruptedError("prefill cancelled")
        n = min(cache.cfg.chunk, total - done)
        logits = forward(model, cache, ids[done:done + n])
        done += n
        if progress is not None:
            progress(done, total)
    return logits


def prefill_scored(model, cache: HeapCache, tokens: Sequence[int], following: int, recorder: LogprobRecorder) -> None:
    """Feed `tokens` as `prefill` does, with logits for every position: each position's
    log-probability of the token after it (the next in `tokens`; after the last, `following`) and
    the recorder's top alternatives go into `recorder` in order, as TokenLogprob (log-softmax of
    the fp32 logits, as a sampled token's, logprob_entry), SCORED_BLOCK rows at a time (one host
    read each)."""
    ids = torch.as_tensor(list(tokens) + [following], dtype=torch.long, device=cache.device)
    total = ids.shape[0] - 1
    rows = scored_rows(cache.cfg.chunk, model.get_output_embeddings().weight.shape[0])
    for a in range(0, total, rows):
        n = min(rows, total - a)
        cache.make_room(n)
        with torch.no_grad():
            logits = model(input_ids=ids[a:a + n][None], position_ids=cache.position_ids(n), **cache_kwarg(model, cache),
                           use_cache=True, logits_to_keep=0, heap=cache).logits[0]   # [n, vocab]
            for b in range(0, n, SCORED_BLOCK):
                logprobs = torch.log_softmax(logits[b:b + SCORED_BLOCK].float(), dim=-1)
                targets = ids[a + b + 1:a + min(b + SCORED_BLOCK, n) + 1]
                chosen = logprobs.gather(1, targets[:, None])[:, 0]
                top = min(recorder.top, logprobs.shape[-1])
                values, top_ids = torch.topk(logprobs, top, dim=-1) if top else (None, None)
                del logprobs
                tops = zip(top_ids.tolist(), values.tolist()) if top else (([], []) for _ in targets)
                for token, value, (ids_i, values_i) in zip(targets.tolist(), chosen.tolist(), tops):
                    recorder.add(TokenLogprob(token, value, list(zip(ids_i, values_i))))


def prefill_pooled(model, cache: HeapCache, tokens: Sequence[int], pool) -> None:
    """Feed `tokens` as `prefill` does, through the model's body alone (no output head): each
    chunk's last hidden states (after the final norm) go to `pool` (embedding.Pooler) as their
    float32 sum and last row."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=cache.device)
    body = model.base_model
    total = ids.shape[0]
    for a in range(0, total, cache.cfg.chunk):
        n = min(cache.cfg.chunk, total - a)
        cache.make_room(n)
        with torch.no_grad():
            hidden = body(input_ids=ids[a:a + n][None], position_ids=cache.position_ids(n), **cache_kwarg(body, cache),
                          use_cache=True, heap=cache).last_hidden_state[0].float()   # [n, hidden]
            pool.add(hidden.sum(dim=0).cpu().numpy(), n, hidden[-1].cpu().numpy())


def embed_rows(model, rows: Sequence[Sequence[int]], device: torch.device) -> list[tuple]:
    """Short inputs in one forward of the model's body, no cache: right-padded (causal attention:
    a row's tokens never see the padding after them, their positions are their own). Each row's
    (float32 sum of its last hidden states, tokens, last one) for an embedding.Pooler."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids.to(device), use_cache=False).last_hidden_state.float()   # [B, L, H]
        return [(hidden[i, :len(r)].sum(dim=0).cpu().numpy(), len(r), hidden[i, len(r) - 1].cpu().numpy())
                for i, r in enumerate(rows)]


def prefill_turn(model, cache: HeapCache, tokens: Sequence[int], progress: Optional[ProgressFn] = None,
                 cancelled=None) -> Optional[torch.Tensor]:
    """A turn's prompt. With recall on and something evicted, the last `obs_window` tokens (the
    question) are held back: the rest is fed, the question recalls pages, then is fed itself.
    Otherwise exactly `prefill` (so a heap that never evicts stays the stock cache)."""
    if not recall_due(cache, tokens):
        return prefill(model, cache, tokens, progress, cancelled)
    question = recall_begin(model, cache, tokens, progress, cancelled)
    paging.recall_pick(cache, question.recalling)
    return recall_end(model, cache, question, progress, cancelled)


def recall_due(cache: HeapCache, tokens: Sequence[int]) -> bool:
    """Whether prefill_turn(tokens) recalls (something was or will be evicted)."""
    return paging.needs_recall(cache, paging.prefill_chunks(len(tokens), cache.cfg.chunk))


def recall_begin(model, cache: HeapCache, tokens: Sequence[int], progress: Optional[ProgressFn] = None,
                 cancelled=None) -> paging.Question:
    """The turn's body fed, the question probed (paging.recall_begin); the pick is next."""
    body, question = paging.split_question(cache, tokens)
    if body:
        prefill(model, cache, body, paging.progress_from(progress, 0, len(tokens)), cancelled)
    ids = torch.as_tensor(question, dtype=torch.long, device=cache.device)
    began = paging.recall_begin(cache, len(question), lambda: recall.probe(model, cache, ids))
    return paging.Question(question, len(body), len(tokens), began)


def recall_end(model, cache: HeapCache, question: paging.Question, progress: Optional[ProgressFn] = None,
               cancelled=None) -> Optional[torch.Tensor]:
    """The pick merged (paging.recall_end), then the question fed: its last logits."""
    paging.recall_end(cache, question.recalling)
    return prefill(model, cache, question.tokens, paging.progress_from(progress, question.fed, question.total),
                   cancelled)


class Sampler:
    """Next token from fp32 logits [vocab], as transformers' generate picks it; stays on the device."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.greedy = params.greedy
        self.warpers = []
        self.mirostat = Mirostat(params, device) if params.mirostatted else None
        self.adaptive = AdaptiveP(params, device) if params.adaptive else None
        if self.mirostat is not None:   # temperature, then Mirostat in place of the cut-offs (llama.cpp's chain)
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
        elif not self.greedy:
            if params.top_n_sigma > 0.0:
                self.warpers.append(lambda _, scores, n=params.top_n_sigma: top_n_sigma(scores, n))
            if params.temperature != 1.0 and not params.dynamic_temperature:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(params.top_p))
            if params.min_p > 0.0:
                self.warpers.append(MinPLogitsWarper(params.min_p))
            if params.typical_p < 1.0:
                self.warpers.append(TypicalLogitsWarper(params.typical_p))
            if params.xtc_probability > 0.0:
                self.warpers.append(lambda _, scores, p=params.xtc_probability, t=params.xtc_threshold:
                                    xtc(scores, p, t, self.generator))
            if params.dynamic_temperature:   # last, as in llama.cpp
                self.warpers.append(lambda _, scores, t=params.temperature, r=params.dynatemp_range,
                                    e=params.dynatemp_exponent: scores / dynamic_temperature(scores, t, r, e))
        self.penalized = params.penalized
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.counted = params.penalized and params.windowed_penalties   # counts follow the window's ids
        self.counts: Optional[torch.Tensor] = None   # [vocab] float32: how often this reply (or the window) has each id
        self.repeat = params.repeat_penalty if params.repeating else None
        self.last_n = params.repeat_last_n
        self.window: Optional[torch.Tensor] = None   # [n] int64: the ids the penalties look back over
        if params.windowed:
            self.window = torch.tensor(params.window(params.repeat_last_n), dtype=torch.int64).to(device)
        self.dry = dry_state(params)
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
        self.constraint = params.constraint
        self.logit_bias = params.logit_bias
        self.bias: Optional[torch.Tensor] = None   # [vocab] float32, made at the first sample
        self.recorder = params.logprobs
        self.plain = params.plain_greedy           # the batch argmaxes it with the others

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """[1] int64 token id on the logits' device (no host sync, unless a constraint must see it)."""
        scores = logits[None]                          # [1, vocab]
        if self.logit_bias:
            if self.bias is None:
                self.bias = bias_vector(self.logit_bias, scores.shape[-1], scores.device)
            scores = scores + self.bias
        if self.repeat is not None and self.window.numel():
            scores = repeat_penalized(scores, self.window, self.repeat)
        if self.counted and self.counts is None:
            self.counts = window_counts(self.window, scores.shape[-1])
        if self.counts is not None:                    # penalized, once the reply has a token (or the window)
            scores = scores - (self.presence * (self.counts > 0) + self.frequency * self.counts)
        if self.dry is not None:
            ids, amounts = self.dry.penalties()
            if ids.size:
                scores = scores.index_add(1, torch.from_numpy(ids).to(scores.device),
                                          -torch.from_numpy(amounts).to(scores.device)[None])
        if self.constraint is not None:
            scores = _masked(scores, self.constraint.allowed())
        drawn = None   # [1, vocab] the probabilities the draw was from (greedy: none)
        if self.greedy:
            token = torch.argmax(scores, dim=-1)
        else:
            for warp in self.warpers:
                scores = warp(None, scores)
            if self.mirostat is not None:
                token = self.mirostat.sample(scores, self.generator)
                drawn = self.mirostat.drawn
            elif self.adaptive is not None:
                token = self.adaptive.sample(scores, self.generator)
                drawn = self.adaptive.drawn
            else:
                drawn = torch.softmax(scores, dim=-1)
                token = torch.multinomial(drawn, num_samples=1, generator=self.generator)[0]
        if self.penalized:   # counted on the device: no host sync
            if self.counts is None:
                self.counts = torch.zeros(scores.shape[-1], dtype=torch.float32, device=scores.device)
            self.counts.index_put_((token.reshape(-1),), torch.ones(1, device=scores.device), accumulate=True)
        if self.window is not None:   # on the device too
            self.window = torch.cat([self.window, token.reshape(-1)])
            if self.last_n > 0 and self.window.numel() > self.last_n:
                if self.counted:   # the id that leaves the window leaves the counts
                    gone = self.window[:-self.last_n]
                    self.counts.index_put_((gone,), -torch.ones(gone.numel(), device=scores.device), accumulate=True)
                self.window = self.window[-self.last_n:]
        if self.recorder is not None and self.recorder.post:   # the chain's own distribution (greedy: one id)
            self.recorder.add(post_entry(drawn, token, self.recorder.top))
        elif self.recorder is not None:
            self.recorder.add(logprob_entry(logits, token, self.recorder.top))
        if self.constraint is not None:
            handoff(self.constraint, token)
        if self.dry is not None:   # on the host: DRY matches the ids themselves
            self.dry.push(int(token))
        return token

    def __call__(self, logits: torch.Tensor) -> int:
        return int(self.sample(logits))


class Mirostat:
    """Mirostat 1 or 2 (SamplingParams.mirostatted) on the device: mu is a tensor beside the step,
    so steering needs no host sync."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.version, self.tau, self.eta = params.mirostat, params.mirostat_tau, params.mirostat_eta
        self.mu = torch.tensor(2.0 * self.tau, dtype=torch.float32, device=device)

    def keep(self, scores: torch.Tensor) -> torch.Tensor:
        """[1, vocab] bool: the ids it may draw this step."""
        logp = torch.log_softmax(scores.float(), dim=-1)
        if self.version == 2:
            keep = -logp / math.log(2.0) <= self.mu
        else:
            m = min(MIROSTAT_M, logp.shape[-1])
            ranked = torch.sort(logp[0], descending=True).values              # log p, the likeliest first
            top = ranked[:m]
            i = torch.arange(m - 1, dtype=torch.float32, device=logp.device)
            t = torch.log((i + 2) / (i + 1))
            b = torch.nan_to_num(top[:-1] - top[1:], nan=0.0, posinf=0.0)   # (ids cut already: p 0)
            s_hat = (t * b).sum() / (t * t).sum()
            eps = s_hat - 1
            k = ((eps * 2.0 ** self.mu) / (1 - logp.shape[-1] ** (-eps))) ** (1 / s_hat)
            k = torch.nan_to_num(k, nan=1.0, posinf=float(logp.shape[-1])).clamp(1, logp.shape[-1]).long()
            keep = logp >= ranked[k - 1]                                       # the k likeliest (ties: all)
        return keep | (logp == logp.max(dim=-1, keepdim=True).values)     # the likeliest id at least

    def sample(self, scores: torch.Tensor, generator=None) -> torch.Tensor:
        probs = self.drawn = torch.softmax(scores.float().masked_fill(~self.keep(scores), float("-inf")), dim=-1)
        token = torch.multinomial(probs, num_samples=1, generator=generator)[0]
        surprise = -torch.log2(probs[0, token[0]])
        self.mu = self.mu - self.eta * (surprise - self.tau)
        return token


class AdaptiveP:
    """llama.cpp's adaptive-p (SamplingParams.adaptive) on the device: the EMA's weighted sum is a
    tensor beside the step (its total weight does not depend on the draws), so no host sync."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.target, self.decay = min(params.adaptive_target, 1.0), params.adaptive_decay
        self.weighted = torch.tensor(self.target / (1.0 - self.decay), dtype=torch.float32, device=device)
        self.total = 1.0 / (1.0 - self.decay)

    def distribution(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([1, vocab] the ids' probabilities before, [1, vocab] the distribution it draws from)."""
        probs = torch.softmax(scores.float(), dim=-1)
        adapted = (2.0 * self.target - self.weighted / self.total).clamp(0.0, 1.0)
        d = (probs - adapted).abs() / ADAPTIVE_WIDTH
        logits = torch.where(torch.isfinite(scores), ADAPTIVE_PEAK - ADAPTIVE_SHARPNESS * d * d / (1.0 + d),
                             torch.full_like(probs, float("-inf")))
        return probs, torch.softmax(logits, dim=-1)

    def sample(self, scores: torch.Tensor, generator=None) -> torch.Tensor:
        probs, drawn = self.distribution(scores)
        self.drawn = drawn
        token = torch.multinomial(drawn, num_samples=1, generator=generator)[0]
        self.weighted = probs[0, token[0]] + self.decay * self.weighted
        self.total = 1.0 + self.decay * self.total
        return token


def dynamic_temperature(scores: torch.Tensor, temperature: float, spread: float, exponent: float) -> torch.Tensor:
    """[1, 1] the temperature llama.cpp's dynatemp gives these scores (SamplingParams.dynamic_temperature)."""
    finite = torch.isfinite(scores)
    n = finite.sum(-1, keepdim=True).clamp(min=2).float()
    logp = torch.log_softmax(scores.float(), dim=-1)
    entropy = -torch.where(finite, logp.exp() * logp, torch.zeros_like(logp)).sum(-1, keepdim=True)
    lo, hi = max(0.0, temperature - spread), temperature + spread
    return (lo + (hi - lo) * (entropy / torch.log(n)).clamp(0, 1) ** exponent).clamp(min=DYNATEMP_FLOOR)


def top_n_sigma(scores: torch.Tensor, n: float) -> torch.Tensor:
    """scores [1, vocab] with the ids under max - n x std of the finite scores at -inf (llama.cpp's top-n-sigma)."""
    finite = torch.isfinite(scores)
    vals = torch.where(finite, scores, torch.zeros_like(scores))
    count = finite.sum(-1, keepdim=True).clamp(min=1)
    mean = vals.sum(-1, keepdim=True) / count
    std = (torch.where(finite, (scores - mean) ** 2, torch.zeros_like(scores)).sum(-1, keepdim=True) / count).sqrt()
    floor = scores.max(-1, keepdim=True).values - n * std
    return scores.masked_fill(scores < floor, float("-inf"))


def xtc(scores: torch.Tensor, probability: float, threshold: float, generator=None) -> torch.Tensor:
    """XTC as mlx-lm's apply_xtc: a draw each step; under `probability`, every id whose probability
    passes `threshold` but the least likely of them goes to -inf (all stay where fewer than two pass)."""
    probs = torch.softmax(scores, dim=-1)
    floor = torch.where(probs > threshold, probs, torch.full_like(probs, float("inf"))).min(-1, keepdim=True).values
    coin = torch.rand((), generator=generator, device=scores.device)
    return torch.where(coin > probability, scores, scores.masked_fill(probs > floor, float("-inf")))


def repeat_penalized(scores: torch.Tensor, window: torch.Tensor, penalty: float) -> torch.Tensor:
    """scores [1, vocab] with each id of `window` penalized (SamplingParams.repeating): its logit
    divided by `penalty` where positive, multiplied where not (a new tensor: the logits stay raw)."""
    picked = scores.gather(1, window[None])
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores.scatter(1, window[None], picked)


def window_counts(window: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] float32: how many times each id is in `window` (ids past the logits' vocabulary,
    which no sample can give, are left out)."""
    return torch.bincount(window[window < vocab], minlength=vocab).to(torch.float32)


def bias_vector(bias: dict[int, float], vocab: int, device: torch.device) -> torch.Tensor:
    """OpenAI's logit_bias as a [vocab] float32 vector (an id past the vocabulary is an error)."""
    check_logit_bias(bias, vocab)
    out = torch.zeros(vocab, dtype=torch.float32)
    out[list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32)
    return out.to(device)


def logprob_entry(logits: torch.Tensor, token: torch.Tensor, top: int):
    """The sampled token's entry (generation.TokenLogprob) from the raw logits [vocab], computed
    on the device now (a CUDA graph's logits buffer is overwritten by the next replay) and read off
    it when the engine asks."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[token.reshape(-1)]
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else (None, None)

    def read() -> TokenLogprob:
        alternatives = list(zip(ids.tolist(), values.tolist())) if top else []
        return TokenLogprob(int(token.reshape(-1)[0]), float(chosen[0]), alternatives)

    return read


def post_entry(drawn: Optional[torch.Tensor], token: torch.Tensor, top: int):
    """The sampled token's entry after the sampler chain (LogprobRecorder.post): log of the
    probabilities `drawn` [1, vocab] it was drawn from (None, greedy: the one id, probability 1),
    the top ones with a probability above 0 only, as llama-server's post_sampling_probs."""
    if drawn is None:
        def one() -> TokenLogprob:
            t = int(token.reshape(-1)[0])
            return TokenLogprob(t, 0.0, [(t, 0.0)] if top else [])
        return one
    logprobs = torch.log(drawn[0].float())
    chosen = logprobs[token.reshape(-1)]
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else (None, None)

    def read() -> TokenLogprob:
        alternatives = [(i, v) for i, v in zip(ids.tolist(), values.tolist()) if v > float("-inf")] if top else []
        return TokenLogprob(int(token.reshape(-1)[0]), float(chosen[0]), alternatives)

    return read


def _masked(scores: torch.Tensor, allowed) -> torch.Tensor:
    """scores [1, vocab] with the ids a constraint disallows at -inf (None: all allowed; an IfLast:
    only where the token still on the device is one of its ids)."""
    if allowed is None:
        return scores
    if isinstance(allowed, IfLast):
        return if_last_torch(scores, allowed)
    keep = torch.zeros(scores.shape[-1], dtype=torch.bool)
    n = min(len(allowed), scores.shape[-1])
    keep[:n] = torch.from_numpy(allowed[:n])
    return scores.masked_fill(~keep.to(scores.device), float("-inf"))


class HostCopy:
    """A token id on its way to the host: on CUDA an async copy into pinned memory and an event,
    so waiting for it does not wait for the forward queued after it."""

    def __init__(self, token: torch.Tensor):
        if token.device.type == "cuda":
            self.host = torch.empty(token.shape, dtype=token.dtype, pin_memory=True)
            self.host.copy_(token, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = token, None

    def get(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host)


def generate_steps(model, cache: HeapCache, prompt: Sequence[int], params: SamplingParams,
                   progress: Optional[ProgressFn] = None, cancelled=None,
                   pipeline: Optional[bool] = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (token id, logits [vocab] fp32 it was sampled from). `prompt`: tokens not yet in the cache (>= 1).

    One host sync per token: the sampled id stays on the device and is fed from there. With
    `pipeline` (default: on CUDA) the next forward is queued before the host waits for the id,
    as mlx-lm does with async_eval, so the yielded token is already fed (the engine reconciles
    the last one on close); without it, a token is fed only after it was yielded."""
    if len(prompt) == 0:
        raise ValueError("generation needs at least one new prompt token")
    pipeline = cache.device.type == "cuda" if pipeline is None else pipeline
    sampler = Sampler(params, cache.device)
    logits = prefill_turn(model, cache, prompt, progress, cancelled)
    token = sampler.sample(logits)
    for n in range(params.max_tokens):
        more = n + 1 < params.max_tokens
        if more and pipeline:
            ready = HostCopy(token)
            next_logits = forward(model, cache, token)
            yield ready.get(), logits
            if cancelled is not None and cancelled():
                return
        else:
            yield int(token), logits
            if not more or (cancelled is not None and cancelled()):
                return
            next_logits = forward(model, cache, token)
        logits = next_logits
        token = sampler.sample(logits)


def generate_tokens(model, cache: HeapCache, prompt: Sequence[int], params: SamplingParams,
                    progress: Optional[ProgressFn] = None, cancelled=None) -> Iterator[int]:
    """Yield generated token ids; each is fed before the next is sampled (the last one is not fed;
    pipelined on CUDA, the last one yielded before a stop may be)."""
    for token, _ in generate_steps(model, cache, prompt, params, progress, cancelled):
        yield token
