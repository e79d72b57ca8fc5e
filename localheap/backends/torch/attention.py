"""The one hook: an attention function registered in transformers' own AttentionInterface.

Outputs come from transformers' stock function, bit for bit: sdpa, or the model's own eager
attention where transformers has no sdpa for it (gpt-oss: its learned sinks sit in the
softmax). A heap layer then scores the keys in a side pass over the same q/k. The model finds
the heap through the `heap=` keyword the generation loop passes to forward (transformers
forwards unknown keywords down to the attention function). Without it, this is stock attention.
"""

from __future__ import annotations

import inspect
import sys
from functools import lru_cache

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ...kernels.decode_attention.torch_ops import decode_attention
from .layer import HeapLayer

ATTN_IMPLEMENTATION = "localheap_sdpa"
ATTN_EAGER = "localheap_eager"   # the same hook over a model's own eager attention (no sdpa for it)


def stock_implementation(model) -> str:
    """What transformers itself runs this model with: sdpa where it has it, else eager."""
    return "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"


def heap_implementation(model) -> str:
    """The hook over `model`'s stock attention (a model or its class)."""
    return ATTN_IMPLEMENTATION if stock_implementation(model) == "sdpa" else ATTN_EAGER


def load_implementation(path) -> str:
    """heap_implementation of the model class transformers will build for the checkpoint at `path`
    (from_pretrained refuses an sdpa-named function for a model without sdpa)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return heap_implementation(cls) if cls is not None else ATTN_IMPLEMENTATION


def heap_sdpa(module, query, key, value, attention_mask, heap=None, **kwargs):
    """query: [1, H_q, L, D] rotated at the model-wide positions; key/value: [1, H_kv, T, D]
    as the cache layer returned them. Returns (output [1, L, H_q, D], None) like stock sdpa.
    A packed step (batch.py) attends segment by segment, each over its own heap."""
    if getattr(heap, "packed", False):
        return heap.attend(module, query, **kwargs), None
    return _heap_sdpa(module, query, key, value, attention_mask, heap, **kwargs)


def heap_eager(module, query, key, value, attention_mask, heap=None, **kwargs):
    """heap_sdpa over the model's own eager attention (gpt-oss: its learned sinks); a packed step
    attends each part through it too."""
    if getattr(heap, "packed", False):
        return heap.attend(module, query, stock=_eager(type(module)), **kwargs), None
    return _heap_sdpa(module, query, key, value, attention_mask, heap, stock=_eager(type(module)), **kwargs)


@lru_cache(maxsize=None)
def _eager(cls):
    """The eager attention function of the modeling file `cls` comes from (gpt-oss's adds its sinks)."""
    return sys.modules[cls.__module__].eager_attention_forward


def _heap_sdpa(module, query, key, value, attention_mask, heap=None, stock=sdpa_attention_forward, **kwargs):
    """One heap's attention (also one segment of a packed step)."""
    layer = heap.layers[module.layer_idx] if heap is not None else None
    if layer is not None and layer.rope_delta:
        query = layer.rope.rotate(query, layer.rope_delta)   # this layer's own position
    if not isinstance(layer, HeapLayer):
        return stock(module, query, key, value, attention_mask, **kwargs)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    if heap.fused_decode and stock is sdpa_attention_forward and query.shape[2] == 1 \
            and layer.heap.cfg.needs_attention and heap.capture is None:
        return _fused_decode(layer, query, key, value, scale), None
    attention_mask = _layer_mask(attention_mask, query.shape[2], key.shape[2], query.device,
                                 None if stock is sdpa_attention_forward else query.dtype)
    out, weights = stock(module, query, key, value, attention_mask, **kwargs)
    if heap.capture is not None:   # a recall probe: keep this layer's queries, observe nothing
        heap.capture[layer.heap.layer] = layer.pre_rope_queries(query)
        return out, weights
    layer.observe(query, key, scale)
    return out, weights


def _layer_mask(mask, L: int, T: int, device, eager_dtype=None):
    """The model sizes one mask by its first heap layer; with pyramid budgets other heap layers
    hold other lengths, so theirs is rebuilt (causal in slot space) by transformers' own builder
    (eager attention's additive float mask where `eager_dtype` is given)."""
    if L == 1 or (mask.shape[-1] == T if mask is not None else T == L):
        return mask
    if eager_dtype is not None:
        return eager_mask(batch_size=1, q_length=L, kv_length=T, q_offset=T - L, device=device, dtype=eager_dtype)
    return sdpa_mask(batch_size=1, q_length=L, kv_length=T, q_offset=T - L, device=device)


def _fused_decode(layer: HeapLayer, query, key, value, scale: float):
    """One pass for output and scores (kernels/decode_attention); not bit-identical to stock sdpa."""
    Hq, D = query.shape[1], query.shape[3]
    out, mass = decode_attention(query[0, :, 0, :], key[0], value[0], scale)   # out: [H_q, D], mass: [H_kv, T]
    layer.accumulate(mass, 1, Hq // key.shape[1], new_window=False)
    return out.view(1, 1, Hq, D)


def install(model) -> None:
    """Register the functions (and the stock mask builders under their names); point `model` at
    the one over its stock attention."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, heap_sdpa)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    AttentionInterface.register(ATTN_EAGER, heap_eager)
    AttentionMaskInterface.register(ATTN_EAGER, eager_mask)
    if model is not None and model.config._attn_implementation != heap_implementation(model):
        model.set_attn_implementation(heap_implementation(model))


def cache_kwarg(model, cache) -> dict:
    """The KV cache as the model's forward takes it: `cache=` where it has that argument
    (transformers 5.24 renamed it; `past_key_values` warns there and goes in 5.40), else
    `past_key_values=`. Read from the forward's signature once per class."""
    kind = type(model)
    name = _CACHE_ARG.get(kind)
    if name is None:
        params = inspect.signature(kind.forward).parameters
        name = _CACHE_ARG[kind] = "cache" if "cache" in params else "past_key_values"
    return {name: cache}


_CACHE_ARG: dict = {}
