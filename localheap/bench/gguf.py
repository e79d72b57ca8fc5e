"""Write a Hugging Face Llama directory (config, safetensors, tokenizer.json) as a GGUF file.

For `localheap bench peer` only: llama.cpp reads the result, localheap never does. Knows the
llama architecture and byte-level BPE tokenizers, nothing else. Q and K projections are
permuted from Hugging Face's half-split RoPE layout to llama.cpp's interleaved one.
Tokenizer: GGUF's "gpt2" model with the "qwen2" pre-tokenizer, the one llama.cpp knows whose
split regex is these tokenizers' own (single digits, case-insensitive contractions).
Needs the `gguf` package (`pip install -e '.[peer]' in localheap's checkout`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PRE_TOKENIZER = "qwen2"
TENSOR_NAMES = {   # Hugging Face name (per layer after "model.layers.N.") -> GGUF name
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """w: [n_heads * head_dim, in]; rows of each head from [x0..x(d/2-1), y0..] to [x0, y0, x1, y1, ...]."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    assert parts[:2] == ["model", "layers"] and parts[-1] == "weight", f"unexpected tensor {hf}"
    return f"blk.{parts[2]}.{TENSOR_NAMES['.'.join(parts[3:-1])]}.weight"


def _add_tokenizer(writer, model_dir: Path, cfg: dict) -> None:
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert tok["model"]["type"] == "BPE", "byte-level BPE tokenizers only"
    vocab = tok["model"]["vocab"]
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    n = cfg["vocab_size"]
    by_id = {i: s for s, i in vocab.items()} | {i: t["content"] for i, t in added.items()}
    tokens, types = [], []
    for i in range(n):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        if i not in by_id:
            types.append(gguf.TokenType.UNUSED)
        elif i in added and added[i].get("special"):
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tcfg_path = model_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.exists() else {}
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])
    writer.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))


def convert(model_dir: str | Path, out: str | Path, outtype: str = "f16") -> Path:
    """model_dir: a LlamaForCausalLM directory; outtype: f16 or f32 (norms stay f32, as llama.cpp's
    converter keeps 1-D tensors). Returns the written path."""
    import gguf
    from safetensors import safe_open

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if cfg.get("model_type") != "llama":
        raise ValueError(f"the GGUF converter knows the llama architecture only, not {cfg.get('model_type')!r}")
    dtype = {"f16": np.float16, "f32": np.float32}[outtype]
    n_heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, model_dir, cfg)
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        names = sorted(f.keys())
        if "lm_head.weight" not in names and not cfg.get("tie_word_embeddings", False):
            raise ValueError("no lm_head.weight and the embeddings are not tied")
        for hf in names:
            w = f.get_tensor(hf).astype(np.float32)
            if hf.endswith("self_attn.q_proj.weight"):
                w = permute_rope(w, n_heads)
            elif hf.endswith("self_attn.k_proj.weight"):
                w = permute_rope(w, n_kv)
            writer.add_tensor(_tensor_name(hf), w if w.ndim == 1 else w.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
