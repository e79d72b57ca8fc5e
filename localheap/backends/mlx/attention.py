"""The one patch: mlx-lm's attention call, so heap caches see the queries.

Outputs come from mlx-lm's own function (the fused kernel), bit for bit; a heap
cache then scores the keys in a side pass. Any other cache is untouched.
"""

from __future__ import annotations

import sys

from mlx_lm.models import base

from .cache import HeapKVCache

_stock_sdpa = base.scaled_dot_product_attention


def heap_sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
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
