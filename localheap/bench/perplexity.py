"""`localheap bench perplexity`: what eviction costs the model's predictions of a long text.

The text is read through each heap (policy x budget) in prefill chunks, as a prompt whose
logprobs an echo asks for is read (Backend.prefill_scored): each token is predicted from what
the heap holds at that point. Against the same text read with a budget that holds it all (no
eviction: the stock cache, bit for bit), the perplexity of the tokens read once the heap could
evict (past sinks + budget) is the cost; 1.00x is none. Texts: the demo model's own corpus
(bench/facts.corpus) and text nobody tuned to (bench/sources: licences, manual pages, code
comments), or a file.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

SOURCES = ("corpus", "licenses", "man", "comments")


def text_tokens(tokenizer, source: str, n: int) -> list[int]:
    """`n` tokens of a source (a name from SOURCES, or a file path), from its start."""
    from .sources import texts

    if source in SOURCES:
        if source == "corpus":
            from .facts import corpus

            parts = corpus()
        else:
            parts = texts(source)
        text, tokens = "", []
        for part in parts:   # a piece at a time: a long source is not tokenized whole
            text += part + "\n\n"
            if len(text) >= 6 * n:
                break
        tokens = tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(Path(source).read_text(encoding="utf-8"), add_special_tokens=False)
    if len(tokens) < n:
        raise ValueError(f"{source}: {len(tokens):,} tokens, fewer than the {n:,} asked for")
    return list(tokens[:n])


def scored(backend, cfg, tokens: Sequence[int]) -> np.ndarray:
    """[len(tokens) - 1]: each token's logprob (but the first's), read through a heap of `cfg` in
    its prefill chunks."""
    from ..generation import LogprobRecorder

    cache = backend.new_cache(cfg)
    recorder = LogprobRecorder(0)
    body = tokens[:-1]
    for a in range(0, len(body), cfg.chunk):
        end = min(a + cfg.chunk, len(body))
        backend.prefill_scored(cache, body[a:end], tokens[end], recorder)
    return np.array([recorder.get(i).logprob for i in range(len(recorder))], dtype=np.float64)


def perplexity(logprobs: np.ndarray) -> float:
    return math.exp(-float(np.mean(logprobs)))


def run_perplexity(backend, base, context: int = 4096, budgets: Sequence[int] = (512, 1024),
                   policies: Optional[Sequence[str]] = None, sources: Sequence[str] = ("corpus", "licenses"),
                   log: Optional[Callable[[str], None]] = None) -> dict:
    """Rows (source, policy, budget): perplexity of the tokens read past the heap's capacity (sinks +
    budget + room for a prefill chunk: each is read after an eviction; before it, some tokens of
    the first chunks past the budget still see the whole text), its ratio to the full cache's on the
    same tokens, and the whole text's; tokens/s of the scored read."""
    from ..heap import POLICIES

    policies = list(policies or POLICIES)
    for budget in budgets:   # (before any text is read: not after the first budgets' rows)
        capacity = budget + base.sinks + base.append_room
        if capacity >= context:
            raise ValueError(f"budget {budget}: the heap holds {capacity:,} tokens (sinks + budget + a prefill chunk "
                             f"of {base.append_room:,}), the whole {context:,}-token text: nothing is read after "
                             f"an eviction (a longer --context, or a smaller --prefill-chunk)")
    rows = []
    for source in sources:
        tokens = text_tokens(backend.tokenizer, source, context)
        began = time.perf_counter()
        full = scored(backend, base.with_(budget=context, recall=False), tokens)
        rows.append({"source": source, "policy": "full", "budget": context, "ppl_evicted": None, "ratio": None,
                     "ppl_all": perplexity(full), "tok_s": context / (time.perf_counter() - began)})
        for budget in budgets:
            capacity = budget + base.sinks + base.append_room
            start = capacity - 1   # logprobs[i] is token i + 1's: the first one read past the capacity
            reference = perplexity(full[start:])
            for policy in policies:
                cfg = base.with_(policy=policy, budget=budget, recent=min(base.recent, budget // 2))
                began = time.perf_counter()
                got = scored(backend, cfg, tokens)
                took = time.perf_counter() - began
                ppl = perplexity(got[start:])
                rows.append({"source": source, "policy": policy, "budget": budget, "ppl_evicted": ppl,
                             "ratio": ppl / reference, "ppl_all": perplexity(got), "tok_s": context / took,
                             "full_evicted": reference})
                if log:
                    log(f"{source} {policy} budget {budget}: {ppl:.3f} ({ppl / reference:.3f}x full)")
    settings = {"context": context, "budgets": list(budgets), "policies": policies, "sources": list(sources),
                "heap": base.to_dict()}
    return {"rows": rows, "settings": settings}


def tables(result: dict) -> str:
    from .report import table

    cols = [("source", "text", ""), ("policy", "policy", ""), ("budget", "budget", ","),
            ("ppl_evicted", "ppl past heap", ".3f"), ("full_evicted", "full cache", ".3f"),
            ("ratio", "ratio", ".3f"), ("ppl_all", "ppl (all)", ".3f"), ("tok_s", "tok/s", ",.0f")]
    s = result["settings"]
    return (f"perplexity of a {s['context']:,}-token text read through each heap (prefill chunk "
            f"{s['heap']['prefill_chunk'] or s['heap']['slack']}), against the full cache on the same tokens\n"
            + table(result["rows"], cols))


def report(result: dict, backend, out=None) -> None:
    import sys

    from .report import emit

    emit("perplexity", f"model {backend.model_name} | backend {backend.name}\n" + tables(result),
         {"model": backend.model_name, "backend": backend.name, **result}, out=out or sys.stdout)
