"""How a page's K/V payload is stored: float32 (exact), float16, or int8 with a scale per token and head.

int8 is symmetric per (head, token) row: scale = max|x| / 127, x = q * scale, so the
error of every element is at most scale / 2 = max|row| / 254 (plus float32 rounding).
"""

from __future__ import annotations

import numpy as np

FORMATS = ("f32", "f16", "int8")


def payload_fields(fmt: str, H: int, P: int, D: int) -> list[tuple]:
    """Structured-dtype fields of one page's payload."""
    if fmt == "int8":
        return [("kscale", "<f4", (H, P)), ("vscale", "<f4", (H, P)),
                ("keys", "i1", (H, P, D)), ("values", "i1", (H, P, D))]
    elem = "<f4" if fmt == "f32" else "<f2"
    return [("keys", elem, (H, P, D)), ("values", elem, (H, P, D))]


def payload_names(fmt: str) -> tuple[str, ...]:
    return ("kscale", "vscale", "keys", "values") if fmt == "int8" else ("keys", "values")


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: [..., D] float -> (int8 [..., D], scale [...] float32)."""
    scale = np.abs(x).max(axis=-1).astype(np.float32) / 127.0
    q = np.rint(x / np.where(scale > 0, scale, 1.0)[..., None])
    return np.clip(q, -127, 127).astype(np.int8), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[..., None]


def encode(rec: np.ndarray, fmt: str, keys: np.ndarray, values: np.ndarray) -> None:
    """Write keys/values [H, P, D] into the record's payload fields."""
    if fmt == "int8":
        rec["keys"], rec["kscale"] = quantize(keys)
        rec["values"], rec["vscale"] = quantize(values)
    else:
        rec["keys"], rec["values"] = keys, values


def decode(recs: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Records [u] -> keys, values [u, H, P, D] float32."""
    if fmt == "int8":
        return dequantize(recs["keys"], recs["kscale"]), dequantize(recs["values"], recs["vscale"])
    return recs["keys"].astype(np.float32), recs["values"].astype(np.float32)
