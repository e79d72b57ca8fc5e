"""TorchBackend: a transformers model plus its tokenizer, serving heaps to the engine."""

from __future__ import annotations

import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from ...generation import LogprobRecorder, ProgressFn, SamplingParams
from ...heap import HeapConfig, kv_bytes_per_token
from ..base import HeapCacheCalls, ModelShapes
from .. import paging
from . import attention, batch
from .cache import HeapCache, check_heap, decoder_layers, kv_geometry, make_heap_cache
from .generate import embed_rows, generate_tokens, prefill, prefill_pooled, prefill_scored
from .persist import load_heap, save_heap

log = logging.getLogger("localheap.torch")


def _off_main_thread(fn: Callable, name: str):
    """fn() on a thread of its own, which then ends; its result, or its exception raised here.
    torch's intra-op regions (OpenMP) run ~10x slower on the engine's thread once the main
    thread has run one (measured: a packed graph 31 us on the main thread, 334 us on another
    after it; one served client 260-304 tok/s against 773-903 with the build off the main
    thread, eager 610-698). A thread that ends takes its pool with it."""
    import threading

    done: dict = {}

    def run() -> None:
        try:
            done["result"] = fn()
        except BaseException as e:   # noqa: BLE001 - raised on the caller's thread
            done["error"] = e

    worker = threading.Thread(target=run, name=name)
    worker.start()
    worker.join()
    if "error" in done:
        raise done["error"]
    return done.get("result")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU (exact, and fast enough for small models); bf16 where CUDA has it, else fp16."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def default_prefill_chunk(device: torch.device) -> int:
    """Tokens per prefill forward when --prefill-chunk is not given. Larger chunks amortize each
    eviction event and fill the device; the heap holds sinks + budget + chunk at the peak.
    CUDA: 2048 (snapkv at 32K on an H100 ran 1,060 tok/s at 256-token chunks and 9,204 at 4,096,
    issue 11; 2048 keeps the extra KV under ~0.3 GB for an 8B model). CPU: 512 (measured, README)."""
    return 2048 if device.type == "cuda" else 512


