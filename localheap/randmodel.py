"""Tiny random-weight models of real architectures, saved in Hugging Face format.

The same directory loads with ``mlx_lm.load(path)`` (gpt_oss: with localheap's
``backends.mlx.loading.load``, which reads transformers' expert layout) and with
transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer``, so tests can compare both
libraries without downloading anything. Specs look like ``"llama:tiny"``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Sequence

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma", "gemma3_text", "gpt_oss", "phi3", "glm4", "glm4_moe")

# Hidden size is a perfect square so Gemma's sqrt(hidden) embedding scale is exact
# in bfloat16 (mlx-lm's gemma3_text rounds it to bf16, transformers does not).
SIZES = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "initializer_range": 0.1,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 512,
        "initializer_range": 0.05,
    },
}

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}

BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MARKER = ".localheap-complete"
GEMMA3_SLIDING_WINDOW = 32
GEMMA3_PATTERN = 2  # every 2nd layer is global: tiny = [sliding, full]
GPT_OSS_SLIDING_WINDOW = 32   # gpt-oss alternates 128-token sliding layers with full ones

_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKENIZERS: dict[tuple[int, int], str] = {}  # (vocab_size, seed) -> tokenizer.json text
_LOCK = threading.Lock()


def _corpus(seed: int) -> list[str]:
    # English text shipped with every CPython: the pydoc topic help pages.
    from pydoc_data import topics

    texts = [topics.topics[k] for k in sorted(topics.topics)]
    if seed:
        rng = random.Random(seed)
        rng.shuffle(texts)
        texts = texts[: max(1, len(texts) * 9 // 10)]
    return texts


def _train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    with _LOCK:
        cached = _TOKENIZERS.get((vocab_size, seed))
        if cached is None:
            # Same pipeline transformers' Qwen2Tokenizer rebuilds (it ignores ours for
            # model_type qwen2), so tokenizer.json and AutoTokenizer agree for every family.
            tok = Tokenizer(models.BPE())
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
            tok.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(
                vocab_size=vocab_size,
                special_tokens=list(SPECIAL_TOKENS),
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            )
            tok.train_from_iterator(_corpus(seed), trainer)
            # Plain encode() prepends BOS, like Llama-style tokenizers.
            bos_id = tok.token_to_id(BOS)
            tok.post_processor = processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
            )
            cached = _TOKENIZERS[(vocab_size, seed)] = tok.to_str()
    return Tokenizer.from_str(cached)


def build_tokenizer(out_dir, vocab_size: int = 1024, seed: int = 0, special: Sequence[str] = ()):
    """Train (once per process) a byte-level BPE tokenizer and save it into ``out_dir``.

    The training text is the stdlib ``pydoc_data.topics`` help pages, so the result is
    deterministic and needs no network. Writes ``tokenizer.json``,
    ``tokenizer_config.json`` (bos/eos/pad tokens and a Jinja ``chat_template``) and
    ``special_tokens_map.json``. ``seed`` != 0 trains on a shuffled 90% subset. ``special``:
    more special tokens, given the ids after the trained vocabulary (e.g. a code model's
    fill-in-the-middle tokens). Returns the ``tokenizers.Tokenizer``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab_size, seed)
    if special:
        tok.add_special_tokens(list(special))
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,  # else Qwen2Tokenizer adds "<|endoftext|>" past the vocab
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)
    return tok


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _model_config(family, size, tok, rope_scaling, rope_traditional, dtype) -> dict:
    # Legacy-style keys (flat rope_theta / rope_scaling) are what mlx-lm reads and
    # what transformers 4.x and 5.x both accept.
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    if rope_traditional and family in ("qwen3", "qwen3_moe", "gemma3_text"):
        raise ValueError(f"mlx-lm's {family} ignores rope_traditional")
    if rope_scaling is not None and family == "gemma":
        raise ValueError("mlx-lm's gemma does not support rope_scaling")
    cfg = {
        "model_type": family,
        "architectures": [ARCHITECTURES[family]],
        "vocab_size": tok.get_vocab_size(),
        **SIZES[size],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
        "tie_word_embeddings": family not in ("llama", "mistral", "qwen3_moe", "gpt_oss", "glm4", "glm4_moe"),   # as the real ones
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = dict(rope_scaling)
    if rope_traditional:
        cfg["rope_traditional"] = True  # mlx-lm only; transformers ignores it
    if family in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"):
        cfg.update(hidden_act="silu", mlp_bias=False)
    if family in ("mistral", "qwen2", "qwen3", "qwen3_moe"):
        cfg.update(rope_theta=1000000.0, sliding_window=None, use_sliding_window=False)
    if family == "qwen2":
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    if family == "qwen3_moe":   # every layer's MLP a mixture of experts (Qwen3-Coder 30B-A3B's shape, scaled down)
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=cfg["intermediate_size"] // 2,
                   decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], max_window_layers=cfg["num_hidden_layers"],
                   output_router_logits=False, router_aux_loss_coef=0.001)
    if family == "gpt_oss":   # gpt-oss-20b's shape scaled down: biased attention with learned sinks,
        # [sliding, full] layers, a mixture of experts in every layer (clamped SwiGLU), YaRN
        cfg.update(attention_bias=True, num_local_experts=4, num_experts_per_tok=2, sliding_window=GPT_OSS_SLIDING_WINDOW,
                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_hidden_layers"])],
                   rope_theta=150000.0, swiglu_limit=7.0, router_aux_loss_coef=0.9, output_router_logits=False,
                   hidden_act="silu", max_position_embeddings=131072)
        if rope_scaling is None:   # gpt-oss's YaRN; truncate as mlx-lm always does (the real config says false,
            # which transformers honours: on the real weights the two libraries differ by that)
            cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": True, "original_max_position_embeddings": 4096}
    if family == "phi3":   # Phi-4-mini's layout: q, k, v in one projection, RoPE on 3/4 of each head (split
        # halves), tied embeddings (its longrope scaling is left out: transformers switches its factors by length)
        cfg.update(hidden_act="silu", partial_rotary_factor=0.75, resid_pdrop=0.0, embd_pdrop=0.0,
                   original_max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=True)
    if family == "glm4":   # GLM-4-0414's layout: biased q, k, v, RoPE on half of each head in interleaved
        # pairs, norms after attention and after the MLP as well as before
        cfg.update(hidden_act="silu", attention_bias=True, partial_rotary_factor=0.5)
    if family == "glm4_moe":   # GLM-4.5(-Air)'s layout scaled down: biased q, k, v, RoPE on half of each head
        # (split halves here, unlike glm4), a dense first layer, then sigmoid-routed experts beside a shared one
        cfg.update(hidden_act="silu", attention_bias=True, partial_rotary_factor=0.5, use_qk_norm=False,
                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   moe_intermediate_size=cfg["intermediate_size"] // 2, first_k_dense_replace=1,
                   routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True, rope_scaling=None,
                   num_nextn_predict_layers=0)
    if family == "gemma":
        # mlx-lm's gemma uses exact erf GELU; transformers rewrites "gelu" to the tanh
        # approximation, so name the exact Python GELU explicitly.
        cfg.update(hidden_act="gelu_python", hidden_activation="gelu_python")
    if family == "gemma3_text":
        n = cfg["num_hidden_layers"]
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            query_pre_attn_scalar=cfg["head_dim"],
            sliding_window=GEMMA3_SLIDING_WINDOW,
            sliding_window_pattern=GEMMA3_PATTERN,
            layer_types=[
                "full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention"
                for i in range(n)
            ],
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    return cfg


