"""A lean decode step for Llama-shaped transformers models: the same ops, without the module glue.

transformers' forward costs about as much host time as the arithmetic of one decode token on a
small model (module calls, keyword plumbing, mask building, output objects). This step runs the
model's own ops in its own order (embedding, its rotary module, RMSNorm as LlamaRMSNorm computes
it, apply_rotary_pos_emb, the heap layer's update, the heap attention function, the MLP), so its
logits are transformers' bit for bit (tests/test_torch_lean_decode.py holds it to that). It knows
the Llama family's layer layout (LeanDecode) and phi3's and glm4's (LeanFusedDecode); anything else
keeps the full forward. Each model's lean step is checked once against its full forward (`agrees`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ...kernels.dispatch import CheckedKernel
from . import attention

log = logging.getLogger("localheap.torch")
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
FUSED_FAMILIES = ("Phi3ForCausalLM", "Glm4ForCausalLM")   # LeanFusedDecode
ENABLED = os.environ.get("LOCALHEAP_LEAN_DECODE", "1") != "0"   # 0: every step through the full forward
BATCH_GEMM = os.environ.get("LOCALHEAP_BATCH_GEMM", "onednn")     # aten: a batch's matmuls as one session's
ONEDNN_MIN_WEIGHTS = 1 << 20   # batch_linear: oneDNN for weights of this many elements or more


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's ops in its order (float32 variance, weight times the input-dtype result)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _close(got: torch.Tensor, want: torch.Tensor, key) -> bool:
    """Another summation order over the same float32 products: ulps of the largest output."""
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-5 * (1.0 + want.abs().max()))


_ONEDNN = CheckedKernel("oneDNN batch linear", _onednn, F.linear, _close)


def _checked_onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if weight.numel() < ONEDNN_MIN_WEIGHTS:
        return F.linear(x, weight, bias)
    return _ONEDNN((tuple(weight.shape), bias is not None), x, weight, bias)


def batch_linear(weight: torch.Tensor) -> Callable:
    """The matmul of a packed step that carries several sessions' tokens, for a model whose weights
    are like `weight`. aten's `linear` on the CPU (MKL's sgemm) takes a few rows little better than
    many: on 2 cores, 8 rows of an 8,192 x 2,048 float32 projection took 3.4x one row's time, where
    oneDNN's linear on the same weights (as they are: no packed copy) took 1.4x; a step of 8
    sessions of a Llama-3.2-1B-shaped model 1,099 ms against 513 (docs/serve_bench.md, "Fourteenth
    round"). So on the CPU a batch's large matmuls go to oneDNN, each weight shape checked once
    against aten (another summation order: ulps, inside the batch's logits tolerance); small ones
    (under ONEDNN_MIN_WEIGHTS elements) stay aten's, where oneDNN's ~50 us a call costs more than
    it saves. One session's step keeps aten's, the op stock transformers runs, so its tokens stay
    stock's bit for bit."""
    if BATCH_GEMM == "onednn" and weight.device.type == "cpu" and weight.dtype == torch.float32 and _has_onednn():
        return _checked_onednn
    return F.linear


@functools.cache
def _has_onednn() -> bool:   # asked once per process, not at every step
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class LeanDecode:
    """One decode token through a Llama-shaped model over a heap cache."""

    FAMILIES = FAMILIES
    MLP = ("gate_proj", "up_proj", "down_proj")   # bias-free in the families it takes

    def __init__(self, model):
        from importlib import import_module

        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.head = model.lm_head
        self.rope = import_module(type(model).__module__).apply_rotary_pos_emb
        self.layers = [self._layer(layer) for layer in inner.layers]

    @staticmethod
    def _layer(layer) -> tuple:
        a, m = layer.self_attn, layer.mlp
        return (
            a, (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            (a.q_proj.weight, a.q_proj.bias), (a.k_proj.weight, a.k_proj.bias), (a.v_proj.weight, a.v_proj.bias),
            (a.o_proj.weight, a.o_proj.bias),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, m.act_fn,
        )

    @classmethod
    def supports(cls, model) -> bool:
        if type(model).__name__ not in cls.FAMILIES or model.training:
            return False
        cfg = model.config
        mlp = model.model.layers[0].mlp
        return (getattr(cfg, "layer_types", None) in (None, ["full_attention"] * cfg.num_hidden_layers)
                and all(getattr(mlp, n).bias is None for n in cls.MLP))

    def __call__(self, cache, token: torch.Tensor) -> torch.Tensor:
        """token: [1] id on the device. Returns the next logits [vocab] fp32 (what generate.forward returns)."""
        cache.make_room(1)
        pos = cache.position_ids(1)                                   # [1, 1]; sets each layer's rope_delta
        logits = self.run(cache, token[None], pos, None)
        return logits[0, -1].to(dtype=torch.float32, copy=True)

    def run(self, cache, ids: torch.Tensor, pos: torch.Tensor, keep: Optional[torch.Tensor],
            linear: Callable = F.linear) -> torch.Tensor:
        """ids, pos: [1, N]; cache: a heap cache or a packed step (batch.PackedStep), room made and
        rope deltas set. Returns the logits [1, K, vocab] in the model's dtype of the last position
        (keep None) or of the positions in `keep` [K] (transformers' logits_to_keep). `linear`: the
        projections' matmul (batch_linear for a step of several sessions)."""
        N = ids.shape[1]
        with torch.no_grad():
            h = self.embed(ids)                                       # [1, N, hidden]
            cos, sin = self.rotary(h, pos)
            for i, (a, ln1, q, k, v, o, ln2, gate, up, down, act) in enumerate(self.layers):
                x = _rms_norm(h, *ln1)
                shape = (1, N, -1, a.head_dim)
                qs = linear(x, *q).view(shape).transpose(1, 2)      # [1, H_q, N, D]
                ks = linear(x, *k).view(shape).transpose(1, 2)      # [1, H_kv, N, D]
                vs = linear(x, *v).view(shape).transpose(1, 2)
                qs, ks = self.rope(qs, ks, cos, sin)
                ks, vs = cache.layers[i].update(ks, vs)
                out, _ = attention.heap_sdpa(a, qs, ks, vs, None, heap=cache, dropout=0.0, scaling=a.scaling)
                h = h + linear(out.reshape(1, N, -1).contiguous(), *o)
                x = _rms_norm(h, *ln2)
                h = h + linear(act(linear(x, gate)) * linear(x, up), down)
            h = _rms_norm(h, *self.norm)
            return linear(h[:, -1:, :] if keep is None else h[:, keep, :], self.head.weight, self.head.bias)


class LeanFusedDecode(LeanDecode):
    """The lean step of phi3 (Phi-3, Phi-4-mini: q, k and v in one projection) and glm4 (GLM-4-0414:
    biased q, k and v; norms after attention and after the MLP too): gate and up in one projection
    (`gate, up = chunk(2)`, then `up * act(gate)`), each model's ops in its order. Their partial RoPE
    is the model's own apply_rotary_pos_emb, as in every lean step."""

    FAMILIES = FUSED_FAMILIES
    MLP = ("gate_up_proj", "down_proj")

    @staticmethod
    def _layer(layer) -> tuple:
        a, m = layer.self_attn, layer.mlp
        norm = lambda n: (n.weight, n.variance_epsilon) if n is not None else None   # noqa: E731
        if hasattr(a, "qkv_proj"):   # phi3: split by the config's head counts, as its attention does
            q_size = a.config.num_attention_heads * a.head_dim
            qkv = (a.qkv_proj.weight, a.qkv_proj.bias, q_size, q_size + a.num_key_value_heads * a.head_dim)
            q = k = v = None
        else:
            qkv = None
            q, k, v = ((p.weight, p.bias) for p in (a.q_proj, a.k_proj, a.v_proj))
        return (a, norm(layer.input_layernorm), qkv, q, k, v, (a.o_proj.weight, a.o_proj.bias),
                norm(getattr(layer, "post_self_attn_layernorm", None)), norm(layer.post_attention_layernorm),
                m.gate_up_proj.weight, m.down_proj.weight, m.activation_fn, norm(getattr(layer, "post_mlp_layernorm", None)))

    def run(self, cache, ids: torch.Tensor, pos: torch.Tensor, keep: Optional[torch.Tensor],
            linear: Callable = F.linear) -> torch.Tensor:
        """LeanDecode.run for these layouts."""
        N = ids.shape[1]
        with torch.no_grad():
            h = self.embed(ids)                                       # [1, N, hidden]
            cos, sin = self.rotary(h, pos)
            for i, (a, ln1, qkv, q, k, v, o, post_attn, ln2, gate_up, down, act, post_mlp) in enumerate(self.layers):
                x = _rms_norm(h, *ln1)
                shape = (1, N, -1, a.head_dim)
                if qkv is not None:
                    fused = linear(x, qkv[0], qkv[1])
                    qf, kf, vf = fused[..., :qkv[2]], fused[..., qkv[2]:qkv[3]], fused[..., qkv[3]:]
                else:
                    qf, kf, vf = linear(x, *q), linear(x, *k), linear(x, *v)
                qs, ks = self.rope(qf.view(shape).transpose(1, 2), kf.view(shape).transpose(1, 2), cos, sin)
                vs = vf.view(shape).transpose(1, 2)
                ks, vs = cache.layers[i].update(ks, vs)
                out, _ = attention.heap_sdpa(a, qs, ks, vs, None, heap=cache, dropout=0.0, scaling=a.scaling)
                out = linear(out.reshape(1, N, -1).contiguous(), *o)
                h = h + (_rms_norm(out, *post_attn) if post_attn is not None else out)
                x = _rms_norm(h, *ln2)
                g, up = linear(x, gate_up).chunk(2, dim=-1)
                out = linear(up * act(g), down)
                h = h + (_rms_norm(out, *post_mlp) if post_mlp is not None else out)
            h = _rms_norm(h, *self.norm)
            return linear(h[:, -1:, :] if keep is None else h[:, keep, :], self.head.weight, self.head.bias)


def lean_step(model, cache) -> Optional[LeanDecode]:
    """The model's lean step when this cache can take it (heap layers only, no recall probe, no
    packed batch), else None: the caller runs the full forward."""
    if not _takes_lean(model, cache):
        return None
    lean = _lean(model)
    if type(lean) is LeanDecode and getattr(cache, "compile_decode", False):   # compiled.py: Llama's layout
        from .compiled import compiled_step

        return compiled_step(model) or lean
    return lean


def lean_packed(model, caches: list) -> Optional[LeanDecode]:
    """The lean forward for a packed step (batch.py) whose every heap could take the lean step
    on its own, else None."""
    if not caches or not all(_takes_lean(model, c) for c in caches):
        return None
    lean = _lean(model)
    if type(lean) is LeanDecode and all(getattr(c, "compile_decode", False) for c in caches):
        from .compiled import compiled_packed

        return compiled_packed(model) or lean
    return lean


def lean_static(model, caches: list) -> Optional[LeanDecode]:
    """The plain lean forward (never the compiled one) where lean_packed would run one: what a
    static step (graphed.py) records into a CUDA graph."""
    return _lean(model) if caches and all(_takes_lean(model, c) for c in caches) else None


def _takes_lean(model, cache) -> bool:
    return (ENABLED and getattr(cache, "lean_decode", True) and cache.capture is None and cache.only_heap_layers
            and not getattr(cache, "packed", False) and model.config._attn_implementation == attention.ATTN_IMPLEMENTATION)


def _lean(model) -> Optional[LeanDecode]:
    lean = model.__dict__.get("_localheap_lean", False)
    if lean is False:
        kind = next((k for k in (LeanDecode, LeanFusedDecode) if k.supports(model)), None)
        lean = kind(model) if kind is not None else None
        model.__dict__["_localheap_lean"] = lean   # set before the check: its own steps find it
        if lean is not None and not agrees(model):
            log.warning("the lean decode step's logits differ from transformers' forward on this model, device "
                        "and dtype; every decode step goes through the full forward")
            lean = model.__dict__["_localheap_lean"] = None
    return lean


def agrees(model, n: int = 9, setting: str = "lean_decode") -> bool:
    """Whether the lean step gives the full forward's logits bit for bit here (this device, dtype
    and kernels: the tests hold it on the CPU only), on a scratch heap: n - 1 tokens fed, then
    the n-th token through each path on its own copy of that heap. Run once per model.
    setting="compile_decode": the compiled step (compiled.py) against the lean one, the same way."""
    from ...heap import HeapConfig
    from .cache import make_heap_cache
    from .generate import forward

    ids = torch.arange(n, device=model.device) % model.config.vocab_size
    logits = []
    for on in (False, True):
        # absolute positions: nothing here moves a key, and a RoPE no key can move (longrope) runs too
        cache = make_heap_cache(model, HeapConfig(budget=64, recent=8, slack=16, recall=False, positions="absolute"))
        cache.lean_decode = setting != "lean_decode"
        forward(model, cache, ids[:-1])
        setattr(cache, setting, on)
        logits.append(forward(model, cache, ids[-1:]))
    return torch.equal(*logits)
