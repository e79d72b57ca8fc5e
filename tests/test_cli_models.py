"""`localheap models`: the aliases listed with what the hub cache holds of each (a cache built here
as huggingface_hub lays one out: blobs, snapshots linking them, refs), a model in the cache pulled
with nothing fetched (offline), one not in it refused with what to do, one removed and its disk
freed; names that are no model are errors, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parents[1]
QWEN = "mlx-community/Qwen2.5-7B-Instruct-4bit"   # the qwen2.5-7b-q4 alias's repo (models.toml)


def _cached_repo(cache: Path, repo: str, size: int) -> Path:
    """A downloaded repo as the hub cache holds it: one file of `size` bytes in snapshot c0ffee."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    (root / "snapshots" / "c0ffee").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "blobs" / "b10b").write_bytes(os.urandom(size))
    (root / "snapshots" / "c0ffee" / "model.safetensors").symlink_to("../../blobs/b10b")
    (root / "refs" / "main").write_text("c0ffee")
    return root


def _models(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "localheap.cli", "models", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_list_pull_and_remove(tmp_path):
    cache = tmp_path / "hub"
    qwen = _cached_repo(cache, QWEN, 2_500_000)
    _cached_repo(cache, "someone/own-model", 10)   # the same commit hash as qwen's (a copy of a repo shares them)
    listed = _models(cache)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines() if line.strip()}
    assert QWEN in rows["qwen2.5-7b-q4"] and "2.5 MB" in rows["qwen2.5-7b-q4"]
    assert rows["llama3-8b-q4"].rstrip().endswith("-")   # an alias not downloaded
    assert "10 B" in rows["someone/own-model"]           # a model in the cache no alias names
    assert str(cache) in listed.stdout
    pulled = _models(cache, "pull", "qwen2.5-7b-q4")     # offline: the cached snapshot, nothing fetched
    assert pulled.returncode == 0 and str(qwen / "snapshots" / "c0ffee") in pulled.stdout, pulled.stderr
    missing = _models(cache, "pull", "llama3-8b-q4")
    assert missing.returncode == 2 and "could not download" in missing.stderr and "--model" in missing.stderr
    removed = _models(cache, "rm", QWEN)   # by its repo id
    assert removed.returncode == 0 and "2.5 MB freed" in removed.stdout, removed.stderr
    assert not qwen.exists() and (cache / "models--someone--own-model").exists()
    again = _models(cache, "rm", "qwen2.5-7b-q4")
    assert again.returncode == 2 and "not downloaded" in again.stderr
    for bad in (("pull", "nope"), ("rm", "demo")):
        r = _models(cache, *bad)
        assert r.returncode == 2 and r.stderr.startswith("localheap: error:"), r.stderr


def test_list_before_anything_was_downloaded(tmp_path):
    listed = _models(tmp_path / "none-yet")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].startswith("demo")
