"""`localheap bench attention-mass`: how much of the true attention the kept set still sees.

Needs no trained model. For one context, the final queries (the question) attend over
the full cache: that is the true attention mass. Each policy's heap sees the same
document, evicts down to its budget, and the share of the true mass that falls on
the tokens it kept (plus the question itself, always resident) is the score, per
layer. "oracle" keeps the top-mass tokens of each KV head: the ceiling for a budget.

Backend-agnostic: the true mass comes from the backend's own observation window
(a snapkv heap large enough never to evict, fed the question as one chunk).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from .needle import episodes


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):   # torch
        return x.detach().float().cpu().numpy()
    return np.array(x, dtype=np.float32)   # mlx


def true_mass(backend, base, tokens: Sequence[int], n_query: int) -> list[np.ndarray]:
    """Per heap layer [H_kv, T]: attention mass of the last n_query tokens (summed over them and
    over the query heads of each KV head) on every token, with nothing evicted."""
    T = len(tokens)
    slack = max(base.slack, n_query)
    cfg = base.with_(policy="snapkv", budget=T + slack, obs_window=n_query, slack=slack,
                     recent=min(base.recent, T), profile="uniform")
    cache = backend.new_cache(cfg)
    backend.prefill(cache, tokens[:-n_query])
    backend.prefill(cache, tokens[-n_query:])   # one chunk: the window holds exactly these queries
    return [_numpy(layer.window)[:, :T] for layer in cache.heap_layers]


def kept_positions(backend, cfg, tokens: Sequence[int]) -> list[list[np.ndarray]]:
    """Per heap layer, per KV head: original positions the heap keeps once it is down to its budget."""
    cache = backend.new_cache(cfg)
    backend.prefill(cache, tokens)
    cache.make_room(cfg.slack)   # evict the slack too: exactly sinks + budget remain
    out = []
    for layer in cache.heap_layers:
        h = layer.heap
        out.append([h.positions[k, : h.resident].copy() for k in range(h.n_kv_heads)])
    return out


def captured(mass: np.ndarray, kept: list[np.ndarray], doc_len: int) -> float:
    """Share of each KV head's mass on kept document tokens + the question, averaged over heads."""
    shares = []
    for h, pos in enumerate(kept):
        pos = pos[pos < doc_len]
        shares.append((mass[h, pos].sum() + mass[h, doc_len:].sum()) / mass[h].sum())
    return float(np.mean(shares))


def oracle(mass: np.ndarray, keep: int, doc_len: int) -> float:
    doc = np.sort(mass[:, :doc_len], axis=1)[:, ::-1][:, :keep]
    return float(np.mean((doc.sum(axis=1) + mass[:, doc_len:].sum(axis=1)) / mass.sum(axis=1)))


def run_attention_mass(backend, base=None, context: int = 4096, prune: Sequence[float] = (0.5, 0.9),
                       policies: Optional[Sequence[str]] = None, trials: int = 4, seed: int = 0,
                       log: Optional[Callable[[str], None]] = None) -> dict:
    """Rows (policy, prune, layer) -> captured share of the true attention mass (mean over trials)."""
    from ..heap import POLICIES, HeapConfig
    from .needle import budget_for, frame

    base = base or HeapConfig()
    policies = list(policies or POLICIES)
    n_query = len(frame(backend.tokenizer).tail)
    acc: dict[tuple[str, float], list[list[float]]] = {}
    for i, ep in enumerate(episodes(backend.tokenizer, context, trials, seed)):
        doc_len = context - n_query
        mass = true_mass(backend, base, ep.tokens, n_query)
        for p in prune:
            budget = budget_for(context, p, base.sinks)
            for pol in policies:
                cfg = base.with_(policy=pol, budget=budget, recent=min(base.recent, budget // 2))
                kept = kept_positions(backend, cfg, ep.tokens[:doc_len])
                acc.setdefault((pol, p), []).append([captured(m, k, doc_len) for m, k in zip(mass, kept)])
            acc.setdefault(("oracle", p), []).append(
                [oracle(m, min(doc_len, base.sinks + budget), doc_len) for m in mass])
        if log:
            log(f"trial {i + 1}/{trials} done")
    rows = []
    for (pol, p), per_trial in acc.items():
        arr = np.array(per_trial)   # [trials, layers]
        rows.append({"policy": pol, "prune": p, "budget": budget_for(context, p, base.sinks),
                     "per_layer": [round(float(v), 4) for v in arr.mean(axis=0)],
                     "mean": round(float(arr.mean()), 4), "min": round(float(arr.min()), 4)})
    settings = {"context": context, "prune": list(prune), "policies": policies, "trials": trials,
                "query_tokens": n_query, "seed": seed, "heap": base.to_dict()}
    return {"rows": rows, "settings": settings}


def tables(result: dict) -> str:
    from .report import table

    rows = result["rows"]
    n_layers = len(rows[0]["per_layer"])
    flat = [{**{k: r[k] for k in ("policy", "prune", "mean", "min")},
             **{f"l{i}": v for i, v in enumerate(r["per_layer"])}} for r in rows]
    cols = [("policy", "policy", ""), ("prune", "pruned", ".0%"), ("mean", "mean", ".1%"), ("min", "min", ".1%")]
    cols += [(f"l{i}", f"L{i}", ".1%") for i in range(n_layers)]
    s = result["settings"]
    return (f"share of the final {s['query_tokens']} queries' attention mass kept, context {s['context']:,}, "
            f"{s['trials']} trials\n" + table(flat, cols))


def report(result: dict, backend, out=None) -> None:
    import sys

    from .report import emit

    emit("attention_mass", f"model {backend.model_name} | backend {backend.name}\n" + tables(result),
         {"model": backend.model_name, "backend": backend.name, **result}, out=out or sys.stdout)
