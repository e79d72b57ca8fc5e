"""The lean decode step's per-token parts compiled ahead of time (AOTInductor), the heap outside.

A decode step of a small model spends more host time dispatching eager ops (norms, projections,
rotary, MLP, head: ~30 per layer) than doing their arithmetic. This module exports those parts as
three fixed-shape graphs, compiles each once with inductor into a C++ library, and calls them
between the heap's own work (append, attention, scoring, eviction), which stays eager and
unchanged:

- `first`:  token (and the eager rotary's cos, sin) -> h and layer 0's rotated q, k and v
- `middle`: layer i's output projection, residual, norm and MLP, then layer i + 1's norm,
            projections and rotary (one graph for every i: the weights are inputs)
- `last`:   the last layer's output projection and MLP, the final norm and the head

The weights are graph inputs, so the compiled code depends only on the model's shapes; it is
cached on disk by those shapes, the torch version and this file (`LOCALHEAP_COMPILE_CACHE`, default
~/.cache/localheap/compiled; the first use compiles: tens of seconds). RMSNorm's mean is left to
aten's own kernel (inductor's reduction sums in another order) and the rotary cos/sin are the eager
module's, so on the CPU the logits are the eager step's bit for bit; `compiled_step` checks that
once per model and keeps the eager step where it does not hold. Opt-in (`--compile-decode`) for the compile time
and the C++ compiler it needs. A packed step (batch.py: serve's and chat's decode batch with its
riding chunks) runs through three more graphs whose token count is a dynamic dimension
(`compiled_packed`), checked once the same way against the eager packed step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import attention
from .lean import LeanDecode, _rms_norm, agrees

log = logging.getLogger("localheap.torch")
_LOCK = threading.Lock()


def available() -> Optional[str]:
    """None when this torch can compile the step here, else why not (no C++ compiler, no inductor)."""
    try:
        from torch._inductor import aoti_compile_and_package, aoti_load_package  # noqa: F401
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:   # ImportError, or inductor's RuntimeError when no compiler is found
        return f"torch inductor cannot compile here ({type(e).__name__}: {e})"
    return None


class _Shape:
    """What the compiled graphs depend on: the model's shapes and constants, never its weights."""

    def __init__(self, lean: LeanDecode):
        a, ln1, q, *_ = lean.layers[0]
        self.head_dim = a.head_dim
        self.eps = (ln1[1], lean.layers[0][6][1], lean.norm[1])
        self.bias = q[1] is not None                       # q/k/v biases (qwen2)
        self.act = lean.layers[0][10]
        cfg = lean.model.config
        self.key = repr((type(lean.model).__name__, cfg.hidden_size, cfg.intermediate_size,
                         cfg.num_attention_heads, cfg.num_key_value_heads, a.head_dim, cfg.vocab_size, self.eps,
                         self.bias, type(self.act).__name__, str(lean.head.weight.dtype),
                         str(lean.head.weight.device), torch.__version__,
                         hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]))


def _qkv(s: _Shape, h, ln, qw, kw, vw, qb, kb, vb, cos, sin, rope):
    """Layer input norm, projections and rotary: the lean step's ops (h: [1, N, hidden])."""
    x = _rms_norm(h, ln, s.eps[0])
    shape = (1, h.shape[1], -1, s.head_dim)
    qs = F.linear(x, qw, qb).view(shape).transpose(1, 2)    # [1, H_q, N, D]
    ks = F.linear(x, kw, kb).view(shape).transpose(1, 2)    # [1, H_kv, N, D]
    vs = F.linear(x, vw, vb).view(shape).transpose(1, 2)
    qs, ks = rope(qs, ks, cos, sin)
    return qs, ks, vs


def _mlp(s: _Shape, h, out, ow, ob, ln, gate, up, down):
    """Attention output projection, residual, norm, MLP, residual (out: [1, N, H_q, D])."""
    h = h + F.linear(out.reshape(1, h.shape[1], -1), ow, ob)
    x = _rms_norm(h, ln, s.eps[1])
    return h + F.linear(s.act(F.linear(x, gate)) * F.linear(x, up), down)


