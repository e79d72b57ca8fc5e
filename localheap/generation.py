"""Backend-agnostic generation pieces: sampling settings, stop sequences, results.

Knows nothing about tensors or tokenizers' internals: text in, text out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

ProgressFn = Callable[[int, int], None]   # (tokens done, tokens total)
PENALTY_RANGE = (-2.0, 2.0)   # presence_penalty, frequency_penalty (OpenAI's range)
MIN_P_RANGE = (0.0, 1.0)


class Constraint(Protocol):
    """Limits which tokens a request may sample (a grammar, or a test's forced tokens). Each
    backend's Sampler asks `allowed()` before every sample and calls `advance` with the result.
    One object per request: it holds the request's position in the grammar."""

    def allowed(self) -> Optional[Any]:
        """A numpy bool array: True for the ids allowed next (ids past its end are not), or None for any."""

    def advance(self, token: int) -> None:
        """The token just sampled."""


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
    presence_penalty: float = 0.0   # OpenAI's: taken off the logit of each id this reply has written
    frequency_penalty: float = 0.0  # OpenAI's: times the number of times this reply has written the id

    def __post_init__(self) -> None:
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on what the reply has written (presence or frequency penalty):
        before each sample, logit[id] -= presence * (count[id] > 0) + frequency * count[id], count
        being how many times this reply has sampled the id (its prompt does not count), as OpenAI
        and vLLM define them; applied before temperature, top-k/p and min-p, greedy rows included."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class StopMatcher:
    """Holds back text that could be the start of a stop sequence.

    feed(new_text) -> (text safe to emit, stopped?). On a stop, the text before the
    stop sequence is emitted and the rest dropped, as OpenAI does.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            cut = min(i for i, _ in hits)
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