class TorchBackend(HeapCacheCalls):
    name = "torch"

    def __init__(self, model, tokenizer, model_name: str = "model", fused_decode: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer   # Hugging Face tokenizer
        self.model_name = model_name
        self.fused_decode = fused_decode   # decode outputs from the fused kernel: not bit-identical to stock
        self.compile_decode = False        # the lean decode step's per-token parts compiled (compiled.py)
        self.cuda_graphs = False           # the decode batch's slab steps as CUDA graphs (graphed.py)
        self.device = next(model.parameters()).device
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = set(eos)
        self.weights_bytes = sum(p.nbytes for p in model.parameters())
        self.vocab_size = model.get_input_embeddings().num_embeddings   # ids a prompt may use
        self.slabs: dict = {}          # the decode batch's heap buffers, by slab key (slab.py)
        self.batch_slabs = True        # False: every row of a batch attends on its own (per-heap sdpa)
        # a session decoding alone in the batch has its next step queued before its token is read
        # (batch._run_ahead), as the generator pipelines: on CUDA, where the host would idle the card
        self.batch_ahead = self.device.type == "cuda"
        self.recall_picker: Optional[ThreadPoolExecutor] = None   # see _picker
        # the engine may read a prompt chunk on a second thread beside the decode batch (engine/lane.py):
        # forward passes share no state but their caches; on CUDA both would queue on one stream (untested)
        self.concurrent_prefill = self.device.type == "cpu"
        # a finished turn's heap file may be written on another thread while the batch steps
        # (engine.Engine._finish: its session is busy and out of the batch meanwhile)
        self.saves_off_thread = True
        self.computes_on_cpu = self.device.type == "cpu"   # the engine runs page-outs between steps

    @classmethod
    def load(cls, path: str | Path, model_name: Optional[str] = None, device: Optional[str] = None,
             dtype: Optional[torch.dtype] = None, fused_decode: bool = False) -> "TorchBackend":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = torch.device(device) if device else default_device()
        attention.install(None)
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype or default_dtype(dev), attn_implementation=attention.load_implementation(path),
            output_loading_info=True,
        )
        missing = sorted(info.get("missing_keys") or ())
        if missing:   # (transformers fills them with random numbers and carries on)
            raise ValueError(f"the checkpoint lacks {len(missing)} of the model's weights (e.g. {missing[0]}): "
                             "is a shard missing, or config.json not this checkpoint's?")
        model = model.to(dev)
        try:
            decoder_layers(model)
        except AttributeError as e:
            raise ValueError(f"a {type(model).__name__} is not a decoder-only language model localheap can run "
                             f"(model_type {model.config.model_type!r})") from e
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, tokenizer, model_name or Path(str(path)).name, fused_decode=fused_decode)

    def prepare_compiled(self) -> bool:
        """--compile-decode for the engine's decode batch: build (or load) and check the packed
        step's graphs now, before the first request, rather than inside its first step. Whether
        the compiled packed step will run (False: a warning said why; the eager step runs)."""
        from .compiled import compiled_packed

        return _off_main_thread(lambda: compiled_packed(self.model), "localheap-compile") is not None

    def prepare_graphs(self) -> bool:
        """--cuda-graphs: check once that a replayed graph gives the eager static step's bits on
        this card (graphed.agrees, on a scratch slab, on a thread of its own as prepare_compiled
        does). Whether the decode batch's slab steps will run as graphs (False: a warning said why)."""
        from . import graphed

        if self.device.type != "cuda":
            log.warning("--cuda-graphs: the model is on %s, not a CUDA device; the decode batch stays eager",
                        self.device.type)
            return False
        try:
            ok = _off_main_thread(lambda: graphed.agrees(self.model), "localheap-graphs")
        except Exception as e:   # capture refused (an op that syncs, an unsupported kernel)
            log.warning("--cuda-graphs: capture failed (%r); the decode batch stays eager", e)
            return False
        if not ok:
            log.warning("--cuda-graphs: a replayed graph's logits differ from the same step run eagerly; "
                        "the decode batch stays eager")
            return False
        self.cuda_graphs = True
        return True

    def default_prefill_chunk(self) -> int:
        """The CLI's --prefill-chunk when not given (a HeapConfig without one prefills by the slack)."""
        return default_prefill_chunk(self.device)

    def check_heap(self, cfg: HeapConfig) -> None:
        """Raise now what new_cache would refuse under cfg (the model's RoPE, its layer kinds)."""
        check_heap(self.model, cfg)

    def new_cache(self, cfg: HeapConfig, pages_dir: Optional[Path] = None) -> HeapCache:
        """A fresh heap; with recall on its page store lives in `pages_dir` (default: a temp dir)."""
        cache = make_heap_cache(self.model, cfg, pages_dir)
        cache.fused_decode = self.fused_decode
        cache.compile_decode = self.compile_decode
        cache.cuda_graphs = self.cuda_graphs
        return cache

    def prefill(self, cache: HeapCache, tokens: Sequence[int], progress: Optional[ProgressFn] = None,
                cancelled: Optional[Callable[[], bool]] = None) -> None:
        prefill(self.model, cache, tokens, progress, cancelled)   # a document: no question to recall for

    def prefill_scored(self, cache: HeapCache, tokens: Sequence[int], following: int,
                       recorder: LogprobRecorder) -> None:
        """Feed `tokens` as prefill does; each one's next token's logprob goes to `recorder`
        (generate.prefill_scored: the prompt logprobs of an echo)."""
        prefill_scored(self.model, cache, tokens, following, recorder)

    def prefill_pooled(self, cache: HeapCache, tokens: Sequence[int], pool) -> None:
        """Feed `tokens` as prefill does; their last hidden states go to `pool` (an embedding)."""
        prefill_pooled(self.model, cache, tokens, pool)

    def embed_rows(self, rows: Sequence[Sequence[int]]) -> list[tuple]:
        """Short inputs in one padded forward, no heap (generate.embed_rows: embeddings in a batch)."""
        return embed_rows(self.model, rows, self.device)

    def generate(self, cache: HeapCache, new_tokens: Sequence[int], params: SamplingParams,
                 progress: Optional[ProgressFn] = None,
                 cancelled: Optional[Callable[[], bool]] = None) -> Iterator[int]:
        return generate_tokens(self.model, cache, new_tokens, params, progress, cancelled)

    # -- the decode batch (engine.py): one forward pass for every decoding session --
    def get_threads(self) -> int:
        """The calling thread's intra-op threads (the prefill lane splits them: engine/lane.py)."""
        return torch.get_num_threads()

    def set_threads(self, n: int) -> None:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def batchable(self, cache: HeapCache) -> bool:
        return batch.batchable(cache)

    def start_row(self, cache: HeapCache, new_tokens: Sequence[int], params: SamplingParams,
                  progress: Optional[ProgressFn] = None, cancelled: Optional[Callable[[], bool]] = None,
                  defer: bool = False) -> batch.DecodeRow:
        """A row for `step_rows`: a turn's last prompt tokens fed and its first token sampled, now
        or (`defer`) in the row's first step."""
        return batch.start_row(self.model, cache, new_tokens, params, progress, cancelled, defer)

    def step_rows(self, rows: list, chunks=()) -> list:
        """Feed each row's token (and `chunks`: (cache, ids) of prefills) in one forward; per row,
        then per chunk: None (advanced) or the error that stopped it alone."""
        return batch.step_rows(self.model, rows, chunks, self.slabs if self.batch_slabs else None, self._picker(),
                               ahead=self.batch_ahead)

    def _picker(self) -> Optional[ThreadPoolExecutor]:
        """paging.new_picker, started on first use (None: LOCALHEAP_RECALL_PICKER=step)."""
        if self.recall_picker is None:
            # one intra-op thread there (its own OpenMP team, beside the engine thread's): the page
            # scorer's parallel_for then runs serially while the batch keeps the cores
            self.recall_picker = paging.new_picker(initializer=lambda: torch.set_num_threads(1))
        return self.recall_picker

    def end_row(self, row: batch.DecodeRow) -> None:
        """The row's run ended (its last sampled token stays unfed, unless a step queued ahead fed
        it): its heap leaves the batch."""
        batch.leave_slab(row)

    def kv_bytes_per_token(self) -> int:
        n_kv, head_dim = kv_geometry(self.model)
        dtype_bytes = next(self.model.parameters()).element_size()
        return kv_bytes_per_token(self.model.config.get_text_config().num_hidden_layers, n_kv, head_dim, dtype_bytes)

    def heap_bytes(self, cfg: HeapConfig) -> int:
        """K/V and score buffers of the heap layers (sliding layers, if any, are not counted)."""
        from transformers.cache_utils import get_layer_types_and_kwargs

        n_kv, head_dim = kv_geometry(self.model)
        layer_types, _ = get_layer_types_and_kwargs(self.model.config.get_text_config())
        n_heap = sum(t == "full_attention" for t in layer_types)
        slots = sum(cfg.layer_capacity(b) for b in cfg.layer_budgets(n_heap))
        per_slot = 2 * n_kv * head_dim * next(self.model.parameters()).element_size()
        score_arrays = (cfg.policy == "h2o") + (cfg.policy == "snapkv") + (cfg.h2o_normalize and cfg.needs_attention)
        return slots * (per_slot + 4 * n_kv * score_arrays)

    def model_shapes(self) -> ModelShapes:
        """Shapes for the RAM plan. Prefill attention is torch's fused sdpa (flash on the CPU,
        flash / memory-efficient on CUDA): scores are never materialized whole (measured,
        tests/test_activation_plan.py); logits are computed for the last position only."""
        text = self.model.config.get_text_config()
        n_kv, head_dim = kv_geometry(self.model)
        q_heads = decoder_layers(self.model)[0].self_attn.o_proj.in_features // head_dim
        return ModelShapes(layers=text.num_hidden_layers, hidden=text.hidden_size,
                           intermediate=text.intermediate_size, q_heads=q_heads, kv_heads=n_kv, head_dim=head_dim,
                           vocab=self.model.get_input_embeddings().num_embeddings,
                           dtype_bytes=next(self.model.parameters()).element_size(), score_copies=0)

    def save_cache(self, cache: HeapCache, path: Path, snapshot: bool = False) -> None:
        save_heap(cache, path, snapshot)

    def ready_to_save(self, cache: HeapCache) -> None:
        """Before save_cache runs on another thread (the engine's saver): what it reads that is
        still to be computed is computed here, on the calling thread with its intra-op threads (a
        prefill chunk's window scores, left to be scored when read; the position tables of an
        event whose kept slots the device has not told yet), so that the saver only copies and
        writes and the session's scores are the bits they would have been."""
        for layer in cache.heap_layers:
            layer.window
            layer.heap.positions

    def load_cache(self, cfg: HeapConfig, path: Path, pages_dir: Optional[Path] = None) -> HeapCache:
        cache = load_heap(self.model, path, pages_dir)
        cache.fused_decode = self.fused_decode
        cache.compile_decode = self.compile_decode
        cache.cuda_graphs = self.cuda_graphs
        return cache

    def synchronize(self) -> None:
        """Wait for queued device work (a pipelined decode step after a generation stopped early)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def memory(self) -> dict:
        """CUDA: torch's allocator. CPU: the process's resident set (psutil) and its peak."""
        if self.device.type == "cuda":
            return {"active": torch.cuda.memory_allocated(self.device),
                    "peak": torch.cuda.max_memory_allocated(self.device),
                    "cache": torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)}
        import resource

        import psutil

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux, bytes on macOS
        peak *= 1 if sys.platform == "darwin" else 1024
        return {"active": psutil.Process().memory_info().rss, "peak": peak, "cache": 0}
