"""A decode step whose per-token parts are mx.compile'd; the heap's append and attention are not.

mlx-lm's forward builds the step's graph op by op in Python. This step runs the same modules in
the same order (mlx-lm's Llama-shaped TransformerBlock: llama, mistral, qwen2), with each layer's
input norm, projections and rotary in one compiled function, and its output projection, residual,
norm and MLP in another (the layer's weights are captured as constants; the rotary offset is an
input, so one trace serves every step). Between them the heap's cache (`update_and_fetch`) and
attention function (attention.heap_sdpa: outputs, scores) run as they always do: the resident
length changes every step, so they stay outside the compiled graphs. `compiled_step` checks once
per model that the step's logits are mlx-lm's forward's bit for bit, and keeps the forward if not.
Opt-in (`--compile-decode`).
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx

from . import attention

log = logging.getLogger("localheap.mlx")
FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.mistral", "mlx_lm.models.qwen2")


def supports(model) -> bool:
    inner = getattr(model, "model", None)
    return (type(model).__module__ in FAMILIES and inner is not None and hasattr(inner, "embed_tokens")
            and all(not getattr(layer, "use_sliding", False) and hasattr(layer, "self_attn")
                    for layer in inner.layers))


class CompiledDecode:
    """One decode token through a Llama-shaped mlx-lm model over a heap, per-token parts compiled."""

    def __init__(self, model):
        self.model = model
        inner = model.model
        self.layers = list(inner.layers)
        self.embed = mx.compile(inner.embed_tokens)
        self.pre = [mx.compile(_pre(layer)) for layer in self.layers]
        self.post = [mx.compile(_post(layer)) for layer in self.layers]
        tied = getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head")
        head = inner.embed_tokens.as_linear if tied else model.lm_head
        self.last = mx.compile(lambda h: head(inner.norm(h))[:, -1, :])

    def __call__(self, cache, tokens: mx.array) -> mx.array:
        """tokens: [1] id. Returns the last position's logits [1, vocab] (what model(...)[:, -1, :] gives)."""
        cache.make_room(1)
        h = self.embed(tokens[None])                                 # [1, 1, hidden]
        for layer, c, pre, post in zip(self.layers, cache, self.pre, self.post):
            q, k, v = pre(h, mx.array(c.offset))                     # [1, H, 1, D], rotated at the layer's offset
            k, v = c.update_and_fetch(k, v)
            out = attention.heap_sdpa(q, k, v, c, layer.self_attn.scale, None)
            h = post(h, out)
        return self.last(h)


def _pre(layer):
    a = layer.self_attn

    def pre(x, offset):
        """x: [1, 1, hidden] -> rotated queries and keys, values [1, H, 1, D] (mlx-lm's Attention)."""
        y = layer.input_layernorm(x)
        q = a.q_proj(y).reshape(1, 1, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(y).reshape(1, 1, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = a.v_proj(y).reshape(1, 1, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return a.rope(q, offset=offset), a.rope(k, offset=offset), v
    return pre


def _post(layer):
    a = layer.self_attn

    def post(x, out):
        """x: the layer's input [1, 1, hidden], out: attention [1, H_q, 1, D] -> the layer's output."""
        h = x + a.o_proj(out.transpose(0, 2, 1, 3).reshape(1, 1, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))
    return post


def compiled_step(model, cache) -> Optional[CompiledDecode]:
    """The model's compiled step when this cache can take it (heap layers only, no recall probe),
    built and checked once per model; None: the caller runs mlx-lm's forward."""
    if not getattr(cache, "only_heap_layers", False) or any(c.capture is not None for c in cache):
        return None
    step = getattr(model, "_localheap_compiled", False)
    if step is False:
        step = CompiledDecode(model) if supports(model) else None
        object.__setattr__(model, "_localheap_compiled", step)   # not a module parameter
        if step is not None and not agrees(model, step):
            log.warning("--compile-decode: the compiled step's logits differ from mlx-lm's forward on this model "
                        "and device; every decode step goes through the forward")
            step = None
            object.__setattr__(model, "_localheap_compiled", None)
        elif step is None:
            log.warning("--compile-decode: %s is not a Llama-shaped mlx-lm model; the decode step stays uncompiled",
                        type(model).__module__)
    return step


def agrees(model, step: CompiledDecode, n: int = 9) -> bool:
    """Whether the compiled step gives mlx-lm's forward logits bit for bit here, on a scratch heap:
    n - 1 tokens fed, then the n-th through each path on its own copy of that heap."""
    from ...heap import HeapConfig
    from .heapcache import make_heap_cache

    ids = mx.arange(n, dtype=mx.uint32) % model.args.vocab_size
    logits = []
    for compiled in (False, True):
        # absolute positions, as lean.agrees: a RoPE no key can move (longrope, dynamic NTK) runs too
        cache = make_heap_cache(model, HeapConfig(budget=64, recent=8, slack=16, recall=False, positions="absolute"))
        cache.make_room(n - 1)
        model(ids[None, :-1], cache=cache)
        logits.append(step(cache, ids[-1:]) if compiled else _forward(model, cache, ids[-1:]))
        mx.eval(logits[-1])
    return mx.array_equal(*logits).item()


def _forward(model, cache, tokens: mx.array) -> mx.array:
    cache.make_room(tokens.shape[0])
    return model(tokens[None], cache=cache)[:, -1, :]
