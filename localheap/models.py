"""Where a model comes from: an alias in models.toml, a local path, a hub repo, or a
random-weight model of a real architecture built here (`random:llama:tiny`).

Knows nothing about tensors; returns directories.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


class ModelNotFound(LookupError):
    """The model could not be found or fetched; the message says what to do."""


@dataclass(frozen=True)
class ModelPreset:
    alias: str
    repo: str
    family: str
    context: int


def presets() -> dict[str, ModelPreset]:
    text = resources.files("localheap").joinpath("models.toml").read_text()
    data = tomllib.loads(text).get("models", {})
    return {alias: ModelPreset(alias, e["repo"], e["family"], int(e.get("context", 8192))) for alias, e in data.items()}


def demo_model_dir() -> Optional[Path]:
    """The small model shipped inside the package, when it is there."""
    path = Path(str(resources.files("localheap").joinpath("demo_model")))
    return path if (path / "config.json").exists() else None


def model_name_of(spec: Optional[str]) -> Optional[str]:
    """The name a loaded backend will carry for a --model argument, known without loading or
    downloading it (the server locks its sessions directory, named after it, before the model
    loads). An in-memory real shape's carries the dtype its device takes (torch imported to
    tell: it builds it; None where torch is not installed)."""
    if spec is None or spec == "demo":
        return "demo"
    if spec.startswith("random:"):
        from . import randbig
        shape = spec[len("random:"):]
        if not randbig.is_real_shape(shape):
            return spec
        try:
            return randbig.model_name(shape)
        except ImportError:   # (loading it says why)
            return None
    local = Path(spec).expanduser()
    return local.name if local.exists() else spec


def resolve_model(spec: Optional[str], progress: bool = True) -> tuple[Path, str]:
    """(directory, display name) for a --model argument; the name is model_name_of(spec)."""
    if spec is None or spec == "demo":
        path = demo_model_dir()
        if path is None:
            raise ModelNotFound(
                "no bundled demo model in this installation yet; pass --model PATH "
                "(a local mlx-lm/Hugging Face model directory) or --model random:llama:tiny "
                "to try the server with random weights"
            )
        return path, "demo"
    if spec.startswith("random:"):
        from .randmodel import RandomModelUnavailable, random_model_dir
        try:
            return random_model_dir(spec[len("random:"):]), spec
        except RandomModelUnavailable as e:
            raise ModelNotFound(str(e)) from e
    local = Path(spec).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise ModelNotFound(f"{local} has no config.json; is it a model directory?")
        return local, local.name
    preset = presets().get(spec)
    repo = preset.repo if preset else spec
    if preset is None and spec.count("/") != 1:
        known = ", ".join(sorted(presets()))
        raise ModelNotFound(f"unknown model {spec!r}: not a local path, an alias ({known}) or a hub repo id (org/name)")
    return download(repo, progress=progress), spec


def download(repo: str, progress: bool = True) -> Path:
    """Fetch a hub repo (weights, config, tokenizer) with progress bars."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - mlx-lm depends on it
        raise ModelNotFound("huggingface_hub is not installed; pass a local path") from e
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        path = snapshot_download(
            repo, allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
        )
    except Exception as e:  # network errors come in many types
        raise ModelNotFound(
            f"could not download {repo} ({type(e).__name__}: {e}). Without network, pass a local "
            f"model directory: --model /path/to/model (an mlx-lm or Hugging Face checkpoint)"
        ) from e
    return Path(path)


def detect_backend(preferred: str = "auto") -> str:
    """auto: mlx on Apple Silicon, torch with CUDA, else torch on the CPU when installed
    (measured faster than MLX's CPU backend, see README), else mlx."""
    if preferred in ("mlx", "torch"):
        return preferred
    if preferred != "auto":
        raise ValueError(f"unknown backend {preferred!r}; choose auto, mlx or torch")
    if sys.platform == "darwin" and os.uname().machine == "arm64":
        return "mlx"
    try:
        from .backends import torch as _  # noqa: F401  (imports torch and transformers)
    except ImportError as e:
        if "torch" in sys.modules and sys.modules["torch"] is None:   # left out (leave_torch_out): MLX was
            return "mlx"                                               # chosen already, and the user told why
        logging.getLogger("localheap").warning(
            "the torch backend is unavailable (%s), so MLX runs here on its CPU backend, which ran prefill "
            "about 16x and decode about 1.4x slower than torch on an x86 CPU (README, Backends): "
            "pip install -e '.[torch]' in localheap's checkout for it, or pass --backend mlx to keep MLX and silence this", e)
        return "mlx"
    return "torch"