class _First(torch.nn.Module):
    def __init__(self, s: _Shape, rope):
        super().__init__()
        self.s, self.rope = s, rope

    def forward(self, token, embed, cos, sin, ln, qw, kw, vw, qb, kb, vb):
        h = F.embedding(token[None], embed)                 # [1, 1, hidden]
        return (h, *_qkv(self.s, h, ln, qw, kw, vw, qb, kb, vb, cos, sin, self.rope))


class _Middle(torch.nn.Module):
    def __init__(self, s: _Shape, rope):
        super().__init__()
        self.s, self.rope = s, rope

    def forward(self, h, out, ow, ob, ln2, gate, up, down, ln, qw, kw, vw, qb, kb, vb, cos, sin):
        h = _mlp(self.s, h, out, ow, ob, ln2, gate, up, down)
        return (h, *_qkv(self.s, h, ln, qw, kw, vw, qb, kb, vb, cos, sin, self.rope))


class _FirstN(torch.nn.Module):
    """`first` for the N tokens of a packed step (ids [1, N])."""

    def __init__(self, s: _Shape, rope):
        super().__init__()
        self.s, self.rope = s, rope

    def forward(self, ids, embed, cos, sin, ln, qw, kw, vw, qb, kb, vb):
        h = F.embedding(ids, embed)                         # [1, N, hidden]
        return (h, *_qkv(self.s, h, ln, qw, kw, vw, qb, kb, vb, cos, sin, self.rope))


class _LastN(torch.nn.Module):
    """`last` for a packed step, without the head: the final norm's output [1, N, hidden] (the
    head then runs on the positions whose logits are read, as the eager step does)."""

    def __init__(self, s: _Shape):
        super().__init__()
        self.s = s

    def forward(self, h, out, ow, ob, ln2, gate, up, down, norm):
        return _rms_norm(_mlp(self.s, h, out, ow, ob, ln2, gate, up, down), norm, self.s.eps[2])


class _Last(torch.nn.Module):
    def __init__(self, s: _Shape):
        super().__init__()
        self.s = s

    def forward(self, h, out, ow, ob, ln2, gate, up, down, norm, head):
        h = _rms_norm(_mlp(self.s, h, out, ow, ob, ln2, gate, up, down), norm, self.s.eps[2])
        return F.linear(h, head)[0, -1].to(torch.float32)   # [vocab]


def _cache_dir() -> Path:
    base = os.environ.get("LOCALHEAP_COMPILE_CACHE")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "localheap" / "compiled"


