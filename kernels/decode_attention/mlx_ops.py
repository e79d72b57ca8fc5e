"""MLX: single-query decode attention over a heap buffer, plus each key's attention mass.

`decode_attention` is the entry point: the Metal kernel where Metal is available and
the kernel has agreed with `reference` on the caller's own inputs, else `reference`
(MLX's CPU backend, or a kernel that failed to compile or to agree).
"""

from __future__ import annotations

import mlx.core as mx

from ..dispatch import CheckedKernel

OUT_TOL = {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
MASS_TOL = 1e-4


def reference(q: mx.array, k: mx.array, v: mx.array, scale: float, n_keys: int):
    """q: [H_q, D] one query per head; k, v: [H_kv, capacity, D] heap buffers, the first
    n_keys slots attended. Returns out [H_q, D] in q's dtype and mass [H_kv, n_keys] float32
    (softmax weights of the G = H_q / H_kv query heads sharing each KV head, summed)."""
    Hq, D = q.shape
    H = k.shape[0]
    qf = q.astype(mx.float32).reshape(H, Hq // H, D)              # query head h uses KV head h // G
    keys = k[:, :n_keys, :].astype(mx.float32)
    logits = (qf @ keys.swapaxes(-1, -2)) * scale                  # [H_kv, G, T]
    probs = mx.softmax(logits, axis=-1, precise=True)
    out = (probs @ v[:, :n_keys, :].astype(mx.float32)).reshape(Hq, v.shape[-1])
    return out.astype(q.dtype), probs.sum(axis=1)


def _agree(got, want, key) -> bool:
    (out, mass), (ref_out, ref_mass) = got, want
    tol = OUT_TOL.get(key[0], 1e-2)
    return (out.shape == ref_out.shape and mass.shape == ref_mass.shape
            and mx.allclose(out.astype(mx.float32), ref_out.astype(mx.float32), atol=tol, rtol=tol).item()
            and mx.allclose(mass, ref_mass, atol=MASS_TOL, rtol=1e-3).item())


def _metal(q, k, v, scale, n_keys):
    from .metal_kernel import decode_attention_metal

    return decode_attention_metal(q, k, v, scale, n_keys)


METAL = CheckedKernel("decode_attention.metal", _metal, reference, _agree)


def kernel_available() -> bool:
    return mx.metal.is_available()


def decode_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, n_keys: int):
    """Same contract as `reference`; the fused kernel where it can run and has been verified."""
    if kernel_available():
        key = (q.dtype, q.shape[0] // k.shape[0], q.shape[1])
        return METAL(key, q, k, v, scale, n_keys)
    return reference(q, k, v, scale, n_keys)
