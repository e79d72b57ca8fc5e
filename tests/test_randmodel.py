"""Random tiny models load in mlx-lm and transformers and compute the same logits."""

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mlx_lm.generate import generate_step  # noqa: E402

from localheap import randmodel  # noqa: E402
from localheap.backends.mlx.loading import load as mlx_load  # noqa: E402  (mlx_lm.load + gpt-oss as transformers saves it)
from localheap.randmodel import (  # noqa: E402
    FAMILIES,
    MARKER,
    build_random_model,
    parse_random_spec,
    random_model_dir,
)

# ~50 tokens: longer than gemma3_text's sliding window (32), so both layer kinds matter.
TEXT = (
    "The with statement is used to wrap the execution of a block with methods "
    "defined by a context manager. This allows common try except finally usage "
    "patterns to be encapsulated for convenient reuse."
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
TOL = 1e-4  # float32 agreement seen is ~1e-6; layout mistakes give > 1e-1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("randmodels")
    return {fam: build_random_model(fam, root / fam) for fam in FAMILIES}


def _ids(path):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return tok(TEXT).input_ids


def _mlx_logits(path, ids):
    model, _ = mlx_load(path)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _torch_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _as_ids(out):
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_agree_across_libraries(models, family):
    path = models[family]
    ids = _ids(path)
    assert len(ids) > randmodel.GEMMA3_SLIDING_WINDOW
    ml, tl = _mlx_logits(path, ids), _torch_logits(path, ids)
    assert ml.shape == tl.shape == (len(ids), json.loads((path / "config.json").read_text())["vocab_size"])
    assert np.abs(ml - tl).max() < TOL
    assert tl[-1].std() > 0.1  # not degenerate
    assert ml[-1].argmax() == tl[-1].argmax()


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_generate_matches_transformers_greedy(models, family):
    path = models[family]
    model, tok = mlx_load(path)
    text = mlx_lm.generate(model, tok, "Hello", max_tokens=20)
    assert isinstance(text, str)
    ids = tok.encode(TEXT)
    steps = generate_step(mx.array(ids), model, max_tokens=12)
    mlx_out = [int(t) for t, _ in steps]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    hf_out = hf.generate(
        torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False
    )[0, len(ids) :].tolist()
    assert mlx_out == hf_out


def test_tokenizer_is_consistent_everywhere(models):
    from tokenizers import Tokenizer

    text = TEXT + " 12345 ünïcode 你好\n\n  <|end|>"
    for family, path in models.items():
        hf = transformers.AutoTokenizer.from_pretrained(path)
        _, wrapper = mlx_load(path)
        raw = Tokenizer.from_file(str(path / "tokenizer.json"))
        assert hf(text).input_ids == raw.encode(text).ids == wrapper.encode(text), family
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        assert len(hf) == vocab, family  # no tokens beyond the embedding table
        assert hf.decode(hf(text).input_ids, skip_special_tokens=True) == text.replace("<|end|>", "")


def test_chat_template_in_both_libraries(models):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for family in ("llama", "qwen2"):
        path = models[family]
        hf = transformers.AutoTokenizer.from_pretrained(path)
        _, wrapper = mlx_load(path)
        text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert text == (
            "<|begin|><|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n"
        )
        a = _as_ids(hf.apply_chat_template(msgs, add_generation_prompt=True))
        b = _as_ids(wrapper.apply_chat_template(msgs, add_generation_prompt=True))
        assert a == b and a[0] == hf.bos_token_id and a.count(hf.bos_token_id) == 1
        no_prompt = hf.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
        assert not no_prompt.endswith("<|assistant|>\n")


def test_llama3_rope_scaling_is_applied_in_both(models, tmp_path):
    path = build_random_model("llama", tmp_path / "rs", rope_scaling=LLAMA3_ROPE)
    ids = _ids(path)
    ml, tl = _mlx_logits(path, ids), _torch_logits(path, ids)
    assert np.abs(ml - tl).max() < TOL
    plain = _torch_logits(models["llama"], ids)  # same seed, same weights
    assert np.abs(tl - plain).max() > 1e-2


def test_rope_traditional_is_mlx_only(tmp_path):
    path = build_random_model("llama", tmp_path / "trad", rope_traditional=True)
    ids = _ids(path)
    assert np.abs(_mlx_logits(path, ids) - _torch_logits(path, ids)).max() > 1e-2
    with pytest.raises(ValueError, match="rope_traditional"):
        build_random_model("qwen3", tmp_path / "bad", rope_traditional=True)


def test_family_specific_config(models):
    cfg = {f: json.loads((p / "config.json").read_text()) for f, p in models.items()}
    layer_types = cfg["gemma3_text"]["layer_types"]
    assert {"sliding_attention", "full_attention"} <= set(layer_types)
    assert {f for f, c in cfg.items() if c["tie_word_embeddings"]} == {
        "qwen2", "qwen3", "gemma", "gemma3_text", "phi3"
    }
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["qwen2"])
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
    moe = transformers.AutoModelForCausalLM.from_pretrained(models["qwen3_moe"])
    assert cfg["qwen3_moe"]["num_experts"] > cfg["qwen3_moe"]["num_experts_per_tok"] > 1
    assert all(hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts") for layer in moe.model.layers)
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["qwen3"])
    assert hasattr(hf.model.layers[0].self_attn, "q_norm")
    phi = transformers.AutoModelForCausalLM.from_pretrained(models["phi3"])   # q, k, v in one projection
    assert hasattr(phi.model.layers[0].self_attn, "qkv_proj") and not hasattr(phi.model.layers[0].self_attn, "k_proj")
    glm = transformers.AutoModelForCausalLM.from_pretrained(models["glm4"])
    assert glm.model.layers[0].self_attn.k_proj.bias is not None
    assert hasattr(glm.model.layers[0], "post_self_attn_layernorm")
    # RoPE on part of each head: 3/4 (phi3), 1/2 (glm4)
    head = cfg["phi3"]["head_dim"]
    assert 2 * phi.model.rotary_emb.inv_freq.shape[0] == 3 * head // 4
    assert 2 * glm.model.rotary_emb.inv_freq.shape[0] == head // 2
    moe = transformers.AutoModelForCausalLM.from_pretrained(models["glm4_moe"])   # dense first layer, then experts
    assert not hasattr(moe.model.layers[0].mlp, "experts")
    assert all(hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "shared_experts") for layer in moe.model.layers[1:])


