"""Shared fixtures: tiny random-weight models of real architectures, built once per session."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# serve and chat freeze what is alive when they start (commands/common.freeze_startup_objects): in
# this process that would keep every earlier test's cycles for ever (test_cli.py tests it unfrozen)
os.environ.setdefault("LOCALHEAP_GC_FREEZE", "0")

# The files that take longest, longest first (serial durations on the CI machine, 2 cores,
# 2026-12-01: 254 s for the first, about 25 s for the last). The README's test command runs the
# files on two workers or more (pytest-xdist, --dist loadfile, which hands each worker the next file
# when it has done one): a long file handed out last would leave one worker running it alone.
SLOW_FIRST = ("test_mlx_distributed_serve.py", "test_mlx_distributed.py", "test_torch_compiled_decode.py",
              "test_commit_faults.py", "test_demo_model.py", "test_budget_server.py", "test_server_disk.py",
              "test_mlx_batch.py", "test_facts.py", "test_server_tools.py", "test_fault_injection.py",
              "test_web_layout.py", "test_web_ui.py", "test_agent_clis.py", "test_engine_batch.py",
              "test_server_app.py", "test_serve_crash.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest as collected


@pytest.fixture(scope="session", autouse=True)
def temp_root(tmp_path_factory):
    """What the code under test puts in the system temp directory (a store's spill directory, a
    chat's, a rank's, a server subprocess's) goes under this run's pytest directory, which pytest
    prunes (it keeps the last three runs): a test run never leaves hundreds of directories in /tmp."""
    root = tmp_path_factory.mktemp("tmp", numbered=False)
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(root)
    yield root
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """family -> directory of a tiny random model (HF format, loadable by mlx-lm and transformers)."""
    from localheap.randmodel import build_random_model

    cache = {}

    def get(family: str, **kwargs):
        key = (family, repr(sorted(kwargs.items())))
        if key not in cache:
            name = family + "".join(f"-{k}" for k in sorted(kwargs))
            cache[key] = build_random_model(family, tmp_path_factory.mktemp(name), **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def torch_one_thread():
    """Tiny torch models: one intra-op thread is faster and far steadier on a small shared CPU
    (two threads contending with other processes made those tests 5x slower)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


RANK_ENV = Path(__file__).parent / "rank_env"


@pytest.fixture(scope="session")
def calm_ring(tmp_path_factory):
    """tests/rank_env/calm_ring.c built (None where there is no C compiler, or not on Linux)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not sys.platform.startswith("linux") or cc is None:
        return None
    out = tmp_path_factory.mktemp("calm_ring") / "calm_ring.so"
    built = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(RANK_ENV / "calm_ring.c"), "-ldl"],
                           capture_output=True, text=True)
    return out if built.returncode == 0 else None


@pytest.fixture
def rank_env(monkeypatch, calm_ring):
    """The processes a test starts (the MLX ranks) run, on Linux, with rank_env/calm_ring.c
    preloaded: MLX's ring waits in poll() instead of spinning."""
    if calm_ring is not None:
        monkeypatch.setenv("LD_PRELOAD", " ".join([str(calm_ring), *filter(None, [os.environ.get("LD_PRELOAD")])]))


@pytest.fixture
def force(server):
    """force(text): every request to the module's `server` until the test ends samples exactly
    `text`'s tokens, then EOS (the server's test-only hook; the template, parser, stream and session
    run for real)."""
    from localheap.grammar import ForcedTokens

    svc = server.services

    def set_text(text: str) -> None:
        ids = svc.tokenizer.encode(text, add_special_tokens=False)
        svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)

    yield set_text
    svc.force_tokens = None


@pytest.fixture
def lead(server):
    """lead(text): each reply begins with `text`'s tokens, then the request's own constraint holds it
    (the server's test-only `lead_tokens` hook: a random model will not open a call by itself)."""
    svc = server.services

    def set_text(text):
        svc.lead_tokens = None if text is None else svc.tokenizer.encode(text, add_special_tokens=False)

    yield set_text
    svc.lead_tokens = None
    svc.settings.tool_grammar = True


@pytest.fixture(scope="module", params=["torch", "mlx"])
def demo_either(request):
    """The bundled demo model on each backend in turn (torch in float32; MLX skipped where mlx is
    not installed, as on a CUDA machine)."""
    from localheap.models import demo_model_dir

    if request.param == "torch":
        import torch

        from localheap.backends.torch import TorchBackend

        return TorchBackend.load(demo_model_dir(), dtype=torch.float32)
    pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
    from localheap.backends.mlx import MLXBackend

    return MLXBackend.load(demo_model_dir())
