"""`localheap bench peer`: localheap's heap against llama.cpp on the same weights, same prompts.

llama.cpp runs through llama-cpp-python (a benchmark extra: `pip install -e '.[peer]' in localheap's checkout`) on
a GGUF this module writes from the model directory localheap loads (bench/gguf.py). Every cell
(engine, KV setting, threads, context) runs in a fresh child process, so its peak RSS is its
own; cells run one after the other, their order reversed on every other repeat. Prompts are
random token ids (the same for every engine); decode is greedy; decode tok/s = 1 / the median
step. Knows nothing about serving: one prompt, one generation per cell.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

PATHS = ("heap", "heap-recall", "llama.cpp-f16", "llama.cpp-f16-fa", "llama.cpp-f16-q8kv")
# heap-fused: decode attention and scores in one pass (not bit-identical to stock sdpa);
# -compiled: the decode step's per-token parts compiled ahead of time (--compile-decode)
MORE_PATHS = ("heap-fused", "heap-compiled", "heap-fused-compiled")
LLAMA_BATCH = 512   # llama.cpp's prefill batch (its default n_batch / n_ubatch)


def _peak_rss() -> int:
    """This process's peak RSS. Linux keeps ru_maxrss across exec (a child would report its forked
    parent's peak), so there it is VmHWM, which starts again with the new image."""
    if sys.platform == "linux":
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def random_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab_size, n).tolist()


# -- llama.cpp (child side) -------------------------------------------------------------
class LlamaCpp:
    """A llama.cpp context driven token by token through llama-cpp-python's C bindings:
    one batch per prefill chunk (logits of its last token only), one per decode step."""

    def __init__(self, gguf_path: str, n_ctx: int, threads: int, kv: str = "f16", flash_attn: bool = False):
        import llama_cpp

        self.lib = llama_cpp
        self.kv = kv
        # flash attention: off is llama-cpp-python's default; a q8_0 V cache needs it on
        kw = dict(flash_attn=flash_attn or kv == "q8_0")
        if kv == "q8_0":
            kw.update(type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0)
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=LLAMA_BATCH, n_ubatch=LLAMA_BATCH,
                                   n_threads=threads, n_threads_batch=threads, verbose=False, **kw)
        self.flash_attn = kw["flash_attn"]
        self.ctx = self.llm._ctx.ctx
        self.n_vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(LLAMA_BATCH, 0, 1)
        self.n_past = 0

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def _decode(self, tokens: list[int]) -> np.ndarray:
        b, n = self.batch, len(tokens)
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = self.n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i == n - 1
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.n_past += n
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def prefill(self, tokens: list[int]) -> int:
        for start in range(0, len(tokens), LLAMA_BATCH):
            logits = self._decode(tokens[start:start + LLAMA_BATCH])
        return int(np.argmax(logits))

    def step(self, token: int) -> int:
        return int(np.argmax(self._decode([token])))


# -- localheap (child side) -------------------------------------------------------------
class LocalHeap:
    """The heap through the torch backend's own generation loop (greedy)."""

    def __init__(self, model_spec: Optional[str], threads: int, recall: bool, heap: dict, fused: bool = False,
                 compiled: bool = False):
        import torch

        from ..heap import HeapConfig
        from ..models import load_backend

        torch.set_num_threads(threads)
        self.backend = load_backend(model_spec, "torch")
        self.backend.fused_decode = fused
        self.backend.compile_decode = compiled
        self.cfg = HeapConfig(**heap).with_(recall=recall)
        if not self.cfg.prefill_chunk:
            self.cfg = self.cfg.with_(prefill_chunk=self.backend.default_prefill_chunk())

    def generate(self, prompt: list[int], n: int):
        from ..backends.torch.generate import generate_tokens
        from ..generation import SamplingParams

        cache = self.backend.new_cache(self.cfg)
        return generate_tokens(self.backend.model, cache, prompt, SamplingParams(max_tokens=n))


