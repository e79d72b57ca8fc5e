"""Past one machine: the heap on mlx.distributed, under `mlx.launch`.

Every rank loads its shard with mlx-lm's own sharding (`Model.shard` for tensor parallelism,
`Model.model.pipeline` for pipeline stages) and keeps the heap of what it holds:

- tensor: every layer, its share of the KV heads (mlx-lm divides `n_kv_heads` by the group
  size); each head evicts on its own scores, as it does in one process;
- pipeline: its stage's layers, with the budgets `--profile` gives those layers in the whole
  model (rank 0 runs the last layers, as in mlx-lm).

Eviction events need no message: every heap layer repacks when its own resident count and
budget say so, and both follow from the tokens fed, which every rank feeds alike. What the
ranks must agree on goes through collectives (`Ranks`): the logits a token is sampled from
(rank 0's, broadcast) and the sampling seed; whether a turn recalls; the recall tier's span
vote (every rank's layers and heads, summed), the last position it votes over and how many
tokens each layer takes back, so every rank recalls the same windows and a layer's heads
stay the same length on every rank. Rank 0 prints; the others follow.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...heap import HeapConfig, HeapConfigError
from .backend import MLXBackend
from .cache import HeapKVCache
from .generate import generate_tokens
from .heapcache import attention_module, kv_geometry, make_heap_cache
from .persist import load_heap, read_layout, write_layout

MODES = ("tensor", "pipeline")


class DistributedError(ValueError):
    """The ranks cannot run this model this way; the message says why and what to do."""


class Ranks:
    """What the ranks agree on, through mlx.distributed collectives (paging.OneProcess's
    interface). Every rank must make the same calls in the same order."""

    def __init__(self, group, split_heads: bool):
        self.group = group
        self.split_heads = split_heads   # tensor sharding: every rank holds every layer, some heads
        self.rank = group.rank()
        self.size = group.size()

    def _gather(self, host: np.ndarray) -> np.ndarray:
        """[size, *host.shape]: every rank's array, bit for bit (sent as bytes)."""
        raw = np.ascontiguousarray(host)
        flat = mx.array(np.frombuffer(raw.tobytes(), np.uint8))
        out = np.array(mx.distributed.all_gather(flat, group=self.group, stream=mx.cpu))
        return out.reshape(self.size, -1).view(raw.dtype).reshape(self.size, *raw.shape)

    def any(self, flag: bool) -> bool:
        return bool(self._gather(np.array([flag], np.int8)).any())

    def all(self, flag: bool) -> bool:
        return bool(self._gather(np.array([flag], np.int8)).all())

    def each(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order."""
        return [int(v) for v in self._gather(np.array([n], np.int64)).ravel()]

    def notes(self, note: str, width: int = 160) -> list[str]:
        """Every rank's short text (utf-8, cut to `width` bytes), in rank order."""
        raw = np.zeros(width, np.uint8)
        b = note.encode()[:width]
        raw[: len(b)] = np.frombuffer(b, np.uint8)
        return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in self._gather(raw)]

    def max(self, n: int) -> int:
        return int(self._gather(np.array([n], np.int64)).max())

    def layer_min(self, n: int) -> int:
        """The least `n` over the ranks holding the same layer's other heads (tensor); under
        pipeline sharding a layer lives on one rank whole: its own `n` (no collective)."""
        if not self.split_heads:
            return n
        return int(self._gather(np.array([n], np.int64)).min())

    def sum(self, x: np.ndarray) -> np.ndarray:
        """The ranks' arrays summed in rank order: the same bits on every rank."""
        parts = self._gather(x)
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        return total

    def from_first(self, x: mx.array) -> mx.array:
        """Rank 0's `x` on every rank (lazy: an all_sum of rank 0's values and zeros). The zeros
        depend on `x`, so the all_sum comes after the same collectives on every rank: in one graph
        MLX runs them in dependency order, and ranks whose orders differed would cross them."""
        return mx.distributed.all_sum(mx.where(mx.array(self.rank == 0), x, 0), group=self.group)


class ShardedModel:
    """An mlx-lm model's shard whose next-token logits are rank 0's on every rank.

    Attributes pass through to the model (layers, args, make_cache). A recall probe evaluates
    only its queries; across ranks every rank must run the same collectives, so while a probe
    captures, its queries are made to depend on the broadcast logits (a pipeline stage's send
    and the ranks' all_sums then run on every rank)."""

    def __init__(self, model, ranks: Ranks):
        self.model = model
        self.ranks = ranks

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache=None, **kwargs):
        logits = self.model(inputs, cache=cache, **kwargs)
        last = self.ranks.from_first(logits[:, -1:, :])
        for c in cache or ():
            if isinstance(c, HeapKVCache) and c.capture:
                c.capture[-1] = mx.depends(c.capture[-1], last)
        return mx.concatenate([logits[:, :-1, :], last], axis=1)