def build_random_model(
    family: str,
    out_dir,
    size: str = "tiny",
    seed: int = 0,
    rope_scaling: dict | None = None,
    rope_traditional: bool = False,
    dtype: str = "float32",
    special: Sequence[str] = (),
) -> Path:
    """Write a random-weight ``family`` model of preset ``size`` into ``out_dir``.

    Weights come from a seeded ``AutoModelForCausalLM.from_config`` (HF init, std
    ``initializer_range``) saved as safetensors; then config.json is rewritten in the
    flat format both libraries read, and the tokenizer files are added.
    ``rope_scaling`` (e.g. ``{"rope_type": "llama3", ...}``) goes into config.json as is.
    ``rope_traditional`` is an mlx-lm-only key: transformers ignores it, so models built
    with it no longer match transformers; cross-library checks use the default layout.
    ``dtype`` is a torch dtype name ("float32", "bfloat16", "float16"). ``special``: more
    special tokens for the tokenizer (build_tokenizer), the vocabulary grown to hold them.
    Returns the output directory.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, special=special)
    cfg = _model_config(family, size, tok, rope_scaling, rope_traditional, dtype)
    _write_json(out / "config.json", cfg)
    hf_config = AutoConfig.from_pretrained(out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(out, safe_serialization=True)
    _write_json(out / "config.json", cfg)  # save_pretrained rewrote it in its own format
    return out


def parse_random_spec(spec: str) -> tuple[str, str]:
    """Split ``"family:size"`` (e.g. ``"llama:tiny"``; size defaults to "tiny")."""
    family, _, size = spec.strip().partition(":")
    size = size or "tiny"
    if family not in FAMILIES:
        raise ValueError(
            f"unknown model family {family!r} in spec {spec!r}; "
            f"expected one of: {', '.join(FAMILIES)}"
        )
    if size not in SIZES:
        from .randbig import SHAPES

        real = [s for s in SHAPES if s.startswith(f"{family}:")]
        raise ValueError(
            f"unknown model size {size!r} in spec {spec!r}; "
            f"expected one of: {', '.join(SIZES)}"
            + (f", or a real shape built in memory (torch): {', '.join(real)}" if real else "")
        )
    return family, size


def default_cache_root() -> Path:
    """``$LOCALHEAP_CACHE/random-models``, else ``~/.cache/localheap/random-models``."""
    base = os.environ.get("LOCALHEAP_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "localheap"
    return root / "random-models"


def _builder():
    """torch where it is installed (the reference builder), else mlx-lm (a core dependency)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        return build_random_model
    except ImportError:
        pass
    try:
        import mlx_lm.utils  # noqa: F401

        from .randmodel_mlx import build_random_model_mlx
        return build_random_model_mlx
    except ImportError as e:
        raise RandomModelUnavailable(
            f"--random-model needs torch or mlx-lm ({e}); pip install -e '.[torch]' in localheap's checkout or pip install mlx-lm") from e


class RandomModelUnavailable(ImportError):
    """Neither builder can run here (the message says what to install)."""


def random_model_dir(spec: str, cache_root=None, seed: int = 0) -> Path:
    """Return ``<cache_root>/<family>-<size>-s<seed>``, building it first if needed.

    A directory counts as complete only once its marker file exists (written last);
    anything else is rebuilt. Builds go to a temporary sibling that is renamed into
    place, so concurrent callers never see a half-written model.
    """
    family, size = parse_random_spec(spec)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / f"{family}-{size}-s{seed}"
    if (target / MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _builder()(family, tmp, size=size, seed=seed)
    (tmp / MARKER).write_text(f"{spec}\n", encoding="utf-8")
    if not (target / MARKER).exists():
        shutil.rmtree(target, ignore_errors=True)  # stale half-written build
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            pass
    shutil.rmtree(tmp, ignore_errors=True)
    return target