def leave_torch_out(spec: Optional[str]) -> None:
    """For a process that runs MLX alone: torch, which transformers (mlx-lm's tokenizers) imports
    wherever it is installed, is hidden (`import torch` fails as where it is not installed, and
    transformers runs without it). Where torch is installed that is about 2.4 s of start and 240 MB
    of RSS a process (measured on a 2-core x86 machine: the demo server held 151 MB at start where
    it held 390; each rank of --distributed is one process). Nothing is
    hidden where torch is imported already, or for a random: spec (its builder prefers torch, for the
    same weights everywhere). Call it before anything imports transformers."""
    if "torch" in sys.modules or (spec or "").startswith("random:"):
        return
    sys.modules["torch"] = None


def load_backend(spec: Optional[str], backend: str = "auto"):
    """Resolve a model spec and load it on the chosen backend. `random:llama:8b` and the other
    real shapes of randbig.SHAPES are built in memory on the device (torch), never saved."""
    from . import randbig

    if spec is not None and spec.startswith("random:") and randbig.is_real_shape(spec[len("random:"):]):
        if backend == "mlx":
            raise ModelNotFound(f"{spec} is built in memory by the torch backend only; pass --backend torch")
        try:   # auto picks torch for these shapes wherever torch loads (an Apple machine too)
            from .backends import torch as _  # noqa: F401
        except ImportError as e:
            raise ModelNotFound(f"{spec} is built in memory by the torch backend, which is unavailable ({e}); "
                                f"pip install -e '.[torch]' in localheap's checkout") from e
        return randbig.load_torch_backend(spec[len("random:"):])
    kind = detect_backend(backend)
    preset = presets().get(spec) if spec is not None and not Path(spec).expanduser().exists() else None
    if preset is not None and kind == "torch":   # before gigabytes are downloaded for nothing (a local directory
                                                 # of an alias's name is that directory)
        raise ModelNotFound(f"{spec} is an MLX-quantized checkpoint ({preset.repo}): it runs on the MLX backend "
                            f"(Apple Silicon, or --backend mlx); on torch pass an unquantized Hugging Face repo id "
                            f"or a local model directory")
    path, name = resolve_model(spec)
    if kind == "torch" and mlx_quantized(path):
        raise ModelNotFound(f"{path} is an MLX-quantized checkpoint (config.json's \"quantization\"): it runs on "
                            f"the MLX backend (--backend mlx); on torch pass an unquantized checkpoint")
    try:
        if kind == "mlx":
            from .backends.mlx import MLXBackend
            backend_ = MLXBackend.load(path, model_name=name)
        else:
            try:
                from .backends.torch import TorchBackend
            except ImportError as e:
                raise ModelNotFound(f"the torch backend is unavailable ({e}); pip install -e '.[torch]' in localheap's "
                                    f"checkout or use --backend mlx") from e
            backend_ = TorchBackend.load(path, model_name=name)
    except ModelNotFound:
        raise
    except Exception as e:   # a broken directory: one line that names it, never a traceback
        detail = (str(e).strip().splitlines() or [""])[0][:300]
        raise ModelNotFound(f"cannot load the model in {path}{_what_is_broken(path)}: {type(e).__name__}: "
                            f"{detail}") from e
    backend_.model_key = model_fingerprint(path)
    return backend_


def _what_is_broken(path: Path) -> str:
    """The files of a directory that failed to load which are plainly broken (JSON that does not parse, no
    tokenizer), named for the error line ("" where none is)."""
    import json

    path = Path(path)
    bad = []
    for f in sorted(path.glob("*.json")):
        try:
            json.loads(f.read_text())
        except (OSError, ValueError):
            bad.append(f"{f.name} is not valid JSON")
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")):
        bad.append("it has no tokenizer file (tokenizer.json)")
    return f" ({'; '.join(bad)})" if bad else ""


def mlx_quantized(path: Path) -> bool:
    """Whether config.json says its weights are quantized MLX's way (mlx-community's q4 and q8)."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or not isinstance(config.get("quantization"), dict):
        return False
    hf = config.get("quantization_config")   # (mlx-lm copies its own there too, with no quant_method)
    return not (isinstance(hf, dict) and "quant_method" in hf)


FINGERPRINT_SAMPLE = 1 << 16   # bytes read from the middle of each weights file


def model_fingerprint(path: Path) -> Optional[str]:
    """A checkpoint's identity for its saved sessions (sessions/recover.py): its config.json, and each
    weights file's name, size and 64 KiB from its middle (two fine-tuned checkpoints of one shape differ
    there; the same files installed elsewhere do not). None where it has no files to tell by."""
    import zlib

    path = Path(path)
    try:
        crc = zlib.crc32((path / "config.json").read_bytes())
        for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
            size = f.stat().st_size
            with open(f, "rb") as fh:
                fh.seek(max(0, size // 2 - FINGERPRINT_SAMPLE // 2))
                crc = zlib.crc32(f"{f.name}:{size}".encode() + fh.read(FINGERPRINT_SAMPLE), crc)
    except OSError:
        return None
    return f"{crc:08x}"