def run_cell(cell: dict) -> dict:
    """Child process: load, warm up, then one timed prefill of `context` tokens and `decode` greedy steps."""
    t_load = time.perf_counter()
    prompt = random_prompt(cell["vocab"], cell["context"], seed=cell["context"])
    n = cell["decode"]
    if cell["path"].startswith("llama.cpp"):
        eng = LlamaCpp(cell["gguf"], cell["context"] + n + 16, cell["threads"],
                       kv="q8_0" if cell["path"].endswith("q8kv") else "f16", flash_attn=cell["path"].endswith("-fa"))
        eng.prefill(prompt[:64])   # warm-up
        eng.step(1)
        eng.reset()
        load_s, rss_loaded = time.perf_counter() - t_load, _rss()
        t0 = time.perf_counter()
        token = eng.prefill(prompt)
        prefill_s = time.perf_counter() - t0
        tokens, steps = [token], []
        for _ in range(n):
            t0 = time.perf_counter()
            token = eng.step(token)
            steps.append(time.perf_counter() - t0)
            tokens.append(token)
        extra = {"flash_attn": eng.flash_attn}
    else:
        eng = LocalHeap(cell["model_spec"], cell["threads"], cell["path"] == "heap-recall", cell["heap"],
                        fused=cell["path"].startswith("heap-fused"), compiled=cell["path"].endswith("-compiled"))
        for _ in eng.generate(prompt[:64], 4):   # warm-up
            pass
        load_s, rss_loaded = time.perf_counter() - t_load, _rss()
        gen = eng.generate(prompt, n + 1)
        t0 = time.perf_counter()
        tokens = [next(gen)]   # the whole prompt, then the first token
        prefill_s = time.perf_counter() - t0
        steps = []
        for _ in range(n):
            t0 = time.perf_counter()
            tokens.append(next(gen))
            steps.append(time.perf_counter() - t0)
        extra = {}
    return {**{k: cell[k] for k in ("path", "context", "threads")}, "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": 1.0 / float(np.median(steps)), "decode_tok_s_mean": n / sum(steps),
            "rss_loaded": rss_loaded, "peak_rss": _peak_rss(), "load_s": load_s, "tokens": tokens, **extra}


def _stepper(cell: dict, path: str, prompt: list[int], n: int):
    """A function that decodes one greedy token per call, the prompt already prefilled."""
    if path.startswith("llama.cpp"):
        eng = LlamaCpp(cell["gguf"], len(prompt) + n + 16, cell["threads"], kv="q8_0" if path.endswith("q8kv") else "f16",
                       flash_attn=path.endswith("-fa"))
        state = [eng.prefill(prompt)]

        def step():
            state[0] = eng.step(state[0])
        return step
    gen = LocalHeap(cell["model_spec"], cell["threads"], path == "heap-recall", cell["heap"],
                    fused=path.startswith("heap-fused"), compiled=path.endswith("-compiled")).generate(prompt, n + 1)
    next(gen)
    return lambda: next(gen)


def run_interleaved(cell: dict) -> dict:
    """Child process: every path prefilled in this one process, then decode steps taken in turn
    (path 1, path 2, ..., path 1, ...), so that load from other jobs hits every path alike."""
    import torch

    torch.set_num_threads(cell["threads"])
    prompt = random_prompt(cell["vocab"], cell["context"], seed=cell["context"])
    n = cell["decode"]
    steppers = {path: _stepper(cell, path, prompt, n) for path in cell["paths"]}
    steps = {path: [] for path in steppers}
    for _ in range(n):
        for path, step in steppers.items():
            t0 = time.perf_counter()
            step()
            steps[path].append(time.perf_counter() - t0)
    return {"interleaved": {path: 1.0 / float(np.median(s)) for path, s in steps.items()}}


def _child(cell: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(cell["threads"]))
    proc = subprocess.run([sys.executable, "-m", "localheap.bench.peer", json.dumps(cell)], capture_output=True,
                          text=True, env=env, timeout=timeout)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"cell {cell['path']} at {cell['context']:,} failed (rc {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(line)


