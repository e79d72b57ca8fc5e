"""Decode attention + per-key mass: references against naive softmax attention; kernels where hardware exists."""

import importlib.util
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from localheap.kernels.decode_attention import torch_ops
from localheap.kernels.dispatch import CheckedKernel

try:   # a CUDA machine has no mlx: its tests skip, the torch ones still run
    import mlx.core as mx

    from localheap.kernels.decode_attention import mlx_ops
except ImportError:
    mx = mlx_ops = None
needs_mlx = pytest.mark.skipif(mx is None, reason="mlx is not installed")

SHAPES = [(T, G, D) for T in (1, 17, 1000) for G in (1, 2, 4) for D in (64, 128)]
H_KV = 2
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MLX_DTYPES = {name: getattr(mx, name) if mx else None for name in ("float32", "float16", "bfloat16")}
OUT_TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}   # output rounding to the dtype


def naive(q, k, v, scale):
    """float64, one query head at a time. q: [H_q, D]; k, v: [H_kv, T, D]."""
    Hq, H = q.shape[0], k.shape[0]
    out, mass = np.zeros((Hq, v.shape[-1])), np.zeros(k.shape[:2])
    for i in range(Hq):
        h = i // (Hq // H)
        s = k[h] @ q[i] * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        out[i] = p @ v[h]
        mass[h] += p
    return out, mass


