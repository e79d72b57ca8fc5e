"""Scores in, keep-indices out: the one selection rule every policy and backend shares.

Slots are in token order. The first `sinks` slots and the last `recent` slots are
always kept; the rest compete by score. The result is sorted, so a repack that
gathers these indices preserves token order.
"""

from __future__ import annotations

import numpy as np


def protected_mask(n: int, sinks: int, recent: int) -> np.ndarray:
    """[n] bool: slots that are never evicted (sinks at the front, recent window at the back)."""
    mask = np.zeros(n, dtype=bool)
    mask[: min(sinks, n)] = True
    if recent > 0:
        mask[max(0, n - recent):] = True
    return mask


def add_noise_floor(scores: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """Blur the ranking by `noise` x each head's score spread, so eviction order leaks less."""
    if noise <= 0:
        return scores
    spread = scores.std(axis=-1, keepdims=True) + 1e-12
    return scores + rng.standard_normal(scores.shape) * noise * spread


def select_keep(scores: np.ndarray, keep: int, sinks: int, recent: int) -> np.ndarray:
    """Pick `keep` slots per KV head.

    scores: [H, n] float, higher = more important. Returns keep_indices [H, keep]
    (int64, ascending). Ties go to the older slot (stable sort).
    """
    assert scores.ndim == 2, scores.shape
    n_heads, n = scores.shape
    if n <= keep:
        return np.broadcast_to(np.arange(n, dtype=np.int64), (n_heads, n)).copy()
    protected = protected_mask(n, sinks, recent)
    n_free = keep - int(protected.sum())
    assert n_free >= 0, f"keep={keep} smaller than protected slots={int(protected.sum())}"
    candidates = np.flatnonzero(~protected)
    cand_scores = scores[:, candidates]
    order = np.argsort(-cand_scores, axis=1, kind="stable")[:, :n_free]
    chosen = candidates[order]
    fixed = np.broadcast_to(np.flatnonzero(protected), (n_heads, int(protected.sum())))
    keep_indices = np.sort(np.concatenate([fixed, chosen], axis=1), axis=1)
    return keep_indices.astype(np.int64)