class CompiledDecode(LeanDecode):
    """The lean step with its per-token parts in three AOTInductor graphs (the module docstring)."""

    def __init__(self, model):
        super().__init__(model)
        self.shape = s = _Shape(self)
        a, ln1, q, k, v, o, *_ = self.layers[0]
        x = torch.zeros(1, 1, model.config.hidden_size, dtype=self.head.weight.dtype, device=self.head.weight.device)
        token = torch.zeros(1, dtype=torch.long, device=x.device)
        cos, sin = self.rotary(x, torch.zeros(1, 1, dtype=torch.long, device=x.device))
        out = torch.zeros(1, 1, model.config.num_attention_heads, a.head_dim, dtype=x.dtype, device=x.device)
        first = (token, self.embed.weight, cos, sin, *self._pre(0))
        middle = (x, out, *self._post(0), *self._pre(0), cos, sin)
        last = (x, out, *self._post(0), self.norm[0], self.head.weight)
        folder = _cache_dir() / hashlib.sha256(s.key.encode()).hexdigest()[:24]
        self.first = _load(folder / "first.pt2", _First(s, self.rope), first)
        self.middle = _load(folder / "middle.pt2", _Middle(s, self.rope), middle)
        self.last = _load(folder / "last.pt2", _Last(s), last)
        self.pre = [self._pre(i) for i in range(len(self.layers))]
        self.post = [self._post(i) for i in range(len(self.layers))]
        self.folder, self.packed = folder, None

    def _packed_graphs(self) -> tuple:
        """first, middle and last over N packed tokens (N a dynamic dimension), compiled (or
        loaded) on a packed step's first use."""
        if self.packed is None:
            s = self.shape
            a = self.layers[0][0]
            cfg = self.model.config
            x = torch.zeros(1, 2, cfg.hidden_size, dtype=self.head.weight.dtype, device=self.head.weight.device)
            ids = torch.zeros(1, 2, dtype=torch.long, device=x.device)
            cos, sin = self.rotary(x, torch.zeros(1, 2, dtype=torch.long, device=x.device))
            out = torch.zeros(1, 2, cfg.num_attention_heads, a.head_dim, dtype=x.dtype, device=x.device)
            n = torch.export.Dim("n", min=1, max=1 << 16)
            pre = [None] * len(self._pre(0))
            post = [None] * len(self._post(0))
            first = (ids, self.embed.weight, cos, sin, *self._pre(0))
            middle = (x, out, *self._post(0), *self._pre(0), cos, sin)
            last = (x, out, *self._post(0), self.norm[0])
            dims = ({1: n}, None, {1: n}, {1: n}, *pre)
            self.packed = (
                _load(self.folder / "first_n.pt2", _FirstN(s, self.rope), first, dims),
                _load(self.folder / "middle_n.pt2", _Middle(s, self.rope), middle,
                      ({1: n}, {1: n}, *post, *pre, {1: n}, {1: n})),
                _load(self.folder / "last_n.pt2", _LastN(s), last, ({1: n}, {1: n}, *post, None)),
            )
        return self.packed

    def run(self, cache, ids: torch.Tensor, pos: torch.Tensor, keep: Optional[torch.Tensor],
            linear=None) -> torch.Tensor:
        """LeanDecode.run (a packed step's N tokens) with the per-token parts in the packed graphs
        (their matmuls compiled in them: `linear`, the eager step's choice, is not theirs)."""
        first, middle, last = self._packed_graphs()
        n = len(self.layers)
        with torch.no_grad():
            cos, sin = self.rotary(self.embed.weight[:1][None], pos)   # [1, N, D]: the eager rotary's
            h, qs, ks, vs = first([ids, self.embed.weight, cos, sin, *self.pre[0]])
            for i, (a, *_) in enumerate(self.layers):
                ks, vs = cache.layers[i].update(ks, vs)
                out, _ = attention.heap_sdpa(a, qs, ks, vs, None, heap=cache, dropout=0.0, scaling=a.scaling)
                out = out.contiguous()                                # [1, N, H_q, D]
                if i + 1 < n:
                    h, qs, ks, vs = middle([h, out, *self.post[i], *self.pre[i + 1], cos, sin])
                else:
                    h = last([h, out, *self.post[i], self.norm[0]])[0]
            return self.head(h[:, -1:, :] if keep is None else h[:, keep, :])

    def _pre(self, i: int) -> tuple:
        _, ln1, q, k, v, *_ = self.layers[i]
        return ln1[0], q[0], k[0], v[0], *((q[1], k[1], v[1]) if self.shape.bias else (None, None, None))

    def _post(self, i: int) -> tuple:
        _, _, _, _, _, o, ln2, gate, up, down, _ = self.layers[i]
        return o[0], o[1], ln2[0], gate, up, down

    def __call__(self, cache, token: torch.Tensor) -> torch.Tensor:
        """token: [1] id on the device. Returns the next logits [vocab] fp32, as LeanDecode does."""
        cache.make_room(1)
        pos = cache.position_ids(1)                                   # [1, 1]; sets each layer's rope_delta
        n = len(self.layers)
        with torch.no_grad():
            cos, sin = self.rotary(self.embed.weight[:1][None], pos)   # the eager rotary: stock cos/sin
            h, qs, ks, vs = self.first([token, self.embed.weight, cos, sin, *self.pre[0]])
            for i, (a, *_) in enumerate(self.layers):
                ks, vs = cache.layers[i].update(ks, vs)
                out, _ = attention.heap_sdpa(a, qs, ks, vs, None, heap=cache, dropout=0.0, scaling=a.scaling)
                out = out.contiguous()                                # [1, 1, H_q, D]
                if i + 1 < n:
                    h, qs, ks, vs = self.middle([h, out, *self.post[i], *self.pre[i + 1], cos, sin])
                else:
                    return self.last([h, out, *self.post[i], self.norm[0], self.head.weight])[0]