def require_ranks(group) -> None:
    if group.size() < 2:
        raise DistributedError("--distributed needs two or more ranks: start it with `mlx.launch -n 2 "
                               "--backend ring localheap ...` (or `--hostfile hosts.json` across machines)")


def shard(model, mode: str, group) -> None:
    """Shard `model` in place with mlx-lm's own methods, after checking it can be."""
    n = group.size()
    if mode == "tensor":
        if not hasattr(model, "shard"):
            raise DistributedError(f"mlx-lm has no tensor sharding for {type(model).__module__}")
        attn = attention_module(model.layers[0])
        heads = getattr(attn, "n_heads", None) or getattr(attn, "num_attention_heads", None)
        n_kv, _ = kv_geometry(attn)
        if heads is None or heads % n or n_kv % n:
            raise DistributedError(f"tensor sharding splits the heads across {n} ranks: this model has {heads} "
                                   f"query and {n_kv} KV heads; use a rank count that divides both")
        model.shard(group)
    elif mode == "pipeline":
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise DistributedError(f"mlx-lm has no pipeline sharding for {type(model).__module__} "
                                   f"(it has it for qwen2, qwen3_moe, deepseek and others); use --distributed tensor")
        if len(inner.layers) < n:
            raise DistributedError(f"{len(inner.layers)} layers cannot be split into {n} pipeline stages")
        inner.pipeline(group)
    else:
        raise DistributedError(f"unknown --distributed mode {mode!r}; expected one of {', '.join(MODES)}")


class DistributedMLXBackend(MLXBackend):
    """MLXBackend over one rank's shard; every rank runs the same calls (rank 0 prints)."""

    step_rows = None   # no decode batch: the ranks' protocol carries one session's step at a time
    prefill_scored = None   # nor prompt logprobs (an echo's): the server refuses them
    prefill_pooled = embed_rows = None   # nor embeddings (a rank holds some layers' hidden states only)

    def __init__(self, model, tokenizer, model_name: str, mode: str, ranks: Ranks, first_layer: int,
                 total_layers: int):
        super().__init__(ShardedModel(model, ranks), tokenizer, model_name)
        self.mode = mode
        self.ranks = ranks
        self.first_layer = first_layer      # this stage's first layer in the whole model (pipeline)
        self.total_layers = total_layers

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @classmethod
    def load(cls, path: str | Path, mode: str, model_name: Optional[str] = None) -> "DistributedMLXBackend":
        from mlx_lm.utils import load_model, load_tokenizer

        from .loading import evaluate, model_classes

        group = mx.distributed.init()
        require_ranks(group)
        model, config = load_model(Path(path), lazy=True, strict=False, get_model_classes=model_classes)
        total = len(model.layers)
        shard(model, mode, group)
        evaluate(model)
        tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id", None))
        first = getattr(model.model, "start_idx", 0) if mode == "pipeline" else 0
        ranks = Ranks(group, split_heads=mode == "tensor")
        ranks.sum(np.zeros(1))   # every rank loaded before anyone goes on (mlx-lm does the same)
        return cls(model, tokenizer, model_name or Path(str(path)).name, mode, ranks, first, total)

    def new_cache(self, cfg: HeapConfig, pages_dir: Optional[Path] = None):
        if cfg.noise > 0:
            raise HeapConfigError("--distributed does not support score noise (its draws are per process)")
        cache = make_heap_cache(self.model, cfg, rank_dir(pages_dir, self.rank), self.budgets(cfg))
        cache.ranks = self.ranks
        return cache

    def budgets(self, cfg: HeapConfig) -> list[int]:
        """This rank's layers' budgets: their share of the whole model's --profile."""
        return cfg.layer_budgets(self.total_layers)[self.first_layer: self.first_layer + len(self.model.layers)]

    def generate(self, cache, new_tokens, params, progress=None, cancelled=None):
        """The same steps on every rank; a sampling seed drawn on rank 0 unless one is given, so
        every rank samples alike from the broadcast logits."""
        if params.seed is None:
            params = replace(params, seed=self.ranks.max(int.from_bytes(os.urandom(4), "little")
                                                         if self.rank == 0 else 0))
        tokens = generate_tokens(self.model, cache, new_tokens, params, progress, cancelled, share=self.ranks.from_first)
        return lost_rank_errors(tokens)

    writes_own_files = True   # save_cache writes `path` atomically itself (no temp name to rename)

    def save_cache(self, cache, path: Path, snapshot: bool = False) -> None:
        """Every rank writes its own shard of the heap (and of the pages, beside it) next to `path`;
        once every rank has, rank 0 writes `path` itself: the layout, which marks the save whole.
        A rank that could not write fails the save on every rank."""
        error = None
        try:
            mine = shard_path(path, self.mode, self.rank, self.ranks.size)
            super().save_cache(cache, mine, snapshot)
            os.chmod(mine, 0o600)   # saved sessions decode to conversation text
        except Exception as e:   # the others must hear of it before anyone goes on
            error = e
        if not self.ranks.all(error is None):
            raise error or DistributedError(f"another rank could not save its shard of {path}")
        # once more before the layout marks the save whole: a peer that died inside the agreement can
        # leave MLX's ring handing back a buffer, not an error; a collective after it raises
        self.ranks.all(True)
        if self.rank == 0:
            write_layout(path, {"mode": self.mode, "ranks": self.ranks.size})

    def load_cache(self, cfg: HeapConfig, path: Path, pages_dir: Optional[Path] = None):
        """This rank's shard of a heap saved by save_cache with the same layout; any other
        layout (another mode or rank count, or one process) is refused, on every rank."""
        mine = shard_path(path, self.mode, self.rank, self.ranks.size)
        if not self.ranks.all(mine.exists()):
            found = ", ".join(saved_layouts(path)) or "nothing"
            raise DistributedError(f"{path} was saved as {found}; this run is {self.mode} on {self.ranks.size} "
                                   f"ranks: restore it with the layout it was saved with")
        cache = load_heap(self.model, mine, rank_dir(pages_dir, self.rank), self.budgets(cfg))
        cache.ranks = self.ranks
        return cache


