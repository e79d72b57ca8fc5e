"""What the engine needs from a backend. The engine knows nothing about tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

from ..generation import ProgressFn, SamplingParams
from ..heap import HeapConfig, HeapStats
from .paging import question_length


@dataclass(frozen=True)
class ModelShapes:
    """What the RAM plan needs to know about a loaded model and how its backend runs a prefill."""

    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int           # activations and KV (the compute dtype, not a quantized weight's)
    score_copies: int = 0      # [H_q, chunk, T] score tensors one layer's prefill attention holds at once
                               # (0: a fused kernel that never materializes them)
    full_logits: bool = False  # a prefill forward computes logits for every position, not only the last


class Backend(Protocol):
    name: str            # "mlx" | "torch"
    model_name: str
    tokenizer: Any       # Hugging Face tokenizer: encode/decode/apply_chat_template
    eos_token_ids: set[int]
    weights_bytes: int
    vocab_size: Optional[int]   # token ids are 0..vocab_size-1 (None: unknown, not checked)

    def check_heap(self, cfg: HeapConfig) -> None:
        """Raise now (HeapConfigError, UnsupportedRope) what new_cache would refuse under cfg,
        without allocating a heap: serve checks its settings before it takes requests."""
        ...

    def new_cache(self, cfg: HeapConfig, pages_dir: Optional[Path] = None) -> Any:
        """A fresh heap; with cfg.recall its page store lives in `pages_dir` (default: a temp dir)."""
        ...

    def generate(self, cache: Any, new_tokens: Sequence[int], params: SamplingParams,
                 progress: Optional[ProgressFn] = None,
                 cancelled: Optional[Callable[[], bool]] = None) -> Iterator[int]:
        """Feed new_tokens (>= 1) into cache, then yield sampled ids, feeding each
        yielded id before sampling the next (the last yielded id may be unfed)."""
        ...

    def prefill(self, cache: Any, tokens: Sequence[int], progress: Optional[ProgressFn] = None,
                cancelled: Optional[Callable[[], bool]] = None) -> None: ...

    def question_tokens(self, cache: Any, n: int) -> int:
        """How many of a turn's `n` new prompt tokens (>= 1 of them) the engine feeds in the turn's
        first step rather than as prefill: the question a recall probes with (1 without recall)."""
        ...

    def tokens_in_cache(self, cache: Any) -> int: ...

    def rollback_floor(self, cache: Any) -> int:
        """Fewest tokens `truncate` can roll the cache back to exactly (nothing evicted since)."""
        ...

    def rollback_mark(self, cache: Any) -> Optional[int]:
        """The one point below rollback_floor that `truncate` can still reach (where its latest reply
        began, cache.mark(): exactly, or by a rewind where the reply evicted; backends/slots.py), or None."""
        ...

    def truncate(self, cache: Any, tokens: int) -> None:
        """Forget every token after the first `tokens` (rollback_floor(cache) <= tokens, or
        tokens == rollback_mark(cache))."""
        ...

    def cuttable(self, cache: Any) -> bool:
        """Whether `cut` can take a span of tokens out of the cache (backends/slots.HeapRollback.cut);
        a backend without it (a sharded heap) never cuts."""
        ...

    def cut(self, cache: Any, spans: list) -> int:
        """Keep only the tokens in `spans` ([start, stop) pairs, the first from 0), joined end to
        end; returns the tokens the cache holds then."""
        ...

    def stats(self, cache: Any) -> HeapStats: ...

    def kv_bytes_per_token(self) -> int: ...

    def heap_bytes(self, cfg: HeapConfig) -> int:
        """Bytes one session's heap allocates (all layers, K and V, plus score arrays)."""
        ...

    def model_shapes(self) -> ModelShapes:
        """The model's shapes and the prefill path's materialized tensors (governor/activations.py)."""
        ...

    def save_cache(self, cache: Any, path: Path, snapshot: bool = False) -> None:
        """Save the heap to `path` atomically; a `snapshot` (a checkpoint to fork from) also gets
        its own view of the page store, unchanged by the session's later writes."""
        ...

    def load_cache(self, cfg: HeapConfig, path: Path, pages_dir: Optional[Path] = None) -> Any:
        """A heap saved by save_cache; with recall on and `pages_dir` (a fork's), its page store
        is a copy made there."""
        ...

    def synchronize(self) -> None:
        """Block until queued device work is done (after a generation stopped early)."""
        ...

    def memory(self) -> dict:
        """Allocator figures in bytes: active, peak, cache (whatever the backend knows)."""
        ...


class HeapCacheCalls:
    """The Backend methods both backends answer from their heap cache alone (its own methods of the
    same names): a backend class takes them by inheriting this."""

    def question_tokens(self, cache: Any, n: int) -> int:
        """How many of a turn's `n` new prompt tokens the engine holds back for the turn's first
        step (start_row, generate): the question a recall probes with, as `generate` on the whole
        turn would (paging.question_length)."""
        return question_length(cache, n)

    def tokens_in_cache(self, cache: Any) -> int:
        return cache.tokens_seen

    def rollback_floor(self, cache: Any) -> int:
        return cache.rollback_floor()

    def rollback_mark(self, cache: Any) -> Optional[int]:
        return cache.rollback_mark()

    def truncate(self, cache: Any, tokens: int) -> None:
        cache.truncate(tokens)

    def cuttable(self, cache: Any) -> bool:
        return cache.cuttable()

    def cut(self, cache: Any, spans: list) -> int:
        return cache.cut(spans)

    def stats(self, cache: Any) -> HeapStats:
        return cache.stats()
