"""Triton (CUDA): single-query GQA decode attention that also writes each key's attention mass.

Split-K in three small launches, all reading the heap buffer in place:
  1. partial: per (KV head, key block) the scaled scores of the G query heads, stored
     to a [H_kv, G, T] scratch, with the block's max, exp-sum and weighted values;
  2. combine: per KV head, the global max / exp-sum and the output;
  3. mass: per (KV head, key block) sum_g softmax_g(t) from the stored scores.
Everything accumulates in float32; the output is cast to q's dtype.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    AVAILABLE = True
except ImportError:  # CPU-only installs
    triton = tl = None
    AVAILABLE = False

import torch

BLOCK_T = 64


if AVAILABLE:
    @triton.jit
    def _partial_kernel(Q, K, V, S, M, L, O, scale, T, NB,
                        stride_kh, stride_kt, stride_vh, stride_vt,
                        G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
        h = tl.program_id(0)
        b = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = b * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_g = offs_g < G
        mask_d = offs_d < D
        mask_t = offs_t < T
        rows = h * G + offs_g                                    # query heads of this KV head
        q = tl.load(Q + rows[:, None] * D + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)       # [BG, BD]
        kv_mask = mask_t[:, None] & mask_d[None, :]
        k = tl.load(K + h * stride_kh + offs_t[:, None] * stride_kt + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)                                   # [BT, BD]
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                           # [BG, BT]
        s = tl.where(mask_t[None, :], s, float("-inf"))
        tl.store(S + rows[:, None] * T + offs_t[None, :], s, mask=mask_g[:, None] & mask_t[None, :])
        m = tl.max(s, axis=1)                                    # every block holds >= 1 real key
        p = tl.exp(s - m[:, None])
        v = tl.load(V + h * stride_vh + offs_t[:, None] * stride_vt + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)                                   # [BT, BD]
        o = tl.dot(p, v, input_precision="ieee")                                              # [BG, BD]
        tl.store(M + rows * NB + b, m, mask=mask_g)
        tl.store(L + rows * NB + b, tl.sum(p, axis=1), mask=mask_g)
        tl.store(O + (rows[:, None] * NB + b) * D + offs_d[None, :], o, mask=mask_g[:, None] & mask_d[None, :])

    @triton.jit
    def _combine_kernel(M, L, O, Out, MF, LF, NB,
                        G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, NB_POW2: tl.constexpr):
        # Loops run to the constexpr NB_POW2 (next power of two of NB) with NB in the masks: a loop
        # bound must not be a runtime scalar, which triton 3.6's interpreter holds as an array
        # (range() over it fails there); one compiled variant per power of two.
        h = tl.program_id(0)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < G
        mask_d = offs_d < D
        rows = h * G + offs_g
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for start in range(0, NB_POW2, BLOCK_B):
            offs_b = start + tl.arange(0, BLOCK_B)
            mb = tl.load(M + rows[:, None] * NB + offs_b[None, :],
                         mask=mask_g[:, None] & (offs_b < NB)[None, :], other=float("-inf"))
            m = tl.maximum(m, tl.max(mb, axis=1))
        m = tl.where(mask_g, m, 0.0)                             # padded heads: keep the math finite
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for b in range(0, NB_POW2):
            live = mask_g & (b < NB)                             # blocks past NB weigh exp(-inf) = 0
            w = tl.exp(tl.load(M + rows * NB + b, mask=live, other=float("-inf")) - m)
            total += w * tl.load(L + rows * NB + b, mask=live, other=0.0)
            acc += w[:, None] * tl.load(O + (rows[:, None] * NB + b) * D + offs_d[None, :],
                                        mask=live[:, None] & mask_d[None, :], other=0.0)
        total = tl.where(mask_g, total, 1.0)
        out = acc / total[:, None]
        tl.store(Out + rows[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_g[:, None] & mask_d[None, :])
        tl.store(MF + rows, m, mask=mask_g)
        tl.store(LF + rows, total, mask=mask_g)

    @triton.jit
    def _mass_kernel(S, MF, LF, Mass, T, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr):
        h = tl.program_id(0)
        b = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_t = b * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_g = offs_g < G
        mask_t = offs_t < T
        rows = h * G + offs_g
        s = tl.load(S + rows[:, None] * T + offs_t[None, :], mask=mask_g[:, None] & mask_t[None, :],
                    other=float("-inf"))                                                      # [BG, BT]
        m = tl.load(MF + rows, mask=mask_g, other=0.0)
        total = tl.load(LF + rows, mask=mask_g, other=1.0)
        p = tl.exp(s - m[:, None]) / total[:, None]
        tl.store(Mass + h * T + offs_t, tl.sum(p, axis=0), mask=mask_t)


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q: [H_q, D]; k, v: [H_kv, T, D] (last dim contiguous; heap-buffer views are fine).
    Returns out [H_q, D] (q's dtype) and mass [H_kv, T] float32."""
    assert AVAILABLE, "triton is not installed"
    Hq, D = q.shape
    H, T, _ = k.shape
    assert Hq % H == 0 and T >= 1 and v.shape == k.shape, (q.shape, k.shape, v.shape)
    G = Hq // H
    q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    NB = triton.cdiv(T, BLOCK_T)
    BLOCK_G = max(16, triton.next_power_of_2(G))   # tl.dot wants >= 16 rows
    BLOCK_D = max(16, triton.next_power_of_2(D))
    f32 = dict(device=q.device, dtype=torch.float32)
    scores = torch.empty(Hq, T, **f32)                                # [H_kv * G, T]
    part_m, part_l = torch.empty(Hq, NB, **f32), torch.empty(Hq, NB, **f32)
    part_o = torch.empty(Hq, NB, D, **f32)
    out = torch.empty(Hq, D, device=q.device, dtype=q.dtype)
    final_m, final_l = torch.empty(Hq, **f32), torch.empty(Hq, **f32)
    mass = torch.empty(H, T, **f32)
    _partial_kernel[(H, NB)](q, k, v, scores, part_m, part_l, part_o, float(scale), T, NB,
                             k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_T=BLOCK_T)
    _combine_kernel[(H,)](part_m, part_l, part_o, out, final_m, final_l, NB,
                          G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_B=64,
                          NB_POW2=triton.next_power_of_2(NB))
    _mass_kernel[(H, NB)](scores, final_m, final_l, mass, T, G=G, BLOCK_G=BLOCK_G, BLOCK_T=BLOCK_T)
    return out, mass
