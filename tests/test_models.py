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