def test_seeded_weights_and_bfloat16(tmp_path):
    a = build_random_model("qwen3", tmp_path / "a", seed=3)
    b = build_random_model("qwen3", tmp_path / "b", seed=3)
    c = build_random_model("qwen3", tmp_path / "c", seed=4)
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    bf = build_random_model("qwen3", tmp_path / "bf", dtype="bfloat16")
    model, _ = mlx_lm.load(str(bf))
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16


def test_parse_random_spec():
    assert parse_random_spec("llama:tiny") == ("llama", "tiny")
    assert parse_random_spec("gemma3_text:small") == ("gemma3_text", "small")
    assert parse_random_spec("qwen3") == ("qwen3", "tiny")
    with pytest.raises(ValueError, match=r"unknown model family 'gpt9'.*llama"):
        parse_random_spec("gpt9:tiny")
    with pytest.raises(ValueError, match=r"unknown model size 'huge'.*tiny"):
        parse_random_spec("llama:huge")


def test_random_model_dir_builds_once(tmp_path, monkeypatch):
    path = random_model_dir("llama:tiny", cache_root=tmp_path, seed=1)
    assert path == tmp_path / "llama-tiny-s1" and (path / MARKER).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["llama-tiny-s1"]  # no temp dirs left

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a complete model")

    monkeypatch.setattr(randmodel, "build_random_model", fail)
    assert random_model_dir("llama:tiny", cache_root=tmp_path, seed=1) == path
    monkeypatch.undo()

    (path / MARKER).unlink()  # looks half-written: must be rebuilt
    (path / "model.safetensors").unlink()
    assert random_model_dir("llama:tiny", cache_root=tmp_path, seed=1) == path
    assert (path / "model.safetensors").exists() and (path / MARKER).exists()

    monkeypatch.setenv("LOCALHEAP_CACHE", str(tmp_path / "env"))
    env_path = random_model_dir("qwen3:tiny")
    assert env_path == tmp_path / "env" / "random-models" / "qwen3-tiny-s0"
    mlx_lm.load(str(env_path))
