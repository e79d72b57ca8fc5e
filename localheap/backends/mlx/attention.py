"""The one patch: mlx-lm's attention call, so heap caches see the queries.

Outputs are always mlx-lm's own, bit for bit. Two ways to get the heap its scores:
- `explicit`: where the explicit formulation (scale, matmul, mask, precise softmax,
  matmul) is proven bit-identical to mx.fast.scaled_dot_product_attention on this
  device (the CPU backend's fallback is exactly that), attention is computed that
  way and its probabilities are reused: scoring costs no second pass.
- `side pass`: elsewhere (Metal's fused kernel), the stock call computes outputs and
  the cache scores the keys against the same queries in a cheaper side pass.
"""

from __future__ import annotations

import logging
import sys
from functools import lru_cache

import mlx.core as mx
from mlx_lm.models import base

from .cache import HeapKVCache

log = logging.getLogger("localheap.mlx")
_stock_sdpa = base.scaled_dot_product_attention


def explicit_attention(queries, keys, values, scale: float, mask):
    """Attention as mlx's unfused fallback computes it. Returns (out [B,Hq,L,Dv],
    probs [B,H_kv,G,L,T])."""
    B, Hq, L, D = queries.shape
    H = keys.shape[1]
    G = Hq // H
    q = mx.array(scale, queries.dtype) * queries
    if G > 1:
        q = q.reshape(B, H, G, L, D)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ keys.swapaxes(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            kL, qL = keys.shape[-2], q.shape[-2]
            off = max(0, kL - qL)
            mask = mx.arange(off, off + qL)[:, None] >= mx.arange(kL)[None]
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs @ values
    if G > 1:
        out = out.reshape(B, Hq, L, -1)
    return out, probs.reshape(B, H, G, L, -1)


@lru_cache(maxsize=None)
def explicit_matches_stock(dtype_name: str, device: str) -> bool:
    """Self-check on this device: is explicit_attention bit-identical to the fused call?"""
    dtype = getattr(mx, dtype_name)
    key = mx.random.key(1234)
    for hq, h, L, T, D in ((8, 2, 1, 77, 64), (4, 4, 1, 300, 128), (8, 2, 24, 130, 64), (4, 1, 7, 7, 16)):
        kq, kk, kv = mx.random.split(key, 3)
        q = mx.random.normal((1, hq, L, D), key=kq).astype(dtype)
        k = mx.random.normal((1, h, T, D), key=kk).astype(dtype)
        v = mx.random.normal((1, h, T, D), key=kv).astype(dtype)
        mask = "causal" if L > 1 else None
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
        got, _ = explicit_attention(q, k, v, D ** -0.5, mask)
        if not mx.array_equal(want, got).item():
            log.info("attention scores: side pass (explicit attention differs from the fused kernel on %s)", device)
            return False
    log.info("attention scores: from the attention itself (explicit == fused, bit for bit, on %s)", device)
    return True


def heap_sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
    rows = getattr(cache, "attend_rows", None)
    if rows is not None:   # a decode batch's layer (batch.py): each row over its own heap
        return rows(queries, scale, sinks=sinks, **kwargs)
    if isinstance(cache, HeapKVCache) and cache.heap.cfg.needs_attention and sinks is None \
            and not kwargs and explicit_matches_stock(str(queries.dtype).split(".")[-1], str(mx.default_device())):
        out, probs = explicit_attention(queries, keys, values, scale, mask)
        cache.observe(queries, keys, scale, probs=probs)
        return out
    if sinks is not None:
        kwargs["sinks"] = sinks
    out = _stock_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
    if isinstance(cache, HeapKVCache):
        cache.observe(queries, keys, scale)
    return out


def install() -> int:
    """Point every loaded mlx-lm model module at heap_sdpa; returns how many were patched."""
    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _stock_sdpa:
            module.scaled_dot_product_attention = heap_sdpa
            patched += 1
    return patched
