"""Embeddings: a text's vector, pooled from the model's last hidden states.

A backend's `prefill_pooled` feeds a prompt through a session's heap exactly as a prefill does
and hands each chunk's final hidden states (after the model's last norm, before the output
head), as a float32 sum and a last row, to a Pooler; `embed_rows` reads short inputs in one
padded forward. The server takes at most what a heap holds whole (server/embeddings.input_limit)
and reads a long input in a session of its own whose heap holds all of it (embedding_heap), so
nothing is evicted: the vector is the stock model's.
"""

from __future__ import annotations

import base64
from collections import deque
from typing import Optional

import numpy as np

from .heap import HeapConfig

POOLING = ("mean", "last")   # mean: every position's hidden state averaged; last: the last position's


class Pooler:
    """One input's running pool: the sum of its hidden states (float64 across chunks) and the
    last one. `vector()` once every chunk is in."""

    def __init__(self, mode: str = "mean"):
        if mode not in POOLING:
            raise ValueError(f"unknown pooling {mode!r}; choose one of {', '.join(POOLING)}")
        self.mode = mode
        self.count = 0
        self._sum: Optional[np.ndarray] = None
        self._last: Optional[np.ndarray] = None

    def add(self, total: np.ndarray, n: int, last: np.ndarray) -> None:
        """A chunk of `n` positions: `total` the sum of their hidden states, `last` the last one's."""
        total = np.asarray(total, dtype=np.float64).reshape(-1)
        self._sum = total if self._sum is None else self._sum + total
        self._last = np.asarray(last, dtype=np.float32).reshape(-1)
        self.count += int(n)

    def vector(self) -> np.ndarray:
        """The pooled vector, float32 (not normalized)."""
        if not self.count:
            raise ValueError("nothing was pooled (an empty input)")
        if self.mode == "last":
            return self._last.copy()
        return (self._sum / self.count).astype(np.float32)


def batches(lengths: list[int], tokens: int) -> tuple[list[list[int]], list[int]]:
    """How a request's inputs are read: (groups of indices, each group read in one padded forward
    of at most `tokens` tokens, padding included; the indices read alone, in prefill chunks
    through a heap). An input longer than half of `tokens` goes alone (a batch gains little there,
    and its heap bounds the memory); the short ones are grouped longest first, so a group pads
    to its first input's length."""
    short, alone = split(lengths, tokens)
    pending, groups = deque(short), []
    while pending:
        groups.append(take_group(pending, lengths, tokens))
    return groups, alone


def split(lengths: list[int], tokens: int) -> tuple[list[int], list[int]]:
    """(the short inputs, longest first: at most half of `tokens`; the others, in order)."""
    short = sorted((i for i, n in enumerate(lengths) if n <= tokens // 2), key=lambda i: (-lengths[i], i))
    return short, [i for i, n in enumerate(lengths) if n > tokens // 2]


def take_group(pending: deque, lengths: list[int], tokens: int) -> list[int]:
    """The next padded group off `pending` (indices, longest first): as many as fit `tokens`
    padded to the first one's length, and the first one whatever its length."""
    group: list[int] = []
    while pending and (not group or (len(group) + 1) * lengths[group[0]] <= tokens):
        group.append(pending.popleft())
    return group


def embedding_heap(cfg: HeapConfig, tokens: int) -> HeapConfig:
    """The heap an embedding of `tokens` tokens is read through: the session's settings with a
    budget just large enough that nothing is evicted (so no eviction policy, no scoring side pass,
    no recall), its buffers sized to the input rather than to a whole session's heap (a 16-token
    input on llama:1b allocated 300 MB of them)."""
    budget = min(cfg.budget, max(64, -(-max(tokens - cfg.sinks, 1) // 64) * 64))   # whole 64s: blocks reused
    return cfg.with_(budget=budget, recent=min(cfg.recent, budget), slack=1, profile="uniform", policy="streaming",
                     recall=False, prefill_chunk=min(cfg.chunk, tokens), disk_budget=0, recall_ram_tokens=0)


def finish(vector: np.ndarray, dimensions: Optional[int] = None, normalize: bool = True) -> np.ndarray:
    """The vector a client gets: its first `dimensions` components (OpenAI's shortening), then
    scaled to unit length (OpenAI's and Ollama's /api/embed vectors are unit length)."""
    v = np.asarray(vector, dtype=np.float32)
    if dimensions is not None:
        if not 1 <= dimensions <= v.shape[0]:
            raise ValueError(f"dimensions must be in [1, {v.shape[0]}] for this model (its hidden size)")
        v = v[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(v.astype(np.float64)))
        if norm > 0:
            v = (v / norm).astype(np.float32)
    return v


def as_base64(vector: np.ndarray) -> str:
    """OpenAI's encoding_format "base64": the float32 little-endian bytes, base64-encoded."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
