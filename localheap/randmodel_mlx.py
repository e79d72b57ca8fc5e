"""Random-weight models built through mlx-lm: `--random-model` where torch is not installed.

Same config.json and tokenizer as randmodel.build_random_model (the torch builder); the
weights come from mlx-lm's own model class, drawn from N(0, initializer_range) like
transformers' init (not the same numbers: tests that compare libraries use the torch builder).
"""

from __future__ import annotations

from pathlib import Path

from .randmodel import _model_config, _write_json, build_tokenizer


def build_random_model_mlx(family: str, out_dir, size: str = "tiny", seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random-weight `family` model of preset `size` into `out_dir` (loadable by mlx-lm)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, save_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = _model_config(family, size, tok, None, False, dtype)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    std = cfg["initializer_range"]
    keys = iter(mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters()))))
    params = []
    for name, p in tree_flatten(model.parameters()):
        key = next(keys)
        if p.ndim >= 2:   # matrices and embeddings; norms keep mlx-lm's init
            p = mx.random.normal(p.shape, key=key) * std
        params.append((name, p.astype(getattr(mx, dtype))))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    save_model(out, model)
    _write_json(out / "config.json", cfg)
    return out
