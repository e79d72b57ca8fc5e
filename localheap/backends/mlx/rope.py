"""Re-rotation of cached keys: move a key from RoPE position p to p + delta.

RoPE is a rotation per frequency pair, so R(p + d) = R(d) R(p): rotating a cached
key by its position delta equals rotating the raw key at the new position (up to
float rounding). Works for plain, llama3-scaled, su-scaled and yarn frequencies and
for both layouts (traditional = interleaved pairs, otherwise split halves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np


MOVES_NO_KEY = (": a key cannot be moved to another position (as compact positions, recall and the geometry policy "
                "do); use --positions absolute --recall off, and a policy other than geometry")


class UnsupportedRope(ValueError):
    """A RoPE variant whose rotation is not a pure function of position delta."""


@dataclass
class RopeSpec:
    dims: int
    traditional: bool
    base: Optional[float]
    scale: float
    freqs: Optional[mx.array]

    @classmethod
    def from_module(cls, rope) -> "RopeSpec":
        name = type(rope).__name__
        if name == "DynamicNTKScalingRoPE":
            raise UnsupportedRope(f"dynamic NTK RoPE depends on the sequence length{MOVES_NO_KEY}")
        dims = getattr(rope, "dims", None) or getattr(rope, "dim", None)
        if dims is None:
            raise UnsupportedRope(f"cannot read the rotary dims of {name}")
        freqs = getattr(rope, "_freqs", None)
        if freqs is not None:
            return cls(int(dims), bool(getattr(rope, "traditional", False)), None, 1.0, freqs)
        return cls(int(dims), bool(rope.traditional), float(rope.base), float(getattr(rope, "scale", 1.0)), None)

    def rotate(self, x: mx.array, deltas) -> mx.array:
        """x: [H, n, D]; deltas: [H, n] int positions to add (numpy or mx). Returns x rotated per token."""
        H, n, D = x.shape
        flat = x.reshape(H * n, 1, 1, D)
        if isinstance(deltas, mx.array):
            offsets = deltas.reshape(-1).astype(mx.int32)
        else:
            offsets = mx.array(np.asarray(deltas).reshape(-1).astype(np.int32))
        out = mx.fast.rope(
            flat, self.dims, traditional=self.traditional, base=self.base,
            scale=self.scale, offset=offsets, freqs=self.freqs,
        )
        return out.reshape(H, n, D)
