"""RAM budget arithmetic: sizes, and how many heaps fit next to the weights.

Pure integers. Knows nothing about tensors, sessions or HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str | int) -> int:
    """'12G', '512M', '1.5GiB', '4096' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"cannot read size {text!r}; use e.g. 12G, 512M or a number of bytes")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value)


class BudgetTooSmall(ValueError):
    """Not even one session's heap fits next to the weights and the runtime (user-facing)."""

    def __init__(self, need: int, have: int, advice: str, parts: str = ""):
        self.need, self.have, self.advice = need, have, advice
        parts = f" ({parts})" if parts else ""
        super().__init__(
            f"the RAM budget {fmt(have)} is too small: the model, one session's heap and the runtime "
            f"need {fmt(need)}{parts}. {advice}"
        )


def fmt(n: float) -> str:
    from ..heap.stats import format_bytes
    return format_bytes(n)


@dataclass(frozen=True)
class MemoryPlan:
    """What the budget buys: weights + runtime overhead + N resident heaps."""

    budget: int
    weights: int
    heap: int              # bytes of one session's heap (all layers)
    overhead: int          # runtime, activations, allocator slack, Python, requests in flight
    requests: int = 0      # of the overhead: room for requests' prompts (text, token ids)
    activations: int = 0   # of the overhead: the prefill activation peak (governor/activations.py)
    recall_base_tokens: int = 0   # recall on: tokens of pages `heap` includes the summaries of
    recall_token_bytes: int = 0   # ... and the RAM each token of pages past them costs (0: recall off)

    @property
    def free_for_heaps(self) -> int:
        return self.budget - self.weights - self.overhead

    @property
    def max_prompt_tokens(self) -> int:
        """Prompt tokens one request may hold: its share of the request room."""
        return max(1, self.requests // PROMPT_TOKEN_BYTES)

    @property
    def max_resident(self) -> int:
        return max(0, self.free_for_heaps // self.heap) if self.heap > 0 else 0

    def recall_extra(self, tokens: int) -> int:
        """RAM a recall session holding `tokens` tokens of pages takes beyond `heap`."""
        return max(0, tokens - self.recall_base_tokens) * self.recall_token_bytes

    @property
    def recall_max_tokens(self) -> int:
        """Tokens of pages one session may keep (0: recall off): the most whose summaries fit with
        that session alone resident. Past them it drops its lowest-value pages."""
        if not self.recall_token_bytes:
            return 0
        return self.recall_base_tokens + max(0, self.free_for_heaps - self.heap) // self.recall_token_bytes

    def check(self, heap_tokens: int, bytes_per_token: int, fits_budget: int | None = None) -> "MemoryPlan":
        """Raise BudgetTooSmall with what would fit, else return self. `fits_budget`: the largest
        --budget that fits, where the caller searched for it (else estimated from the room left)."""
        if self.max_resident >= 1:
            return self
        need = self.weights + self.overhead + self.heap
        room = self.free_for_heaps
        if fits_budget:
            chunk = (" (the prefill activations grow with --prefill-chunk x the heap's capacity: a smaller "
                     "--prefill-chunk shrinks them too)") if self.activations and need - self.activations <= self.budget else ""
            advice = (f"A heap of {fits_budget:,} tokens would fit (--budget {fits_budget}){chunk}; "
                      f"or raise --ram-budget to at least {fmt(need)}.")
        elif fits_budget is None and room > 0 and bytes_per_token > 0:
            fits = room // bytes_per_token
            advice = (f"A heap of about {max(0, fits - 300):,} tokens would fit (--budget); "
                      f"or raise --ram-budget to at least {fmt(need)}.")
        elif self.activations and need - self.activations <= self.budget:
            advice = (f"The prefill activations grow with --prefill-chunk x the heap's capacity: a smaller "
                      f"--prefill-chunk or --budget shrinks them; or raise --ram-budget to at least {fmt(need)}.")
        else:
            advice = (f"The weights alone ({fmt(self.weights)}) plus runtime ({fmt(self.overhead)}) exceed it: "
                      f"use a smaller or more quantized model, or raise --ram-budget above {fmt(need)}.")
        parts = (f"weights {fmt(self.weights)} + heap {fmt(self.heap)} + runtime {fmt(self.overhead)}, "
                 f"of which prefill activations {fmt(self.activations)}")
        raise BudgetTooSmall(need=need, have=self.budget, advice=advice, parts=parts)


# What a prompt token costs the server while a request holds it: the id in a Python list (8 B
# pointer + 32 B int) and its slices, plus the text's copies (body, JSON, template renders).
# Tokenizing costs ~530 B a token more, but only a piece at a time (server/tokens.py).
PROMPT_TOKEN_BYTES = 128
MIN_REQUEST_ROOM = 128 * 1024**2    # 1M prompt tokens: a long document still fits a small budget
MAX_REQUEST_ROOM = 1024**3


def request_room(budget: int) -> int:
    """Bytes of the budget kept for requests in flight: 1/16, within [128 MiB, 1 GiB]."""
    return min(MAX_REQUEST_ROOM, max(MIN_REQUEST_ROOM, budget // 16))