def lost_rank_errors(tokens):
    """`tokens`, with MLX's ring errors (a rank died or its link went down) said as such."""
    try:
        yield from tokens
    except RuntimeError as e:
        if "[ring]" not in str(e):
            raise
        raise DistributedError(f"another rank was lost ({e}); the generation stopped: restart every rank "
                               f"with mlx.launch") from e


def shard_path(path: Path, mode: str, rank: int, size: int) -> Path:
    """Where a rank keeps its shard of a heap saved to `path`: beside it, the layout in the name
    (`s.safetensors` -> `s.tensor-rank0of2.safetensors`; its page store beside that)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{mode}-rank{rank}of{size}{path.suffix}")


def saved_layouts(path: Path) -> list[str]:
    """The layouts a heap saved to `path` exists in: "one process" and/or "MODE on N ranks"."""
    path = Path(path)
    try:
        layout = read_layout(path) if path.exists() else None
    except Exception:   # noqa: BLE001 - not a heap file at all: the message names what is there
        layout = None
    found = {"one process"} if path.exists() and layout is None else set()
    if layout is not None:
        found.add(f"{layout['mode']} on {layout['ranks']} ranks")
    for shard in path.parent.glob(f"{path.stem}.*-rank*of*{path.suffix}"):
        mode, _, of = shard.name[len(path.stem) + 1: -len(path.suffix) or None].partition("-rank")
        found.add(f"{mode} on {of.partition('of')[2]} ranks")
    return sorted(found)


def rank_dir(pages_dir: Optional[Path], rank: int) -> Optional[Path]:
    """Each rank's own page store under a session's `pages_dir`."""
    return None if pages_dir is None else Path(pages_dir) / f"rank{rank}"


def load_backend(spec: Optional[str], mode: str) -> DistributedMLXBackend:
    from ...models import resolve_model

    path, name = resolve_model(spec)
    return DistributedMLXBackend.load(path, mode, model_name=name)


def run_speed(backend: DistributedMLXBackend, contexts: list[int], cfg: HeapConfig, decode_tokens: int,
              paths=("stock-full", "heap"), log=None, repeats: int = 1, model_dir: Optional[Path] = None) -> list[dict]:
    """`bench speed --distributed`: every path on the shards ("tensor:heap"...), and on rank 0 the
    same paths in one process over the whole model (loaded from `model_dir`; the other ranks wait),
    interleaved per repeat; the best of `repeats` per cell, the one-process rows first. Rows on
    rank 0 only. On one machine the ranks share its cores: the shard rows show the cost of the
    collectives, not a speed-up (that needs several hosts)."""
    from .bench import random_prompt, time_path

    single = MLXBackend.load(model_dir) if backend.rank == 0 else None
    rows = []
    for ctx in contexts:
        prompt = random_prompt(backend.vocab_size, ctx, seed=ctx)
        time_path(backend, "heap", prompt[: min(ctx, 256)], 4, cfg)   # warm-up compile/alloc
        best: dict[str, dict] = {}
        for _ in range(repeats):
            for who, path in [(w, p) for w in ("one", "shards") for p in paths]:
                name = path if who == "one" else f"{backend.mode}:{path}"
                if who == "one" and single is None:
                    continue
                if log and backend.rank == 0:
                    log(f"context {ctx:,}: {name} ...")
                r = {**time_path(single if who == "one" else backend, path, prompt, decode_tokens, cfg), "path": name}
                old = best.get(name)
                if old is None or (r["decode_tok_s"] or 0) > (old["decode_tok_s"] or 0):
                    best[name] = {**r, "prefill_tok_s": max(r["prefill_tok_s"], old["prefill_tok_s"] if old else 0)}
            backend.ranks.sum(np.zeros(1))   # the shards wait while rank 0 times one process
        rows += best.values()
    return rows if backend.rank == 0 else []
