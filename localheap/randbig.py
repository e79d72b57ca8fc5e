"""Random-weight models with real models' shapes, built in memory on the device, never saved.

`--random-model llama:8b` gives a model with Llama-3-8B's shape (layers, heads, KV heads,
head dim, MLP width, vocabulary) and random weights, for `bench speed` and `bench memory` on
a GPU: speed and memory depend on the shape, not on the weights. The tokenizer is the small
trained one of `randmodel` (its ids are a subset of the model's vocabulary); the output head's rows
past it are zero, so that greedy decoding picks ids the tokenizer can spell (a random head would pick
ids past it nearly always, and a served reply would stream no text: `bench serve` counts text).
The arithmetic is the same: a zero row costs what any row does. torch only.
"""

from __future__ import annotations

import tempfile

# name -> (family, config fields); figures from the models' published config.json files
SHAPES = {
    "llama:1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                               tie_word_embeddings=True)),
    "llama:8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                               tie_word_embeddings=False)),
    "qwen3:0.6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, intermediate_size=3072, vocab_size=151936, rope_theta=1000000.0,
                                 tie_word_embeddings=True)),
    "qwen3:8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=12288, vocab_size=151936, rope_theta=1000000.0,
                               tie_word_embeddings=False)),
    "qwen2:7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                               head_dim=128, intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0,
                               tie_word_embeddings=False)),
    "mistral:7b": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32768,
                                   rope_theta=1000000.0, tie_word_embeddings=False)),
}


def is_real_shape(spec: str) -> bool:
    return spec.strip() in SHAPES


def hf_config(spec: str, dtype: str = "bfloat16"):
    """transformers config of the named shape (randmodel's family settings, the real sizes)."""
    from transformers import AutoConfig

    from .randmodel import _model_config, build_tokenizer

    family, fields = SHAPES[spec.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(tmp)
    cfg = _model_config(family, "tiny", tok, None, False, dtype)
    cfg.update(fields, initializer_range=0.02, max_position_embeddings=131072)
    if family == "qwen2":
        cfg.update(max_window_layers=cfg["num_hidden_layers"], attention_bias=True)
    return AutoConfig.for_model(**cfg)


def build(spec: str, device: str = "cuda", dtype: str = "bfloat16"):
    """(model, tokenizer) with random weights allocated directly on `device` ("meta": shapes only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .randmodel import build_tokenizer

    config = hf_config(spec, dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(tmp)
        from .randmodel import BOS, CHAT_TEMPLATE, EOS, PAD
        tokenizer = AutoTokenizer.from_pretrained(tmp, bos_token=BOS, eos_token=EOS, pad_token=PAD)
        tokenizer.chat_template = CHAT_TEMPLATE
    if device != "meta":
        with torch.no_grad():   # (tied heads: the embedding rows of ids the tokenizer never gives)
            model.get_output_embeddings().weight[len(tokenizer):].zero_()
    return model.eval(), tokenizer


def _device_dtype(device=None) -> tuple:
    """(the torch device, the name of the dtype the shapes are built in there: bf16 on CUDA, fp32
    elsewhere)."""
    import torch

    from .backends.torch.backend import default_device, default_dtype

    dev = torch.device(device) if device else default_device()
    return dev, str(default_dtype(dev)).split(".")[-1]


def model_name(spec: str, device=None) -> str:
    """The name the backend of `spec` built on `device` carries (known before it is built: the
    server locks the sessions directory named after it first)."""
    return f"random:{spec} ({_device_dtype(device)[1]}, in memory)"


def load_torch_backend(spec: str, device=None):
    """A TorchBackend over `build(spec)` on the default device (bf16 on CUDA, fp32 elsewhere)."""
    from .backends.torch import TorchBackend, attention

    dev, dtype = _device_dtype(device)
    attention.install(None)
    model, tokenizer = build(spec, str(dev), dtype)
    attention.install(model)
    return TorchBackend(model, tokenizer, model_name=model_name(spec, dev))