# -- the correctness check and versions (parent side) -------------------------------------
def greedy_check(model_dir: Path, gguf_path: str, n: int = 32, prompt_tokens: int = 48) -> dict:
    """Greedy tokens from llama.cpp against transformers' stock loop (what localheap's heap matches
    at full budget) on one short prompt: the matching prefix length. Also shows the tokenizers agree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from ..backends.torch.bench import stock_tokens

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = "The heap keeps the tokens that matter. Once upon a time, in a land far away, there was a"
    ids = tok(text)["input_ids"][:prompt_tokens]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    ours = list(stock_tokens(model.eval(), DynamicCache(config=model.config), ids, n))
    eng = LlamaCpp(gguf_path, 256, 1)
    theirs_ids = eng.llm.tokenize(text.encode(), add_bos=bool(tok.bos_token_id is not None and ids[0] == tok.bos_token_id),
                                  special=False)
    token = eng.prefill(ids)
    theirs = [token]
    for _ in range(n - 1):
        token = eng.step(token)
        theirs.append(token)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), n)
    return {"tokens": n, "matching_prefix": same, "tokenizer_agrees": theirs_ids[:len(ids)] == ids,
            "ours": ours, "theirs": theirs}


def versions() -> dict:
    import llama_cpp
    import torch
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("localheap")
    except PackageNotFoundError:
        ours = "(source tree)"
    return {"localheap": ours, "torch": torch.__version__, "transformers": transformers.__version__,
            "llama-cpp-python": llama_cpp.__version__,
            "llama.cpp system": llama_cpp.llama_print_system_info().decode().strip()}


# -- the run (parent side) ----------------------------------------------------------------
def run_peer(model_spec: Optional[str], model_dir: Path, heap: dict, contexts: list[int], threads: list[int],
             decode: int, paths=PATHS, repeats: int = 1, workdir: Optional[Path] = None,
             log: Callable[[str], None] = lambda m: None, timeout: float = 3600) -> dict:
    """All cells, best of `repeats` per cell (decode by the median step, prefill by its best); order
    within a (context, threads) group reversed on every other repeat. Returns rows, check, versions."""
    from .gguf import convert

    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    workdir = Path(workdir or Path.home() / ".cache" / "localheap" / "gguf")
    workdir.mkdir(parents=True, exist_ok=True)
    gguf_path = str(convert(model_dir, workdir / f"{model_dir.name}-f16.gguf", "f16"))
    check = greedy_check(model_dir, gguf_path) if any(p.startswith("llama.cpp") for p in paths) else None
    rows = []
    for context in contexts:
        for t in threads:
            best: dict[str, dict] = {}
            for r in range(repeats):
                for path in (paths if r % 2 == 0 else tuple(reversed(paths))):
                    log(f"context {context:,} threads {t}: {path} (run {r + 1}/{repeats}) ...")
                    cell = {"path": path, "context": context, "threads": t, "decode": decode, "vocab": cfg["vocab_size"],
                            "gguf": gguf_path, "model_spec": model_spec, "heap": heap}
                    row = _child(cell, timeout)
                    log(f"  prefill {row['prefill_tok_s']:,.0f} tok/s, decode {row['decode_tok_s']:,.1f} tok/s "
                        f"(mean {row['decode_tok_s_mean']:,.1f}), peak RSS {row['peak_rss'] / 2**20:,.1f} MiB")
                    old = best.get(path)
                    if old is None:
                        best[path] = row
                    else:
                        old["prefill_tok_s"] = max(old["prefill_tok_s"], row["prefill_tok_s"])
                        old["decode_tok_s"] = max(old["decode_tok_s"], row["decode_tok_s"])
                        old["peak_rss"] = max(old["peak_rss"], row["peak_rss"])
            log(f"context {context:,} threads {t}: decode steps of all paths interleaved in one process ...")
            mixed = _child({**cell, "mode": "interleaved", "paths": list(paths)}, timeout)["interleaved"]
            for p in paths:
                best[p]["decode_mixed_tok_s"] = mixed[p]
            rows.extend(best[p] for p in paths)
    for r in rows:   # against llama.cpp f16 at the same context and threads
        ref = next((x for x in rows if x["path"] == "llama.cpp-f16" and x["context"] == r["context"]
                    and x["threads"] == r["threads"]), None)
        r["decode_vs_llama"] = r["decode_tok_s"] / ref["decode_tok_s"] if ref else None
        r["prefill_vs_llama"] = r["prefill_tok_s"] / ref["prefill_tok_s"] if ref else None
        r["decode_mixed_vs_llama"] = r["decode_mixed_tok_s"] / ref["decode_mixed_tok_s"] if ref else None
    return {"rows": rows, "check": check, "versions": versions(), "gguf": gguf_path}


if __name__ == "__main__":   # a child cell: one JSON argument in, one JSON line out
    spec = json.loads(sys.argv[1])
    print(json.dumps(run_interleaved(spec) if spec.get("mode") == "interleaved" else run_cell(spec)))