def torch_inputs(T, G, D, dtype, device="cpu", seed=0):
    """q [H_q, D] and views [H_kv, T, D] into heap-like buffers with spare capacity (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(H_KV * G, D, generator=gen)
    k_buf, v_buf = torch.randn(1, H_KV, T + 7, D, generator=gen), torch.randn(1, H_KV, T + 7, D, generator=gen)
    q, k_buf, v_buf = (x.to(device=device, dtype=dtype) for x in (q, k_buf, v_buf))
    return q, k_buf[0, :, :T], v_buf[0, :, :T]


def as64(*xs):
    return [x.double().cpu().numpy() for x in xs]


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("T,G,D", SHAPES)
def test_torch_reference_matches_naive(T, G, D, dtype):
    q, k, v = torch_inputs(T, G, D, TORCH_DTYPES[dtype])
    out, mass = torch_ops.reference(q, k, v, D ** -0.5)
    assert out.dtype == q.dtype and out.shape == q.shape and mass.dtype == torch.float32
    want_out, want_mass = naive(*as64(q, k, v), D ** -0.5)
    np.testing.assert_allclose(out.double().numpy(), want_out, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    np.testing.assert_allclose(mass.double().numpy(), want_mass, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(mass.sum(dim=1).numpy(), G, rtol=1e-5)


@needs_mlx
@pytest.mark.parametrize("dtype", list(MLX_DTYPES))
@pytest.mark.parametrize("T,G,D", SHAPES)
def test_mlx_reference_matches_naive(T, G, D, dtype):
    q, k, v = torch_inputs(T, G, D, torch.float32)
    cap_k = np.concatenate([k.numpy(), np.ones((H_KV, 5, D), np.float32)], axis=1)   # junk beyond n_keys
    cap_v = np.concatenate([v.numpy(), np.ones((H_KV, 5, D), np.float32)], axis=1)
    mq, mk, mv = (mx.array(x).astype(MLX_DTYPES[dtype]) for x in (q.numpy(), cap_k, cap_v))
    out, mass = mlx_ops.reference(mq, mk, mv, D ** -0.5, T)
    assert out.dtype == mq.dtype and mass.shape == (H_KV, T) and mass.dtype == mx.float32
    rounded = [np.array(x.astype(mx.float32)).astype(np.float64) for x in (mq, mk[:, :T], mv[:, :T])]
    want_out, want_mass = naive(*rounded, D ** -0.5)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), want_out, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    np.testing.assert_allclose(np.array(mass), want_mass, atol=1e-5, rtol=1e-5)


def test_cpu_dispatch_is_the_reference():
    q, k, v = torch_inputs(33, 4, 64, torch.float32)
    got, want = torch_ops.decode_attention(q, k, v, 0.125), torch_ops.reference(q, k, v, 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_mlx
@pytest.mark.skipif(mx is not None and mlx_ops.kernel_available(), reason="checks the fallback where Metal is absent")
def test_mlx_dispatch_without_metal_is_the_reference():
    q, k = mx.ones((4, 64)), mx.ones((2, 40, 64))
    got, want = mlx_ops.decode_attention(q, k, k, 0.125, 33), mlx_ops.reference(q, k, k, 0.125, 33)
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()


def test_checked_kernel_trusts_only_what_agreed(caplog):
    calls = []

    def reference(x):
        return x * 2

    def good(x):
        calls.append(x)
        return x * 2

    def wrong(x):
        return x * 3

    def broken(x):
        raise RuntimeError("does not compile")

    def agree(a, b, key):
        return a == b

    with caplog.at_level(logging.INFO, logger="localheap.kernels"):
        checked = CheckedKernel("good", good, reference, agree)
        assert [checked("k", 1), checked("k", 2)] == [2, 4] and calls == [1, 2]
        assert checked.trusted("k") is True
        checked = CheckedKernel("wrong", wrong, reference, agree)
        assert [checked("k", 1), checked("k", 2)] == [2, 4] and checked.trusted("k") is False
        checked = CheckedKernel("broken", broken, reference, agree)
        assert checked("k", 5) == 10 and checked.trusted("k") is False
    text = caplog.text
    assert "wrong kernel disagrees" in text and "broken kernel failed" in text and "does not compile" in text


@pytest.mark.skipif(not torch_ops.kernel_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("T,G,D", SHAPES)
def test_triton_kernel_matches_reference(T, G, D, dtype):
    from localheap.kernels.decode_attention.triton_kernel import decode_attention_triton

    q, k, v = torch_inputs(T, G, D, TORCH_DTYPES[dtype], device="cuda")
    got, want = decode_attention_triton(q, k, v, D ** -0.5), torch_ops.reference(q, k, v, D ** -0.5)
    assert torch_ops._agree(got, want, ("cuda", q.dtype))
    torch_ops.decode_attention(q, k, v, D ** -0.5)
    assert torch_ops.TRITON.trusted(("cuda:0", q.dtype, G, D)) is True


_INTERPRETER_CHECK = """
import torch
from localheap.kernels.decode_attention import torch_ops, triton_kernel
for T, G, D, dtype in [(1, 1, 64, torch.float32), (17, 2, 128, torch.float16), (150, 4, 64, torch.bfloat16)]:
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(2 * G, D, generator=gen).to(dtype)
    k, v = (torch.randn(2, T + 3, D, generator=gen).to(dtype)[:, :T] for _ in range(2))
    got = triton_kernel.decode_attention_triton(q, k, v, D ** -0.5)
    assert torch_ops._agree(got, torch_ops.reference(q, k, v, D ** -0.5), ("cpu", dtype)), (T, G, D, dtype)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_logic_in_the_interpreter():
    """Triton's CPU interpreter runs the same kernel source: catches indexing and masking bugs without a GPU."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@needs_mlx
@pytest.mark.skipif(mx is None or not mlx_ops.kernel_available(), reason="needs Metal")
@pytest.mark.parametrize("dtype", list(MLX_DTYPES))
@pytest.mark.parametrize("T,G,D", SHAPES)
def test_metal_kernel_matches_reference(T, G, D, dtype):
    from localheap.kernels.decode_attention.metal_kernel import decode_attention_metal

    q, k, v = torch_inputs(T, G, D, torch.float32)
    mq, mk, mv = (mx.array(x.contiguous().numpy()).astype(MLX_DTYPES[dtype]) for x in (q, k, v))
    got = decode_attention_metal(mq, mk, mv, D ** -0.5, T)
    want = mlx_ops.reference(mq, mk, mv, D ** -0.5, T)
    assert mlx_ops._agree(got, want, (mq.dtype,))
    mlx_ops.decode_attention(mq, mk, mv, D ** -0.5, T)
    assert mlx_ops.METAL.trusted((mq.dtype, G, D)) is True
