"""Re-rotation of cached keys and queries: move a vector from RoPE position p to p + delta.

transformers rotates with `x * cos + rotate_half(x) * sin` (split halves) using the
model's `inv_freq`. A rotation composes, R(p + d) = R(d) R(p), so rotating by the
delta equals rotating the raw vector at the new position up to float rounding. The
`attention_scaling` factor (yarn, longrope) is applied once at the original rotation
and must not be applied again, so deltas use a pure rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import numpy as np
import torch

# inv_freq depends on the sequence length: a delta is not a fixed rotation
_POSITION_DEPENDENT = ("dynamic", "longrope")
TABLE_LIMIT = 1 << 16   # rotate_ahead's largest delta from the table (its cos/sin: 2 x 65,536 x D/2 floats)


class UnsupportedRope(ValueError):
    """A RoPE variant whose rotation is not a pure function of the position delta (user-facing)."""


@dataclass
class RopeSpec:
    inv_freq: torch.Tensor   # [D/2] float32
    _tables: dict = field(default_factory=dict, repr=False)   # device -> (cos, sin) [shifts + 1, D/2]

    @classmethod
    def from_model(cls, model, layer_type: str, head_dim: int) -> "RopeSpec":
        """The rotation the model applies in layers of `layer_type` (gemma3 has one per type)."""
        rotary = _rotary_module(model)
        rope_type = getattr(rotary, "rope_type", "default")
        if isinstance(rope_type, dict):
            rope_type = rope_type.get(layer_type, "default")
        if rope_type in _POSITION_DEPENDENT:
            raise UnsupportedRope(f"{rope_type} RoPE depends on the sequence length; use positions='absolute'")
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise UnsupportedRope(f"cannot read the rotary frequencies of {type(rotary).__name__}")
        if 2 * inv_freq.shape[0] != head_dim:
            raise UnsupportedRope(f"partial rotary ({2 * inv_freq.shape[0]} of {head_dim} dims) is not supported")
        return cls(inv_freq.detach().float().clone())

    def rotate(self, x: torch.Tensor, deltas: Union[np.ndarray, torch.Tensor, int]) -> torch.Tensor:
        """x: [..., n, D]; deltas: int, or per-token [..., n] (broadcast against x). Same dtype out."""
        inv_freq = self.inv_freq.to(x.device)
        d = torch.as_tensor(deltas, device=x.device)
        angles = d.to(torch.float32)[..., None] * inv_freq        # [..., n, D/2]
        emb = torch.cat((angles, angles), dim=-1)
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated_half = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * emb.cos() + rotated_half * emb.sin()).to(x.dtype)


    def shift_back(self, x: torch.Tensor, shifts: torch.Tensor, max_shift: int) -> torch.Tensor:
        """`rotate(x, -shifts)` for integer shifts in [0, max_shift] (a repack moves keys towards the
        front by at most the evicted count), from a cached cos/sin table: the same float32 angles
        as `rotate`, so the same bits, without a cos and sin per key."""
        cos, sin = self.table(x.device, max_shift)
        return _turned(x, cos[shifts], -sin[shifts])          # sin is odd

    def rotate_ahead(self, x: torch.Tensor, deltas: Union[np.ndarray, torch.Tensor]) -> torch.Tensor:
        """`rotate(x, deltas)` bit for bit, for whole deltas >= 0 (a recall's merge: recalled keys
        rotated to their slots, resident ones moved later by what lands before them), from the
        cached cos/sin table where the largest delta is within TABLE_LIMIT, else `rotate`. The
        table's angles are `rotate`'s float32 ones, and lo*c + (-hi)*s is lo*c - hi*s exactly.
        The deltas' bounds are read where they are (the merge's are host numpy) before they move."""
        if len(deltas.reshape(-1)) == 0 or int(deltas.min()) < 0 or int(deltas.max()) > TABLE_LIMIT:
            return self.rotate(x, deltas)
        cos, sin = self.table(x.device, int(deltas.max()))
        d = torch.as_tensor(deltas, device=x.device)
        return _turned(x, cos[d], sin[d])

    def table(self, device: torch.device, max_shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [>= max_shift + 1, D/2] float32 of the shifts 0, 1, ...: cached, grown on demand."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] <= max_shift:
            size = max(max_shift + 1, 2 * (table[0].shape[0] if table is not None else 256))
            angles = torch.arange(size, device=device).to(torch.float32)[:, None] * self.inv_freq.to(device)
            table = self._tables[device] = (angles.cos(), angles.sin())
        return table


def _turned(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by angles whose cos and sin are c, s [..., D/2] (rotate_half's layout), in
    float32, in `rotate`'s order of operations; x's dtype out."""
    xf = x.float()
    half = xf.shape[-1] // 2
    lo, hi = xf[..., :half], xf[..., half:]
    return torch.cat((lo * c - hi * s, hi * c + lo * s), dim=-1).to(x.dtype)


def _rotary_module(model):
    for owner in (getattr(model, "model", None), model):
        rotary = getattr(owner, "rotary_emb", None)
        if rotary is not None:
            return rotary
    raise UnsupportedRope(f"cannot find the rotary embedding of {type(model).__name__}")
