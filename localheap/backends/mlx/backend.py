"""MLXBackend: an mlx-lm model plus its tokenizer, serving heaps to the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ...generation import LogprobRecorder, ProgressFn, SamplingParams
from ...heap import HeapConfig, kv_bytes_per_token
from .. import paging
from ..base import HeapCacheCalls, ModelShapes
from . import batch
from .generate import embed_rows, generate_tokens, prefill, prefill_pooled, prefill_scored
from .heapcache import HeapPromptCache, attention_module, check_heap, kv_geometry, make_heap_cache
from .persist import load_heap, save_heap


def default_prefill_chunk() -> int:
    """Tokens per prefill forward when --prefill-chunk is not given. Metal: 2048, mlx-lm's own
    prefill_step_size (larger chunks amortize each eviction event and fill the GPU); the CPU
    backend: 512 (measured, README)."""
    return 2048 if mx.metal.is_available() else 512


class MLXBackend(HeapCacheCalls):
    name = "mlx"

    def __init__(self, model, tokenizer, model_name: str = "model"):
        self.model = model
        self.tokenizer = tokenizer   # mlx-lm TokenizerWrapper (HF tokenizer underneath)
        self.model_name = model_name
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        self.vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)   # ids a prompt may use
        self.slabs: dict = {}          # the decode batch's heap buffers, by slab key (slab.py)
        self.batch_slabs = True        # False: every row of a batch attends on its own (per-heap sdpa)
        self.batch_ahead = True        # a session decoding alone in the batch has its next step queued (batch._run_ahead)
        self.recall_picker = None      # a decode row's recall picks here while the batch steps (paging.new_picker)
        self.computes_on_cpu = mx.default_device().type == mx.cpu   # the engine runs page-outs between steps
        self.compile_decode = False   # decode steps with their per-token parts mx.compile'd (compiled.py)

    @classmethod
    def load(cls, path: str | Path, model_name: Optional[str] = None) -> "MLXBackend":
        from .loading import load
        model, tokenizer = load(path)
        return cls(model, tokenizer, model_name or Path(str(path)).name)

    def default_prefill_chunk(self) -> int:
        """The CLI's --prefill-chunk when not given (a HeapConfig without one prefills by the slack)."""
        return default_prefill_chunk()

    def check_heap(self, cfg: HeapConfig) -> None:
        """Raise now what new_cache would refuse under cfg (the model's RoPE, its layer kinds)."""
        check_heap(self.model, cfg)

    def new_cache(self, cfg: HeapConfig, pages_dir: Optional[Path] = None) -> HeapPromptCache:
        """A fresh heap; with recall on its page store lives in `pages_dir` (default: a temp dir)."""
        cache = make_heap_cache(self.model, cfg, pages_dir)
        cache.compile_decode = self.compile_decode
        return cache

    def prefill(self, cache, tokens: Sequence[int], progress: Optional[ProgressFn] = None,
                cancelled: Optional[Callable[[], bool]] = None) -> None:
        prefill(self.model, cache, tokens, cache.cfg.chunk, progress, cancelled)

    def prefill_scored(self, cache, tokens: Sequence[int], following: int, recorder: LogprobRecorder) -> None:
        """Feed `tokens` as prefill does; each one's next token's logprob goes to `recorder`
        (generate.prefill_scored: the prompt logprobs of an echo)."""
        prefill_scored(self.model, cache, tokens, following, cache.cfg.chunk, self.vocab_size or 1 << 17, recorder)

    def prefill_pooled(self, cache, tokens: Sequence[int], pool) -> None:
        """Feed `tokens` as prefill does; their last hidden states go to `pool` (an embedding)."""
        prefill_pooled(self.model, cache, tokens, cache.cfg.chunk, pool)

    def embed_rows(self, rows: Sequence[Sequence[int]]) -> list[tuple]:
        """Short inputs in one padded forward, no heap (generate.embed_rows: embeddings in a batch)."""
        return embed_rows(self.model, rows)

    def generate(self, cache, new_tokens: Sequence[int], params: SamplingParams,
                 progress: Optional[ProgressFn] = None,
                 cancelled: Optional[Callable[[], bool]] = None) -> Iterator[int]:
        return generate_tokens(self.model, cache, new_tokens, params, progress, cancelled)

    # -- the decode batch (engine.py): one forward pass for every decoding session --
    def batchable(self, cache) -> bool:
        return batch.batchable(cache)

    def start_row(self, cache, new_tokens: Sequence[int], params: SamplingParams,
                  progress: Optional[ProgressFn] = None, cancelled: Optional[Callable[[], bool]] = None,
                  defer: bool = False) -> batch.DecodeRow:
        """A row for `step_rows`: a turn's last prompt tokens fed and its first token sampled, now
        or (`defer`) in the row's first step."""
        return batch.start_row(self.model, cache, new_tokens, params, progress, cancelled, defer)

    def step_rows(self, rows: list, chunks=()) -> list:
        """Feed each row's token (and `chunks`: (cache, ids) of prefills) in one step; per row,
        then per chunk: None (advanced) or the error that stopped it alone."""
        if self.recall_picker is None:
            self.recall_picker = paging.new_picker()   # None: LOCALHEAP_RECALL_PICKER=step
        return batch.step_rows(self.model, rows, chunks, self.slabs if self.batch_slabs else None, self.recall_picker,
                               ahead=self.batch_ahead)

    def end_row(self, row: batch.DecodeRow) -> None:
        """The row's run ended (its last sampled token stays unfed, unless a step queued ahead fed
        it): a pick still running for it is waited for and dropped, and its heap leaves the batch."""
        batch.end_row(row)

    def _kv_layout(self) -> tuple[int, int, int]:
        layers = list(self.model.layers)
        n_kv, head_dim = kv_geometry(attention_module(layers[0]))
        return len(layers), n_kv, head_dim

    def kv_bytes_per_token(self) -> int:
        n_layers, n_kv, head_dim = self._kv_layout()
        dtype_bytes = next(v for _, v in tree_flatten(self.model.parameters())).dtype.size
        return kv_bytes_per_token(n_layers, n_kv, head_dim, dtype_bytes)

    def heap_bytes(self, cfg: HeapConfig) -> int:
        n_layers, n_kv, _ = self._kv_layout()
        slots = sum(cfg.layer_capacity(b) for b in cfg.layer_budgets(n_layers))
        per_slot = self.kv_bytes_per_token() // n_layers
        score_arrays = (cfg.policy == "h2o") + (cfg.policy == "snapkv") + cfg.h2o_normalize
        return slots * (per_slot + 4 * n_kv * score_arrays)

    def model_shapes(self) -> ModelShapes:
        """Shapes for the RAM plan. Off Metal, attention is the unfused formulation (attention.py's
        explicit path, or mlx's own CPU fallback): about two [H_q, chunk, T] score tensors live at
        once (measured 2.2x one, tests/test_activation_plan.py). On Metal, mlx's fused prefill
        kernel covers head_dim 64, 80 and 128 (not measured here); other sizes fall back like the
        CPU. A prefill chunk's logits are never evaluated; a step's are its last row."""
        args = self.model.args
        layers = list(self.model.layers)
        attn = attention_module(layers[0])
        n_kv, head_dim = kv_geometry(attn)
        fused = mx.metal.is_available() and head_dim in (64, 80, 128)
        floats = (v for _, v in tree_flatten(self.model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        intermediate = args.intermediate_size
        return ModelShapes(layers=len(layers), hidden=args.hidden_size,
                           intermediate=max(intermediate) if isinstance(intermediate, (list, tuple)) else intermediate,
                           q_heads=int(getattr(attn, "n_heads", None) or args.num_attention_heads), kv_heads=n_kv, head_dim=head_dim,
                           vocab=args.vocab_size, dtype_bytes=next(floats).dtype.size, score_copies=0 if fused else 2)

    def save_cache(self, cache, path: Path, snapshot: bool = False) -> None:
        save_heap(cache, path, snapshot)

    def load_cache(self, cfg: HeapConfig, path: Path, pages_dir: Optional[Path] = None):
        cache = load_heap(self.model, path, pages_dir)
        cache.compile_decode = self.compile_decode
        return cache

    def apply_limits(self, limits: dict) -> None:
        """Cap MLX's allocator from the RAM budget (the wired limit only exists on Metal)."""
        mx.set_memory_limit(int(limits["memory_limit"]))
        mx.set_cache_limit(int(limits["cache_limit"]))
        if mx.metal.is_available() and "wired_limit" in limits:
            try:
                mx.set_wired_limit(int(limits["wired_limit"]))
            except (ValueError, RuntimeError):   # above what the OS allows: keep the default
                pass

    def synchronize(self) -> None:
        """Wait for work in flight (a pipelined step after a generation stopped early)."""
        mx.synchronize()

    def memory(self) -> dict:
        return {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(), "cache": mx.get_cache_memory()}
