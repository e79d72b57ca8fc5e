"""Shared fixtures: tiny random-weight models of real architectures, built once per session."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
