"""mlx-lm's loader, taking one more checkpoint layout: gpt-oss as transformers writes it.

mlx-lm reads gpt-oss in OpenAI's layout (each expert's gate and up rows interleaved in one
[E, 2I, H] matrix, MXFP4 blocks or plain) and in mlx-community's (already split). A gpt-oss
checkpoint that transformers saved (a fine-tune, a BF16 export) holds the experts the way
transformers multiplies them, x @ W: gate_up_proj [E, H, 2I] and down_proj [E, I, H]. mlx-lm's
sanitize would slice the wrong axis of those (and, unquantized in either layout, name them
without ".weight"), so they are turned into OpenAI's layout and named as its quantized blocks
are once sanitized. Every other model loads exactly as mlx_lm.load loads it.

Then every array the model holds is evaluated here, its buffers too: mlx-lm evaluates the
parameters only, and a RoPE's precomputed frequencies (llama3 scaling, YaRN: `_freqs`) stay a
lazy graph tied to the loading thread's stream. The engine thread that first ran the model then
failed ("There is no Stream(cpu, 0) in current thread"): Llama 3.1/3.2 and gpt-oss on MLX.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

import mlx.core as mx


def load(path: str | Path, lazy: bool = False):
    """mlx_lm.load (a local directory or a Hugging Face repo id) -> (model, tokenizer)."""
    from mlx_lm.utils import _download, load_model, load_tokenizer

    model_path = _download(str(path))
    model, config = load_model(model_path, lazy, get_model_classes=model_classes)
    if not lazy:
        evaluate(model)
    return model, load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id", None))


def evaluate(model) -> None:
    """Evaluate every array `model` holds: parameters, and buffers (keys starting with "_", which
    `parameters()` leaves out), so no lazy graph of the loading thread's is left for another."""
    mx.eval(model.parameters(), [v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])


def model_classes(config: dict):
    """mlx-lm's classes for `config`, gpt-oss's sanitize taking transformers' layout too."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    if getattr(model_class, "__module__", "") == "mlx_lm.models.gpt_oss":
        model_class = _gpt_oss(model_class)
    return model_class, args_class


@lru_cache(maxsize=None)
def _gpt_oss(base):
    class Model(base):
        def sanitize(self, weights):
            return super().sanitize(openai_layout(weights, self.args.hidden_size, self.args.intermediate_size))

    Model.__name__ = Model.__qualname__ = base.__name__
    Model.__module__ = base.__module__
    return Model


def openai_layout(weights: dict, hidden: int, inner: int) -> dict:
    """Unquantized gpt-oss expert matrices in OpenAI's layout (transposed where transformers'),
    named `...experts.gate_up_proj.weight`, as mlx-lm's sanitize reads them; others as they are.

    Which layout a checkpoint uses is read from its first unquantized gate_up_proj ([E, 2I, H] in
    OpenAI's, [E, H, 2I] in transformers'); where that is ambiguous (H == 2I), from down_proj
    ([E, H, I] against [E, I, H]: never both ambiguous)."""
    transpose = _layout(weights, hidden, inner)
    out = {}
    for k, v in weights.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            k, v = k + ".weight", mx.swapaxes(v, -1, -2) if transpose else v
        out[k] = v
    return out


def _layout(weights: dict, hidden: int, inner: int) -> Optional[bool]:
    """True: transformers' layout; False: OpenAI's (or nothing to tell: quantized, already split)."""
    for suffix, ours, theirs in (("experts.gate_up_proj", (hidden, 2 * inner), (2 * inner, hidden)),
                                 ("experts.down_proj", (inner, hidden), (hidden, inner))):
        if ours == theirs:
            continue
        for k, v in weights.items():
            if k.endswith(suffix):
                shape = tuple(v.shape[-2:])
                if shape not in (ours, theirs):
                    raise ValueError(f"gpt-oss weight {k} has shape {tuple(v.shape)}: neither OpenAI's "
                                     f"[E, {theirs[0]}, {theirs[1]}] nor transformers' [E, {ours[0]}, {ours[1]}]")
                return shape == ours
    return False
