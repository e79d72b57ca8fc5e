"""The cases tests/test_mlx_distributed.py runs on 2 ranks and in one process, and the rank
program itself: `mlx.launch -n 2 --backend ring python distributed_cases.py MODEL MODE OUT.json
[die]` runs every case on this rank's shard (each rank saves its shard of a session in OUT's
directory and restores it); rank 0 writes the tokens as JSON. With `die`,
rank 1 exits in the middle of the first generation (a killed rank)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from localheap.heap import HeapConfig

CASES = {
    # no eviction: the sharded heap must be the sharded model's own mlx-lm cache
    "full": (HeapConfig(budget=512, sinks=4, recent=16, slack=32, prefill_chunk=64), 100, 12),
    # prefill and decode evict (each layer, each head on its own scores)
    "evict": (HeapConfig(budget=48, sinks=4, recent=8, slack=16, prefill_chunk=32), 150, 24),
    "evict_h2o_pyramid": (HeapConfig(budget=48, sinks=4, recent=8, slack=16, prefill_chunk=32, policy="h2o",
                                     profile="pyramid"), 150, 24),
    # the recall tier: pages out, a span vote over every rank's layers and heads, the same windows back
    "recall": (HeapConfig(budget=96, sinks=4, recent=16, slack=32, policy="snapkv", recall=True,
                          recall_budget=32, page_size=8, page_format="f32", obs_window=8, prefill_chunk=32), 300, 8),
}


def prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def run_case(backend, name: str) -> list[int]:
    from localheap.generation import SamplingParams

    cfg, n, max_tokens = CASES[name]
    cache = backend.new_cache(cfg)
    tokens = prompt(backend.vocab_size, n)
    return list(backend.generate(cache, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0)))


def session_case(backend, where: Path) -> dict:
    """The recall case saved after its first turn and restored: the next turn's tokens from the
    restored heap and from the one that never left memory."""
    from localheap.generation import SamplingParams

    cfg, n, max_tokens = CASES["recall"]
    cache = backend.new_cache(cfg)
    first = list(backend.generate(cache, prompt(backend.vocab_size, n), SamplingParams(max_tokens=max_tokens)))
    backend.save_cache(cache, where / "session.safetensors")
    restored = backend.load_cache(cfg, where / "session.safetensors")
    turn = [first[-1], *prompt(backend.vocab_size, 40, seed=1)]
    return {name: list(backend.generate(c, turn, SamplingParams(max_tokens=max_tokens)))
            for name, c in (("continued", cache), ("restored", restored))}


def stock_tokens(model, vocab: int) -> list[int]:
    """mlx-lm's own generate_step and cache on the same model (shard) for the "full" case."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cfg, n, max_tokens = CASES["full"]
    steps = generate_step(mx.array(prompt(vocab, n)), model, max_tokens=max_tokens,
                          prompt_cache=make_prompt_cache(model), prefill_step_size=cfg.chunk)
    return [int(t) for t, _ in steps]


def main(model_dir: str, mode: str, out: str, die: bool = False) -> None:
    from localheap.backends.mlx.distributed import DistributedMLXBackend

    backend = DistributedMLXBackend.load(model_dir, mode)
    if die and backend.rank == 1:
        os._exit(3)   # after loading: rank 0 is in its first collective when this rank is gone
    result = {"stock": stock_tokens(backend.model, backend.vocab_size)}
    for name in CASES:
        result[name] = run_case(backend, name)
    where = Path(out).parent / f"{mode}-session"
    where.mkdir(exist_ok=True)
    result["session"] = session_case(backend, where)
    try:   # a heap saved by one process (the test saved it there) is not this layout's
        backend.load_cache(CASES["recall"][0], Path(out).parent / "single.safetensors")
    except ValueError as e:
        result["refused"] = str(e)
    if backend.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from localheap.models import leave_torch_out

    leave_torch_out(None)   # as the CLI's MLX processes do (commands/common.load_model_backend)
    main(sys.argv[1], sys.argv[2], sys.argv[3], die=len(sys.argv) > 4 and sys.argv[4] == "die")
