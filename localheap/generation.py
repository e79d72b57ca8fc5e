"""Backend-agnostic generation pieces: sampling settings, stop sequences, results.

Knows nothing about tensors or tokenizers' internals: text in, text out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional, Protocol

ProgressFn = Callable[[int, int], None]   # (tokens done, tokens total)
PENALTY_RANGE = (-2.0, 2.0)   # presence_penalty, frequency_penalty (OpenAI's range)
MIN_P_RANGE = (0.0, 1.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)   # OpenAI's, per id
REPEAT_PENALTY_MAX = 10.0            # repeat_penalty's bound (llama.cpp sets none; past this every repeat is banned)
DRY_MULTIPLIER_MAX = 100.0
TOP_N_SIGMA_MAX = 100.0
MIROSTAT_TAU_MAX = 64.0
DYNATEMP_MAX = 10.0
DYNATEMP_FLOOR = 1e-4   # a dynamic temperature of 0 (llama.cpp: greedy) is held here: nearly one-hot
MIROSTAT_M = 100   # Mirostat 1's estimate of the distribution's shape reads the likeliest m ids (llama.cpp's m)
ADAPTIVE_DECAY_MAX = 0.99   # adaptive-p's EMA decay at most (llama.cpp clamps it there)
# adaptive-p's transform of each id's probability p into a logit (llama.cpp's constants): PEAK -
# SHARPNESS x d^2 / (1 + d), d = |p - the adapted target| / WIDTH
ADAPTIVE_WIDTH, ADAPTIVE_PEAK, ADAPTIVE_SHARPNESS = 0.3, 5.0, 10.0
DRY_BASE_MAX = 8.0
TOP_LOGPROBS_MAX = 20                # alternatives per token a reply's logprobs may list (OpenAI's limit)


class Constraint(Protocol):
    """Limits which tokens a request may sample (a grammar, or a test's forced tokens). Each
    backend's Sampler asks `allowed()` before every sample and calls `advance` with the result.
    One object per request: it holds the request's position in the grammar."""

    def allowed(self) -> Optional[Any]:
        """A numpy bool array: True for the ids allowed next (ids past its end are not), or None for any,
        or a grammar.IfLast (a mask that holds only after one of a few ids still on the device)."""

    def advance(self, token: int) -> None:
        """The token just sampled."""

    # Optional: see(token) takes the token still on the device (a [1] array) where the constraint
    # can read it later (LazyGrammar); samplers call it instead of advance (see handoff below).


def handoff(constraint: Any, token: Any) -> None:
    """Give a constraint the token a sampler just drew ([1] array on the device): `see` where it can
    read it later (no host sync now), else `advance` with the id (a sync)."""
    see = getattr(constraint, "see", None)
    if see is not None:
        see(token)
    else:
        constraint.advance(int(token.reshape(-1)[0].item()))


def check_logit_bias(bias: dict[int, float], vocab: int) -> None:
    """A logit_bias that names an id past the vocabulary (ids 0..vocab-1) is a ValueError."""
    if bias and max(bias) >= vocab:
        raise ValueError(f"logit_bias names token id {max(bias)}; this model's ids are 0..{vocab - 1}")


SCORED_LOGITS_BYTES = 128 << 20   # a scored prefill's logits [rows, vocab] (as float32) at most
SCORED_BLOCK = 64                 # rows whose log-softmax and top ids are taken at once (float32 copies)
SCORED_BLOCK_COPIES = 4           # [block, vocab] float32 arrays those hold at once (at most: MLX's argpartition)


def scored_rows(chunk: int, vocab: int) -> int:
    """Tokens per forward of a scored prefill (prompt logprobs: logits for every position): the
    prefill chunk, fewer where the logits would pass SCORED_LOGITS_BYTES (a 128K vocabulary: 256)."""
    return max(1, min(chunk, SCORED_LOGITS_BYTES // (4 * vocab)))


def scored_bytes(chunk: int, vocab: int, dtype_bytes: int) -> int:
    """The most a scored prefill's logits hold at once: one forward's [rows, vocab] in the model's
    dtype and a block's float32 copies."""
    rows = scored_rows(chunk, vocab)
    return rows * vocab * dtype_bytes + min(rows, SCORED_BLOCK) * vocab * 4 * SCORED_BLOCK_COPIES


@dataclass
class TokenLogprob:
    """A sampled token's log probability and the `top` likeliest ids' (id, log probability), the
    likeliest first. The distribution is the model's own: log-softmax of the raw logits, before
    logit_bias, penalties, a constraint, temperature and top-k/p/min-p (vLLM's default)."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


class LogprobRecorder:
    """A request's logprobs (its `logprobs` field): each backend's sampler adds one entry per
    sample, in order, as a callable that reads the entry off the device when asked (`get`), so
    sampling itself never waits for the host. Entry i belongs to the reply's i-th token. `post`
    (llama-server's post_sampling_probs): the entries are of the distribution the token was drawn
    from, after the whole chain (bias, penalties, constraint, cut-offs, temperature, Mirostat or
    adaptive-p; greedy: the one id, log probability 0), its ids of probability 0 left out."""

    def __init__(self, top: int = 0, post: bool = False):
        if not 0 <= top <= TOP_LOGPROBS_MAX:
            raise ValueError(f"top logprobs must be in [0, {TOP_LOGPROBS_MAX}]")
        self.top, self.post = top, post
        self._entries: list = []   # TokenLogprob, or a callable that makes it

    def add(self, read: Callable[[], TokenLogprob]) -> None:
        self._entries.append(read)

    def get(self, i: int) -> TokenLogprob:
        entry = self._entries[i]
        if not isinstance(entry, TokenLogprob):
            entry = self._entries[i] = entry()
        return entry

    def __len__(self) -> int:
        return len(self._entries)


SEED_SPACE = 1 << 64   # seeds are taken modulo this (a request's seed + its choice's index stays in range)
SEED_MIN = -(1 << 63)  # a request's seed: a 64-bit number, signed or not (SEED_MIN <= seed < SEED_SPACE)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    constraint: Optional[Constraint] = None   # structured output; sampled ids are masked by it
    min_p: float = 0.0            # 0 = off: ids under min_p x the likeliest id's probability are dropped
    typical_p: float = 1.0        # 1 = off: locally typical sampling (transformers' TypicalLogitsWarper)
    top_n_sigma: float = 0.0      # 0 = off: ids whose logit is under max - n x the logits' std are dropped
    xtc_probability: float = 0.0  # 0 = off: XTC (mlx-lm's apply_xtc): with this chance a step drops every id
    xtc_threshold: float = 0.1    # above the threshold but the least likely of them
    dynatemp_range: float = 0.0   # 0 = off: the temperature moves within +-range with the entropy (llama.cpp's)
    dynatemp_exponent: float = 1.0
    mirostat: int = 0             # 0 = off; 1 or 2: Mirostat's version, in place of the cut-offs (see `mirostatted`)
    mirostat_tau: float = 5.0     # the surprise (bits per token) it steers towards
    mirostat_eta: float = 0.1     # how fast it steers
    adaptive_target: float = -1.0  # negative = off: llama.cpp's adaptive-p (see `adaptive`), 0 to 1
    adaptive_decay: float = 0.9    # its EMA's decay (history ~ 1 / (1 - decay) tokens)
    presence_penalty: float = 0.0   # OpenAI's: taken off the logit of each id this reply has written
    frequency_penalty: float = 0.0  # OpenAI's: times the number of times this reply has written the id
    windowed_penalties: bool = False   # llama.cpp's and Ollama's: both count repeat_last_n's window instead
    logit_bias: dict[int, float] = field(default_factory=dict)   # OpenAI's: added to the id's logit
    logprobs: Optional[LogprobRecorder] = None   # each sampled token's logprob (and the top ids') go here
    prompt_logprobs: Optional[LogprobRecorder] = None   # each new prompt token's but the first (prefill_scored)
    stop_token_ids: list[int] = field(default_factory=list)   # end the reply as EOS does (vLLM's; a FIM model's end tokens)
    repeat_penalty: float = 1.0   # llama.cpp's and Ollama's (vLLM's repetition_penalty): 1 = off; see `repeating`
    repeat_last_n: int = 64       # the window it looks back over: the context's last n tokens (-1: all; 0: off)
    dry_multiplier: float = 0.0   # DRY (llama.cpp's, koboldcpp's; localheap.dry): 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # its window: the context's last n tokens (-1: all; 0: off)
    dry_breakers: list[int] = field(default_factory=list)   # ids that end a match (dry.breaker_ids)
    context: list[int] = field(default_factory=list)   # the context before the reply, as far back as the
    # penalties' windows reach (with_context; the engine sets it)

    def __post_init__(self) -> None:
        for f in fields(self):   # (JSON readers take NaN and Infinity, which every range check below lets by)
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number (it was {value})")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        for name, (lo, hi) in (("min_p", MIN_P_RANGE), ("presence_penalty", PENALTY_RANGE),
                               ("frequency_penalty", PENALTY_RANGE)):
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"{name} must be in [{lo:g}, {hi:g}]")
        if self.seed is not None:   # as an unsigned 64-bit number: what both backends' generators take (torch
            self.seed = int(self.seed) % SEED_SPACE   # reads a negative seed so too; MLX refuses one)
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}   # (JSON: keys as text)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if not 0.0 < self.repeat_penalty <= REPEAT_PENALTY_MAX:
            raise ValueError(f"repeat_penalty must be in (0, {REPEAT_PENALTY_MAX:g}] (1: off)")
        if self.repeat_last_n < -1:
            raise ValueError("repeat_last_n must be >= -1 (-1: the whole context; 0: off)")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError("typical_p must be in (0, 1] (1: off)")
        if not 0.0 <= self.top_n_sigma <= TOP_N_SIGMA_MAX:
            raise ValueError(f"top_n_sigma must be in [0, {TOP_N_SIGMA_MAX:g}] (0: off)")
        if not 0.0 <= self.xtc_probability <= 1.0:
            raise ValueError("xtc_probability must be in [0, 1] (0: off)")
        if not 0.0 <= self.xtc_threshold <= 0.5:
            raise ValueError("xtc_threshold must be in [0, 0.5]")
        if not 0.0 <= self.dynatemp_range <= DYNATEMP_MAX or not 0.0 <= self.dynatemp_exponent <= DYNATEMP_MAX:
            raise ValueError(f"dynatemp_range and dynatemp_exponent must be in [0, {DYNATEMP_MAX:g}]")
        if self.mirostat not in (0, 1, 2):
            raise ValueError("mirostat must be 0 (off), 1 or 2")
        if not 0.0 < self.mirostat_tau <= MIROSTAT_TAU_MAX or not 0.0 <= self.mirostat_eta <= 1.0:
            raise ValueError(f"mirostat_tau must be in (0, {MIROSTAT_TAU_MAX:g}] and mirostat_eta in [0, 1]")
        if self.adaptive_target > 1.0 or not 0.0 <= self.adaptive_decay <= ADAPTIVE_DECAY_MAX:
            raise ValueError(f"adaptive_target must be at most 1 (negative: off) and adaptive_decay in "
                             f"[0, {ADAPTIVE_DECAY_MAX:g}]")
        if not 0.0 <= self.dry_multiplier <= DRY_MULTIPLIER_MAX:
            raise ValueError(f"dry_multiplier must be in [0, {DRY_MULTIPLIER_MAX:g}] (0: off)")
        if not 1.0 <= self.dry_base <= DRY_BASE_MAX:
            raise ValueError(f"dry_base must be in [1, {DRY_BASE_MAX:g}]")
        if self.dry_allowed_length < 1:
            raise ValueError("dry_allowed_length must be >= 1")
        if self.dry_penalty_last_n < -1:
            raise ValueError("dry_penalty_last_n must be >= -1 (-1: the whole context; 0: off)")
        self.dry_breakers = [int(t) for t in self.dry_breakers or []]
        self.context = [int(t) for t in self.context or []]
        lo, hi = LOGIT_BIAS_RANGE
        for k, v in self.logit_bias.items():
            if k < 0 or not lo <= v <= hi:
                raise ValueError(f"logit_bias: ids must be >= 0 and biases in [{lo:g}, {hi:g}] (id {k}: {v:g})")

    def portable(self) -> dict:
        """The plain fields, as JSON can carry them to another rank (no constraint, no recorder:
        those stay with the rank that samples)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("constraint", "logprobs", "prompt_logprobs")}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the presence or frequency penalty is on: before each sample, logit[id] -=
        presence * (count[id] > 0) + frequency * count[id], count being how many times this reply
        has sampled the id (its prompt does not count), as OpenAI and vLLM define them; or, with
        `windowed_penalties` (llama.cpp's and Ollama's definition), how many times the id is among
        the repetition penalty's window (the context's last `repeat_last_n` tokens, the prompt's and
        the reply's alike; a window of 0 turns both off). After the repetition penalty, before
        temperature and the cut-offs, greedy rows included."""
        on = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        return on and not (self.windowed_penalties and self.repeat_last_n == 0)

    @property
    def windowed(self) -> bool:
        """Whether the sampler keeps the window of the context's last `repeat_last_n` tokens: the
        repetition penalty, or presence and frequency counted over it (`windowed_penalties`)."""
        return self.repeating or (self.penalized and self.windowed_penalties)

    @property
    def repeating(self) -> bool:
        """Whether the repetition penalty is on: before each sample, each id among the window's (the
        context's last `repeat_last_n` tokens, the reply's so far included) has its logit divided by
        repeat_penalty where it is positive, multiplied where not, as llama.cpp, mlx-lm and
        transformers define it; after logit_bias, before the other penalties and the cut-offs."""
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0

    @property
    def dynamic_temperature(self) -> bool:
        """Whether a sampled reply's temperature moves with the entropy (llama.cpp's dynatemp):
        after the cut-offs, over the n ids left, T = lo + (hi - lo) x (H / ln n) ** exponent with
        lo = max(0, temperature - range), hi = temperature + range and H their entropy (nats);
        temperature then comes last on both backends, as in llama.cpp's chain."""
        return self.dynatemp_range > 0.0 and not self.greedy and not self.mirostat

    @property
    def mirostatted(self) -> bool:
        """Whether a sampled reply draws with Mirostat (llama.cpp's and Ollama's): after temperature,
        the ids more surprising than mu (version 2), or past a top-k estimated from the
        distribution's Zipf exponent and mu (version 1), are cut, one is drawn, and mu moves by
        eta x (its surprise - tau); mu starts at 2 tau. As in llama.cpp it replaces top-k, top-p,
        min-p, typical, top-n-sigma and XTC; logit_bias, the penalties and DRY still come first."""
        return self.mirostat != 0 and not self.greedy

    @property
    def adaptive(self) -> bool:
        """Whether a sampled reply draws with adaptive-p (llama.cpp's, last in its chain, in place of
        the plain draw): over the ids the cut-offs and temperature leave, each id's probability p
        becomes the logit PEAK - SHARPNESS x d^2 / (1 + d), d = |p - t| / WIDTH, and the draw is from
        their softmax; t = clamp(2 x target - the EMA of the drawn ids' p, 0, 1), the EMA (decay
        `adaptive_decay`) starting at the target. So the drawn ids' probability is steered towards
        the target. Mirostat, where on, takes its place (as in llama.cpp)."""
        return self.adaptive_target >= 0.0 and not self.greedy and not self.mirostat

    @property
    def dry(self) -> bool:
        """Whether DRY is on (localheap.dry has its definition): after the presence and frequency
        penalties, as in llama.cpp's default order. It reads each sampled token on the host."""
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    def with_context(self, fed, held: list[int]) -> "SamplingParams":
        """These params with `context` set from the session's fed tokens (a sequence with tolist,
        or a list) and the turn's tokens not fed yet: as far back as the longest window of the
        penalties that are on (none: the params themselves)."""
        windows = ([self.repeat_last_n] if self.windowed else []) + ([self.dry_penalty_last_n] if self.dry else [])
        if not windows:
            return self
        n = -1 if -1 in windows else max(windows)
        head = fed[max(0, len(fed) - n):] if n > 0 else fed
        tail = (head.tolist() if hasattr(head, "tolist") else list(head)) + [int(t) for t in held]
        return replace(self, context=tail if n < 0 else tail[max(0, len(tail) - n):])

    def window(self, last_n: int) -> list[int]:
        """The context's last `last_n` tokens (-1: all of it)."""
        return self.context if last_n < 0 else self.context[max(0, len(self.context) - last_n):]

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing between the logits and the argmax (a batch argmaxes such rows together)."""
        return self.greedy and self.constraint is None and not self.penalized and not self.logit_bias \
            and self.logprobs is None and not self.repeating and not self.dry


class StopMatcher:
    """Holds back text that could be the start of a stop sequence.

    feed(new_text) -> (text safe to emit, stopped?). On a stop, the text before the
    stop sequence is emitted and the rest dropped, as OpenAI does.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: Optional[str] = None   # the stop sequence that stopped the text (the first listed, on a tie)

    def feed(self, text: str) -> tuple[str, bool]:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            cut = min(i for i, _ in hits)
            self.matched = next(s for i, s in hits if i == cut)
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
