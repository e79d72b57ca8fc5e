"""gpt-oss: the architecture (learned attention sinks, alternating sliding and full layers, a
mixture of experts) on both backends, and its checkpoint layouts on MLX."""

import json
import shutil

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")

from safetensors.numpy import load_file, save_file  # noqa: E402

from localheap.backends.mlx import make_heap_cache  # noqa: E402
from localheap.backends.mlx.generate import generate_tokens  # noqa: E402
from localheap.backends.mlx.loading import load, openai_layout  # noqa: E402
from localheap.generation import SamplingParams  # noqa: E402
from localheap.heap import HeapConfig  # noqa: E402


def _logits(path, ids):
    model, _ = load(path)
    return np.array(model(mx.array([ids]))[0])


def _openai_copy(src, dst):
    """The same weights in OpenAI's layout (experts [E, 2I, H] and [E, H, I]), as its plain
    (unquantized) checkpoints hold them."""
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    for k in list(w):
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            w[k] = np.ascontiguousarray(np.swapaxes(w[k], -1, -2))
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_both_checkpoint_layouts_load_to_the_same_model(model_dirs, tmp_path):
    path = model_dirs("gpt_oss")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] != 2 * cfg["intermediate_size"]   # the layouts tell apart by gate_up_proj
    ids = list(range(5, 45))
    ours = _logits(path, ids)
    theirs = _logits(_openai_copy(path, tmp_path / "openai"), ids)
    assert np.array_equal(ours, theirs)
    assert ours[-1].std() > 0.1


def test_the_layout_is_read_from_down_proj_where_gate_up_proj_cannot_tell():
    hidden, inner = 8, 4   # H == 2I: gate_up_proj is [E, 8, 8] in both layouts
    rng = np.random.default_rng(0)
    gate_up = mx.array(rng.normal(size=(2, hidden, 2 * inner)).astype(np.float32))
    down_tf = mx.array(rng.normal(size=(2, inner, hidden)).astype(np.float32))   # transformers: [E, I, H]
    w = openai_layout({"l.experts.gate_up_proj": gate_up, "l.experts.down_proj": down_tf}, hidden, inner)
    assert w["l.experts.down_proj.weight"].shape == (2, hidden, inner)
    assert mx.array_equal(w["l.experts.gate_up_proj.weight"], mx.swapaxes(gate_up, -1, -2)).item()
    down_oa = mx.swapaxes(down_tf, -1, -2)   # OpenAI's [E, H, I]: kept as it is
    w = openai_layout({"l.experts.gate_up_proj": gate_up, "l.experts.down_proj": down_oa}, hidden, inner)
    assert mx.array_equal(w["l.experts.down_proj.weight"], down_oa).item()


def test_a_shape_of_neither_layout_is_refused_with_its_name():
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj has shape \(2, 3, 5\)"):
        openai_layout({"model.layers.0.mlp.experts.gate_up_proj": mx.zeros((2, 3, 5))}, 8, 2)


def test_other_models_load_as_mlx_lm_loads_them(model_dirs):
    from mlx_lm import load as mlx_lm_load

    path = model_dirs("qwen3_moe")
    ids = list(range(5, 30))
    theirs, _ = mlx_lm_load(str(path))
    assert np.array_equal(_logits(path, ids), np.array(theirs(mx.array([ids]))[0]))


@pytest.mark.parametrize("positions", ["compact", "absolute"])
def test_the_heap_evicts_on_gpt_oss_and_keeps_the_sliding_layers_own(model_dirs, positions):
    """Past its budget the heap evicts in the full-attention layers; the sliding layers keep
    mlx-lm's rotating cache; decoding goes on (same tokens for the same heap)."""
    model, tok = load(model_dirs("gpt_oss"))
    ids = tok.encode(" ".join(f"the heap keeps token {i}" for i in range(120)))[:500]
    cfg = HeapConfig(budget=96, slack=32, recent=32, positions=positions)

    def run():
        cache = make_heap_cache(model, cfg)
        return list(generate_tokens(model, cache, ids, SamplingParams(max_tokens=40))), cache

    a, cache = run()
    stats = cache.stats()
    assert stats.evicted > 0 and stats.tokens_seen == len(ids) + 39
    assert len(a) == 40 and a == run()[0]
    assert len(stats.layers) == 1   # one heap layer (the full one); the sliding one is mlx-lm's


def test_torch_heap_evicts_on_gpt_oss_over_its_eager_attention(model_dirs):
    """transformers runs gpt-oss eagerly (its sinks sit in the softmax): the hook goes over that."""
    from localheap.backends.torch import TorchBackend
    from localheap.backends.torch.generate import generate_tokens as torch_tokens

    backend = TorchBackend.load(model_dirs("gpt_oss"), device="cpu", dtype=torch.float32)
    assert backend.model.config._attn_implementation == "localheap_eager"
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i}" for i in range(120)))[:500]
    cache = backend.new_cache(HeapConfig(budget=96, slack=32, recent=32))
    out = list(torch_tokens(backend.model, cache, ids, SamplingParams(max_tokens=40)))
    stats = cache.stats()
    assert len(out) == 40 and stats.evicted > 0 and stats.tokens_seen == len(ids) + 39


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("family,kwargs", [("gpt_oss", {}), ("llama", {"rope_scaling": LLAMA3_ROPE})])
def test_a_model_loaded_on_one_thread_runs_on_another(model_dirs, family, kwargs):
    """The server loads the model on the main thread and runs it on the engine's. A RoPE's precomputed
    frequencies (YaRN, llama3 scaling) were left a lazy graph of the loading thread's stream, and the
    engine's first prefill failed ("There is no Stream(cpu, 0) in current thread")."""
    import threading

    from localheap.backends.mlx import MLXBackend

    backend = MLXBackend.load(model_dirs(family, **kwargs))
    errors = []

    def run():
        try:
            cache = backend.new_cache(HeapConfig(budget=64, slack=32, recent=16))
            backend.prefill(cache, list(range(5, 100)))
            list(backend.generate(cache, [7], SamplingParams(max_tokens=3)))
        except Exception as e:   # noqa: BLE001 (the test reports it)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
