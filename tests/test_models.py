"""Where models come from: aliases, local paths, hub ids (up to the network call), random specs."""

import pytest

from localheap.models import ModelNotFound, detect_backend, presets, resolve_model
from localheap.randmodel import FAMILIES


def test_aliases_are_data_with_hub_repos():
    p = presets()
    assert "llama3-8b-q4" in p and p["llama3-8b-q4"].repo.startswith("mlx-community/")
    assert {e.family for e in p.values()} >= {"llama", "qwen2", "qwen3", "mistral", "gemma3_text"}
    # every preset's architecture is one the tests build and check against stock
    assert {e.family for e in p.values()} <= set(FAMILIES)


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ModelNotFound, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")


def test_local_dir_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path))


def test_hub_download_without_network_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotFound, match="pass a local") as e:
        resolve_model("mlx-community/Llama-3.2-1B-Instruct-4bit", progress=False)
    assert "Llama-3.2-1B-Instruct-4bit" in str(e.value)


def test_alias_goes_to_its_hub_repo(monkeypatch, tmp_path):
    seen = {}

    def fake_download(repo, progress=True):
        seen["repo"] = repo
        return tmp_path

    monkeypatch.setattr("localheap.models.download", fake_download)
    path, name = resolve_model("qwen3-8b-q4")
    assert seen["repo"] == presets()["qwen3-8b-q4"].repo and name == "qwen3-8b-q4"


def test_random_spec_builds_a_model_dir(model_dirs):
    path, name = resolve_model("random:llama:tiny")
    assert (path / "config.json").exists() and name == "random:llama:tiny"


def test_backend_choice():
    assert detect_backend("mlx") == "mlx" and detect_backend("torch") == "torch"
    assert detect_backend("auto") in ("mlx", "torch")
    with pytest.raises(ValueError):
        detect_backend("cuda")


def test_auto_without_torch_off_apple_silicon_takes_mlx_and_says_it_is_slower(monkeypatch, caplog):
    """auto falls back to MLX where the torch backend cannot be imported; off Apple Silicon that is
    MLX's CPU backend, and the user is told what it costs and how to get torch."""
    import sys

    import localheap.backends as backends

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delattr(backends, "torch", raising=False)
    monkeypatch.setitem(sys.modules, "localheap.backends.torch", None)   # the import fails
    with caplog.at_level("WARNING", logger="localheap"):
        assert detect_backend("auto") == "mlx"
        assert detect_backend("mlx") == "mlx"
        monkeypatch.setitem(sys.modules, "torch", None)   # what leave_torch_out does then (serve asks again after it)
        assert detect_backend("auto") == "mlx"
    said = [r.getMessage() for r in caplog.records if r.name == "localheap"]
    assert len(said) == 1 and "-e '.[torch]'" in said[0] and "--backend mlx" in said[0]


def _copy_of(tmp_path, name="model"):
    import shutil

    src, _ = resolve_model("random:llama:tiny")
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_an_mlx_quantized_checkpoint_on_torch_is_refused_by_name(model_dirs, tmp_path, monkeypatch):
    """The aliases are mlx-community's q4 checkpoints: on torch (auto's pick off Apple Silicon) they are
    refused before any download, and a local MLX-quantized directory before transformers' own message."""
    import json

    from localheap.models import load_backend

    monkeypatch.setattr("localheap.models.download", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(ModelNotFound, match="MLX-quantized checkpoint .*mlx-community/.*--backend mlx"):
        load_backend("qwen3-8b-q4", "torch")
    monkeypatch.chdir(tmp_path)   # a local directory named as an alias is that directory
    assert load_backend(str(_copy_of(tmp_path, "qwen3-8b-q4").name), "torch").model_name == "qwen3-8b-q4"
    d = _copy_of(tmp_path)
    config = json.loads((d / "config.json").read_text())
    quant = {"group_size": 64, "bits": 4}
    (d / "config.json").write_text(json.dumps({**config, "quantization": quant, "quantization_config": quant}))
    with pytest.raises(ModelNotFound, match="MLX-quantized checkpoint"):
        load_backend(str(d), "torch")


@pytest.mark.parametrize("damage", ["truncated_weights", "missing_layers", "bad_config"])
def test_a_broken_model_directory_is_one_line_that_names_it(model_dirs, tmp_path, damage):
    """A checkpoint cut short, one whose config.json asks for layers its weights lack (transformers filled
    them with random numbers and served), or a config.json that is not JSON: ModelNotFound naming the
    directory (the CLI's one line), never a traceback nor a model half random."""
    import json

    pytest.importorskip("torch")
    from localheap.models import load_backend

    d = _copy_of(tmp_path)
    weights = d / "model.safetensors"
    if damage == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "missing_layers":
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 2}))
    else:
        (d / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelNotFound, match=f"cannot load the model in {d}") as e:
        load_backend(str(d), "torch")
    assert "\n" not in str(e.value)
    if damage == "missing_layers":
        assert "lacks" in str(e.value)
    if damage == "bad_config":   # (the file named: the parser's own words say only where in some file)
        assert "config.json is not valid JSON" in str(e.value)


def test_a_checkpoints_fingerprint_follows_its_weights_not_its_place(model_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    from localheap.models import model_fingerprint

    a, b = _copy_of(tmp_path, "a"), _copy_of(tmp_path, "b")
    assert model_fingerprint(a) == model_fingerprint(b) is not None
    tensors = load_file(b / "model.safetensors")
    tensors = {k: v + 1 if v.dtype.kind == "f" else v for k, v in tensors.items()}   # fine-tuned: same shapes
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    assert model_fingerprint(a) != model_fingerprint(b)


def test_a_chat_renders_the_same_on_mlx_as_on_torch(model_dirs, tmp_path):
    """MLX's tokenizer wrapper adds enable_thinking (its vocabulary has <think>) to every render: the server
    renders with the Hugging Face tokenizer inside it, so a template that reads the flag gives one prompt on
    both backends (the random families' opened <think></think> on MLX only)."""
    pytest.importorskip("mlx.core")
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    from localheap.server.prompts import ChatOptions, chat_prompt
    from localheap.server.schemas import ChatMessage

    from family_templates import QWEN, with_template

    path = with_template(resolve_model("random:qwen3:tiny")[0], tmp_path / "m", QWEN)   # (it reads enable_thinking)
    wrapped, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    msgs = [ChatMessage(role="user", content="Hi")]
    for kwargs in ({}, {"enable_thinking": False}):
        opts = ChatOptions(template_kwargs=kwargs)
        assert chat_prompt(wrapped, msgs, opts=opts).text == chat_prompt(hf, msgs, opts=opts).text
