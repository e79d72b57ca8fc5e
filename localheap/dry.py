"""DRY ("don't repeat yourself"), the repetition sampler of text-generation-webui, koboldcpp and
llama.cpp: a token that would continue a sequence already seen in the window is penalized by how
long the repeat would become. Backend-agnostic: the window is ids on the host, the penalties a
few (id, amount) pairs that each backend takes off its logits.

Definition (SamplingParams.dry): let the window be the context's last `dry_penalty_last_n`
tokens (-1: all) with the reply's so far. For each earlier place the window's last token occurs,
the match is the longest run ending there that equals the window's end, its tokens no sequence
breakers; the token that followed it (itself no breaker) would make the repeat one longer. Each
such token gets multiplier * base ** (length - allowed_length) off its logit where its longest
match is at least allowed_length. Matches are counted up to MAX_MATCH tokens: past that the
penalty is beyond any logit at llama.cpp's default base (1.75).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional, Sequence

import numpy as np

MAX_MATCH = 64
DEFAULT_BREAKERS = ("\n", ":", "\"", "*")   # llama.cpp's dry_sequence_breakers


class DryState:
    """One reply's DRY window: `penalties()` for the next token, `push(token)` after it."""

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int,
                 breakers: Sequence[int], context: Sequence[int], reserve: int = 256):
        self.multiplier, self.base, self.allowed, self.last_n = multiplier, base, allowed_length, last_n
        self.breakers = frozenset(int(t) for t in breakers)
        context = np.asarray(context, dtype=np.int64)
        if last_n > 0:
            context = context[-last_n:]
        self.ids = np.empty(len(context) + reserve, np.int64)     # the window's ids, grown as the reply goes
        self.brk = np.empty(len(context) + reserve, bool)         # whether each is a breaker
        self.n = len(context)
        self.ids[: self.n] = context
        self.brk[: self.n] = np.isin(context, np.fromiter(self.breakers, np.int64, len(self.breakers)))

    def push(self, token: int) -> None:
        if self.n == len(self.ids):
            keep = min(self.last_n, self.n) if self.last_n > 0 else self.n
            grown = 2 * keep + 256
            ids, brk = np.empty(grown, np.int64), np.empty(grown, bool)
            ids[:keep], brk[:keep] = self.ids[self.n - keep: self.n], self.brk[self.n - keep: self.n]
            self.ids, self.brk, self.n = ids, brk, keep
        self.ids[self.n], self.brk[self.n] = int(token), int(token) in self.breakers
        self.n += 1

    def penalties(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, amounts float32) to take off the next token's logits; both empty for none."""
        none = np.zeros(0, np.int64), np.zeros(0, np.float32)
        start = max(0, self.n - self.last_n) if self.last_n > 0 else 0
        w, brk = self.ids[start: self.n], self.brk[start: self.n]
        n = len(w)
        if n < 2 or brk[-1]:
            return none
        cand = np.nonzero(w[:-1] == w[-1])[0]
        cand = cand[~brk[cand + 1]]                 # the token after the match: no breaker
        if not cand.size:
            return none
        length = np.ones(cand.size, np.int64)
        active = np.arange(cand.size)
        for k in range(1, MAX_MATCH):               # extend every match one token further back at once
            if n - 1 - k < 0 or brk[n - 1 - k] or not active.size:
                break
            pos = cand[active] - k
            ok = pos >= 0
            ok[ok] = w[pos[ok]] == w[n - 1 - k]
            active = active[ok]
            length[active] += 1
        keep = length >= self.allowed
        if not keep.any():
            return none
        following, length = w[cand[keep] + 1], length[keep]
        best: dict[int, int] = {}
        for t, m in zip(following.tolist(), length.tolist()):
            if m > best.get(t, 0):
                best[t] = m
        ids = np.fromiter(best, dtype=np.int64, count=len(best))
        lengths = np.fromiter(best.values(), dtype=np.float64, count=len(best))
        return ids, (self.multiplier * self.base ** (lengths - self.allowed)).astype(np.float32)


@lru_cache(maxsize=8)
def _breaker_table(tokenizer: Any, breakers: tuple[str, ...]) -> tuple[int, ...]:
    vocab = max(tokenizer.get_vocab().values()) + 1   # added tokens too (an MLX wrapper has no len)
    texts = tokenizer.batch_decode([[i] for i in range(vocab)]) if hasattr(tokenizer, "batch_decode") \
        else [tokenizer.decode([i]) for i in range(vocab)]
    return tuple(i for i, text in enumerate(texts) if any(b in text for b in breakers))


def breaker_ids(tokenizer: Any, breakers: Sequence[str]) -> list[int]:
    """The ids whose text holds one of the breaker strings (llama.cpp also breaks on tokens that
    only start or end one; here a token breaks where its own text has it); kept per tokenizer."""
    wanted = tuple(sorted(set(b for b in breakers if b)))
    if not wanted:
        return []
    return list(_breaker_table(tokenizer, wanted))


def dry_state(params: Any) -> Optional[DryState]:
    """The reply's DRY window from its SamplingParams (None where DRY is off)."""
    if not params.dry:
        return None
    return DryState(params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n,
                    params.dry_breakers, params.window(params.dry_penalty_last_n), reserve=params.max_tokens + 1)
