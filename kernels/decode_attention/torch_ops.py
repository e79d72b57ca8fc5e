"""Torch: single-query decode attention over a heap buffer, plus each key's attention mass.

`decode_attention` is the entry point: the Triton kernel on CUDA once it has agreed
with `reference` on the caller's own inputs, else `reference` (CPU, no triton, or a
kernel that failed its check).
"""

from __future__ import annotations

import torch

from ..dispatch import CheckedKernel
from . import triton_kernel

# output tolerance per input dtype (both sides accumulate in float32; the output is rounded to the dtype)
OUT_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
MASS_TOL = 1e-4


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q: [H_q, D] one query per head; k, v: [H_kv, T, D] (views into the heap buffer are fine).

    Returns out [H_q, D] in q's dtype and mass [H_kv, T] float32: the softmax weights of the
    G = H_q / H_kv query heads that share each KV head, summed (each row of mass sums to G).
    """
    Hq, D = q.shape
    H = k.shape[0]
    qf = q.float().view(H, Hq // H, D)                              # query head h uses KV head h // G
    logits = torch.matmul(qf, k.float().transpose(1, 2)) * scale    # [H_kv, G, T]
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, v.float()).reshape(Hq, v.shape[-1])
    return out.to(q.dtype), probs.sum(dim=1)


def _agree(got, want, key) -> bool:
    dtype = key[1]
    (out, mass), (ref_out, ref_mass) = got, want
    tol = OUT_TOL.get(dtype, 1e-2)
    return (out.shape == ref_out.shape and mass.shape == ref_mass.shape
            and torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol)
            and torch.allclose(mass, ref_mass, atol=MASS_TOL, rtol=1e-3))


TRITON = CheckedKernel("decode_attention.triton", triton_kernel.decode_attention_triton, reference, _agree)


def kernel_available() -> bool:
    return triton_kernel.AVAILABLE and torch.cuda.is_available()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Same contract as `reference`; the fused kernel where it can run and has been verified."""
    if q.is_cuda and triton_kernel.AVAILABLE:
        key = (str(q.device), q.dtype, q.shape[0] // k.shape[0], q.shape[1])
        return TRITON(key, q, k, v, scale)
    return reference(q, k, v, scale)
