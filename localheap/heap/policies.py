"""Eviction policies: each turns what the backend observed into a score per slot.

A policy never sees tensors. The backend fills a `SlotView` with small numpy arrays
([kv_heads, resident]) at eviction time only; `select_keep` does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from .config import HeapConfig


@dataclass
class SlotView:
    """What is known about each resident slot of one layer. All arrays: [kv_heads, n]."""

    positions: np.ndarray                  # original token positions
    attention: Optional[np.ndarray] = None  # accumulated attention mass (GQA heads summed)
    counts: Optional[np.ndarray] = None     # how many scored queries could see each slot
    window: Optional[np.ndarray] = None     # mass from the latest observation window
    geometry: Optional[np.ndarray] = None   # attention-free score from the backend


class Policy(Protocol):
    name: str

    def score(self, view: SlotView) -> np.ndarray:
        """[kv_heads, n] importance, higher = keep."""
        ...


def _require(arr: Optional[np.ndarray], what: str, policy: str) -> np.ndarray:
    if arr is None:
        raise RuntimeError(f"policy {policy} needs {what}, which the backend did not collect")
    return arr


class H2O:
    """Heavy hitters: accumulated attention mass, optionally per observing query."""

    name = "h2o"

    def __init__(self, normalize: bool = False):
        self.normalize = normalize

    def score(self, view: SlotView) -> np.ndarray:
        mass = _require(view.attention, "attention mass", self.name).astype(np.float64)
        if not self.normalize:
            return mass
        counts = _require(view.counts, "observation counts", self.name)
        return mass / np.maximum(counts, 1.0)


class SnapKV:
    """Attention from the last queries (the observation window), max-pooled over neighbours."""

    name = "snapkv"

    def __init__(self, kernel: int = 7):
        self.kernel = kernel

    def score(self, view: SlotView) -> np.ndarray:
        window = _require(view.window, "observation-window attention", self.name)
        return max_pool1d(window.astype(np.float64), self.kernel)


class Geometry:
    """No attention probabilities: the backend scores keys by their geometry."""

    name = "geometry"

    def score(self, view: SlotView) -> np.ndarray:
        return _require(view.geometry, "geometry scores", self.name).astype(np.float64)


class Streaming:
    """StreamingLLM baseline: sinks + the most recent tokens (newest scores highest)."""

    name = "streaming"

    def score(self, view: SlotView) -> np.ndarray:
        return view.positions.astype(np.float64)


class RandomPolicy:
    """Seeded random baseline."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def score(self, view: SlotView) -> np.ndarray:
        return self.rng.random(view.positions.shape)


def max_pool1d(x: np.ndarray, kernel: int) -> np.ndarray:
    """[H, n] -> [H, n], max over a centred window of odd width `kernel`."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    half = kernel // 2
    padded = np.pad(x, ((0, 0), (half, half)), mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)
    return windows.max(axis=-1)


def make_policy(cfg: HeapConfig, layer: int = 0) -> Policy:
    """The policy object for one layer (random policies get a per-layer seed)."""
    if cfg.policy == "h2o":
        return H2O(normalize=cfg.h2o_normalize)
    if cfg.policy == "snapkv":
        return SnapKV(kernel=cfg.pool_kernel)
    if cfg.policy == "geometry":
        return Geometry()
    if cfg.policy == "streaming":
        return Streaming()
    if cfg.policy == "random":
        return RandomPolicy(seed=cfg.seed * 1_000_003 + layer)
    raise AssertionError(cfg.policy)