def _load(path: Path, module: torch.nn.Module, example: tuple, dynamic: Optional[tuple] = None):
    """The compiled graph at `path` (exported and compiled there first when it is not on disk yet),
    as a function of the list of its inputs, None left out, returning the list of its outputs:
    the loader's own call, without the package's per-call (un)flattening of argument trees.
    `dynamic`: torch.export's dynamic_shapes, one entry per input."""
    with _LOCK:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            log.warning("--compile-decode: compiling the decode step's %s graph, once per model shape (tens of "
                        "seconds), into %s", path.stem, path)
            from torch._inductor.lowering import force_fallback

            with torch.no_grad():
                program = torch.export.export(module, example, dynamic_shapes=dynamic)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
                # RMSNorm's mean through aten's own kernel: inductor's reduction sums in another order
                quiet = logging.getLogger("torch._inductor.ir")   # its "no c-shim for mean" warning
                level = quiet.level
                quiet.setLevel(logging.ERROR)
                try:
                    # half-precision models: round where eager rounds (each op's output), not only at the end
                    with force_fallback(torch.ops.aten.mean.dim), \
                            torch._inductor.config.patch(emulate_precision_casts=True):
                        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
                finally:
                    quiet.setLevel(level)
            os.replace(tmp, path)
        run = torch._inductor.aoti_load_package(str(path)).loader.boxed_run

        def graph(inputs: list) -> list:
            return run([x for x in inputs if x is not None])
        return graph


def compiled_step(model) -> Optional[CompiledDecode]:
    """The model's compiled step, built (and checked against the lean step) on first use; None
    where it cannot be built here (no compiler, an export inductor refuses): the lean step runs."""
    step = model.__dict__.get("_localheap_compiled", False)
    if step is not False:
        return step
    why = available()
    if why is None:
        try:
            step = CompiledDecode(model)
        except Exception as e:   # export or inductor refused this model: the eager lean step stays
            why = f"{type(e).__name__}: {e}"
    model.__dict__["_localheap_compiled"] = step = None if why else step   # set before the check: its steps find it
    if why:
        log.warning("--compile-decode: the decode step stays eager (%s)", why)
    elif not agrees(model, setting="compile_decode"):
        log.warning("--compile-decode: the compiled step's logits differ from the eager step's on this model, "
                    "device and dtype; the decode step stays eager")
        step = model.__dict__["_localheap_compiled"] = None
    else:
        log.info("--compile-decode: the compiled step's logits are the eager step's, bit for bit")
    return step


def compiled_packed(model) -> Optional[CompiledDecode]:
    """The compiled step for packed steps (batch.py: a decode batch and its riding chunks), its N
    a dynamic dimension: the single-token step's model, with three more graphs built on first
    use and checked once against the eager packed step (agrees_packed); None where either check
    fails or the graphs cannot be built: the eager packed step runs."""
    step = model.__dict__.get("_localheap_compiled_packed", False)
    if step is not False:
        return step
    step = compiled_step(model)
    if step is not None:
        try:
            step._packed_graphs()
        except Exception as e:   # export or inductor refused the dynamic graphs
            log.warning("--compile-decode: the packed decode step stays eager (%s: %s)", type(e).__name__, e)
            step = None
    model.__dict__["_localheap_compiled_packed"] = step   # set before the check: its steps find it
    if step is not None and not agrees_packed(model):
        log.warning("--compile-decode: the compiled packed step's logits differ from the eager packed step's on "
                    "this model, device and dtype; the packed step stays eager")
        step = model.__dict__["_localheap_compiled_packed"] = None
    elif step is not None:
        log.info("--compile-decode: the compiled packed step's logits are the eager packed step's, bit for bit")
    return step


def agrees_packed(model) -> bool:
    """Whether a packed step of three scratch heaps (two decode tokens and a 3-token chunk, each
    heap at its own length) gives the same logits compiled and eager, bit for bit."""
    from ...heap import HeapConfig
    from .batch import forward_packed
    from .cache import make_heap_cache
    from .generate import forward

    ids = torch.arange(12, device=model.device) % model.config.vocab_size
    logits = []
    for on in (False, True):
        caches = []
        for j in range(3):
            # absolute positions, as lean.agrees: a RoPE no key can move (longrope, dynamic NTK) runs too
            cache = make_heap_cache(model, HeapConfig(budget=64, recent=8, slack=16, recall=False, positions="absolute"))
            forward(model, cache, ids[: 4 + j])
            cache.compile_decode = on
            caches.append(cache)
        tokens = [ids[6:7], ids[7:8], ids[8:11]]
        for cache, t in zip(caches, tokens):
            cache.make_room(len(t))
        logits.append(forward_packed(model, caches, tokens))
    return torch.equal(*logits)
