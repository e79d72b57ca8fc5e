"""bench/gguf.py: a Llama directory as GGUF (for `bench peer`); llama.cpp agrees where it is installed."""

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from localheap.bench.gguf import convert, permute_rope  # noqa: E402


def rope_half_split(x, pos, theta=10000.0):
    """Hugging Face's RoPE: pairs (i, i + d/2). x: [heads, d]."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    rot = np.concatenate([-x[:, d // 2:], x[:, :d // 2]], axis=-1)
    return x * cos + rot * sin


def rope_interleaved(x, pos, theta=10000.0):
    """llama.cpp's (LLaMA's original) RoPE: pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[:, 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def test_permuted_projection_under_interleaved_rope_gives_the_same_scores():
    rng = np.random.default_rng(0)
    heads, d, hidden = 3, 8, 12
    wq, wk = rng.normal(size=(heads * d, hidden)), rng.normal(size=(heads * d, hidden))
    x1, x2 = rng.normal(size=hidden), rng.normal(size=hidden)
    hf = (rope_half_split((wq @ x1).reshape(heads, d), 7) * rope_half_split((wk @ x2).reshape(heads, d), 3)).sum(-1)
    cpp = (rope_interleaved((permute_rope(wq, heads) @ x1).reshape(heads, d), 7)
           * rope_interleaved((permute_rope(wk, heads) @ x2).reshape(heads, d), 3)).sum(-1)
    np.testing.assert_allclose(cpp, hf, rtol=1e-10)
    assert not np.allclose((wq @ x1), (permute_rope(wq, heads) @ x1)), "the permutation moves rows"


def test_converted_file_holds_every_tensor_and_the_shape(model_dirs, tmp_path):
    from safetensors import safe_open

    src = model_dirs("llama")
    cfg = json.loads((src / "config.json").read_text())
    out = convert(src, tmp_path / "m.gguf", "f32")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    n = cfg["num_hidden_layers"]
    assert len(tensors) == 3 + 9 * n
    field = reader.fields["llama.attention.head_count_kv"]
    assert int(field.parts[field.data[0]][0]) == cfg["num_key_value_heads"]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == cfg["vocab_size"]
    with safe_open(str(src / "model.safetensors"), "np") as f:
        wk = f.get_tensor("model.layers.1.self_attn.k_proj.weight").astype(np.float32)
        emb = f.get_tensor("model.embed_tokens.weight").astype(np.float32)
    got = np.asarray(tensors["blk.1.attn_k.weight"].data).reshape(wk.shape)
    np.testing.assert_array_equal(got, permute_rope(wk, cfg["num_key_value_heads"]))
    np.testing.assert_array_equal(np.asarray(tensors["token_embd.weight"].data).reshape(emb.shape), emb)


def test_llama_cpp_greedy_tokens_match_transformers(model_dirs, tmp_path):
    pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from localheap.backends.torch.bench import stock_tokens
    from localheap.bench.peer import LlamaCpp

    src = model_dirs("llama")
    path = convert(src, tmp_path / "m.gguf", "f32")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="sdpa").eval()
    prompt = np.random.default_rng(3).integers(10, 1000, 40).tolist()
    ours = list(stock_tokens(model, DynamicCache(config=model.config), prompt, 16))
    eng = LlamaCpp(str(path), 128, 1)
    theirs = [eng.prefill(prompt)]
    while len(theirs) < 16:
        theirs.append(eng.step(theirs[-1]))
    assert theirs == ours


def test_bench_peer_cells_report_their_own_peak_rss(model_dirs, tmp_path):
    """Each cell is its own process: llama.cpp's peak is its own (no torch), not the parent's."""
    pytest.importorskip("llama_cpp")
    from localheap.bench.peer import run_peer
    from localheap.heap import HeapConfig

    src = model_dirs("llama")
    result = run_peer(str(src), src, HeapConfig(budget=512).to_dict(), [64], [1], 3,
                      paths=("heap", "llama.cpp-f16"), workdir=tmp_path)
    rows = {r["path"]: r for r in result["rows"]}
    assert set(rows) == {"heap", "llama.cpp-f16"}
    for r in rows.values():
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_mixed_tok_s"] > 0
        assert r["peak_rss"] >= r["rss_loaded"] > 0
        assert len(r["tokens"]) == 4
    assert rows["llama.cpp-f16"]["peak_rss"] < rows["heap"]["rss_loaded"], "torch is not in llama.cpp's process"
    assert result["check"]["tokenizer_agrees"]
    assert rows["llama.cpp-f16"]["decode_vs_llama"] == 1.0
