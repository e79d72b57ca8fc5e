"""Re-rotation of cached keys and queries: move a vector from RoPE position p to p + delta.

transformers rotates with `x * cos + rotate_half(x) * sin` using the model's `inv_freq`, over
the first R = 2 * len(inv_freq) dims of a head (all of them, or a part: phi3's and glm4's
`partial_rotary_factor`; the rest pass through), in one of two layouts: split halves (llama,
pair i is dims i and i + R/2) or interleaved (glm, glm4: pair i is dims 2i and 2i + 1). The
layout lives in the model's code, not its config, so it is read by running the model's own
`apply_rotary_pos_emb` on a probe. A rotation composes, R(p + d) = R(d) R(p), so rotating by
the delta equals rotating the raw vector at the new position up to float rounding. The
`attention_scaling` factor (yarn, longrope) is applied once at the original rotation
and must not be applied again, so deltas use a pure rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

# inv_freq depends on the sequence length: a delta is not a fixed rotation
_POSITION_DEPENDENT = ("dynamic", "longrope")
MOVES_NO_KEY = (": a key cannot be moved to another position (as compact positions, recall and the geometry policy "
                "do); use --positions absolute --recall off, and a policy other than geometry")
TABLE_LIMIT = 1 << 16   # rotate_ahead's largest delta from the table (its cos/sin: 2 x 65,536 x D/2 floats)


class UnsupportedRope(ValueError):
    """A RoPE variant whose rotation is not a pure function of the position delta (user-facing)."""


@dataclass
class RopeSpec:
    inv_freq: torch.Tensor   # [R/2] float32
    head_dim: Optional[int] = None   # D >= R (None: D = R)
    interleaved: bool = False        # pairs (2i, 2i + 1), else (i, i + R/2)
    _tables: dict = field(default_factory=dict, repr=False)   # device -> (cos, sin) [shifts + 1, R/2]

    @property
    def rotary_dims(self) -> int:
        return 2 * self.inv_freq.shape[0]

    @property
    def standard(self) -> bool:
        """Every dim rotated, in split halves: the layout slab_cpu's kernels are written for."""
        return not self.interleaved and (self.head_dim is None or self.head_dim == self.rotary_dims)

    @classmethod
    def from_model(cls, model, layer_type: str, head_dim: int) -> "RopeSpec":
        """The rotation the model applies in layers of `layer_type` (gemma3 has one per type)."""
        rotary = _rotary_module(model)
        rope_type = getattr(rotary, "rope_type", "default")
        if isinstance(rope_type, dict):
            rope_type = rope_type.get(layer_type, "default")
        if rope_type in _POSITION_DEPENDENT:
            raise UnsupportedRope(f"{rope_type} RoPE depends on the sequence length{MOVES_NO_KEY}")
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise UnsupportedRope(f"cannot read the rotary frequencies of {type(rotary).__name__}")
        if 2 * inv_freq.shape[0] > head_dim:
            raise UnsupportedRope(f"{2 * inv_freq.shape[0]} rotary dims do not fit a head of {head_dim}")
        spec = cls(inv_freq.detach().float().clone(), head_dim)
        spec.interleaved = _interleaved(model, spec)
        return spec

    def rotate(self, x: torch.Tensor, deltas: Union[np.ndarray, torch.Tensor, int]) -> torch.Tensor:
        """x: [..., n, D]; deltas: int, or per-token [..., n] (broadcast against x). Same dtype out."""
        inv_freq = self.inv_freq.to(x.device)
        d = torch.as_tensor(deltas, device=x.device)
        angles = d.to(torch.float32)[..., None] * inv_freq        # [..., n, R/2]
        R = self.rotary_dims
        xf = x.float()
        xr = xf[..., :R] if R < xf.shape[-1] else xf
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=-1)
            rotated_half = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
        else:
            emb = torch.cat((angles, angles), dim=-1)
            rotated_half = torch.cat((-xr[..., R // 2:], xr[..., :R // 2]), dim=-1)
        out = xr * emb.cos() + rotated_half * emb.sin()
        return _with_rest(out, xf, R).to(x.dtype)


    def shift_back(self, x: torch.Tensor, shifts: torch.Tensor, max_shift: int) -> torch.Tensor:
        """`rotate(x, -shifts)` for integer shifts in [0, max_shift] (a repack moves keys towards the
        front by at most the evicted count), from a cached cos/sin table: the same float32 angles
        as `rotate`, so the same bits, without a cos and sin per key."""
        cos, sin = self.table(x.device, max_shift)
        return self._turned(x, cos[shifts], -sin[shifts])          # sin is odd

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
        return self._turned(x, cos[d], sin[d])

    def table(self, device: torch.device, max_shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [>= max_shift + 1, R/2] float32 of the shifts 0, 1, ...: cached, grown on demand."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] <= max_shift:
            size = max(max_shift + 1, 2 * (table[0].shape[0] if table is not None else 256))
            angles = torch.arange(size, device=device).to(torch.float32)[:, None] * self.inv_freq.to(device)
            table = self._tables[device] = (angles.cos(), angles.sin())
        return table


    def _turned(self, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x [..., D] rotated by angles whose cos and sin are c, s [..., R/2], in float32, in
        `rotate`'s order of operations (lo*c + (-hi)*s is lo*c - hi*s exactly); x's dtype out."""
        R = self.rotary_dims
        xf = x.float()
        if self.interleaved:
            lo, hi = xf[..., 0:R:2], xf[..., 1:R:2]
            out = torch.stack((lo * c - hi * s, hi * c + lo * s), dim=-1).flatten(-2)
        else:
            lo, hi = xf[..., :R // 2], xf[..., R // 2:R]
            out = torch.cat((lo * c - hi * s, hi * c + lo * s), dim=-1)
        return _with_rest(out, xf, R).to(x.dtype)


def _with_rest(rotated: torch.Tensor, xf: torch.Tensor, R: int) -> torch.Tensor:
    """The rotated first R dims followed by the dims that pass through unrotated."""
    return rotated if R == xf.shape[-1] else torch.cat((rotated, xf[..., R:]), dim=-1)


def _interleaved(model, spec: RopeSpec) -> bool:
    """Which layout the model's own `apply_rotary_pos_emb` rotates in: run it on a probe, with
    the [..., R] cos/sin the llama-style rotary modules give, at angles no two pairs share, and
    compare with both layouts. Where that cannot run (no such function; gpt-oss's takes [..., R/2]
    tables) a whole-head rotation is taken as split halves, transformers' llama's layout; a partial
    one, or a function that matches neither layout, is refused rather than guessed."""
    import sys

    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else []
    attn = getattr(layers[0], "self_attn", None) if len(layers) else None
    apply = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    D, half = spec.head_dim, spec.rotary_dims // 2
    probe = torch.randn(1, 1, 1, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    angles = torch.linspace(0.3, 2.9, half, dtype=torch.float64)
    emb = torch.cat((angles, angles))[None, None]                 # [1, 1, R]
    try:
        got = apply(probe, probe, emb.cos(), emb.sin())[0].float() if apply is not None else None
    except (TypeError, RuntimeError):
        got = None
    if got is not None and got.shape == probe.shape:
        for interleaved in (False, True):
            want = RopeSpec(torch.ones(half), D, interleaved)._turned(probe.float(), angles.float().cos(),
                                                                      angles.float().sin())
            if torch.allclose(got, want, atol=1e-5):
                return interleaved
    elif spec.standard:
        return False
    raise UnsupportedRope(f"cannot tell the rotary layout of {type(model).__name__} "
                          f"({spec.rotary_dims} of {spec.head_dim} dims rotated)")


def _rotary_module(model):
    for owner in (getattr(model, "model", None), model):
        rotary = getattr(owner, "rotary_emb", None)
        if rotary is not None:
            return rotary
    raise UnsupportedRope(f"cannot find the rotary embedding of {type(model).__name__}")
