"""Save and restore a heap bit for bit (safetensors + JSON metadata)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ...heap import HeapConfig
from ...heap.private import FILE_MODE, private_dir
from ..paging import checkpoint_pages, saved_pages_root, saved_pages_state
from .cache import HeapCache, make_heap_cache
from .layer import HeapLayer

_OPTIONAL = ("scores", "window", "counts")


def save_heap(cache: HeapCache, path: Path, snapshot: bool = False) -> None:
    """Write atomically: a crash mid-save never leaves a half file under `path`. With recall on,
    the page store is checkpointed first (a store in a temp dir is moved beside the file) and the
    file records where it is, relative to its own directory (sessions keep one store per session
    across the generations of their heap file); a `snapshot` (a checkpoint) gets its own links
    of the store (paging.checkpoint_pages)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"config": cache.cfg.to_dict(), "layers": [], **checkpoint_pages(cache, path, snapshot),
                  "mark": cache.saved_mark}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, HeapLayer):
            n = layer.heap.resident
            meta["layers"].append({"kind": "heap", "qcount": layer.qcount})
            tensors[f"{i}.keys"] = layer.keys[:, :, :n]
            tensors[f"{i}.values"] = layer.values[:, :, :n]
            for name in _OPTIONAL:
                if getattr(layer, name) is not None:
                    tensors[f"{i}.{name}"] = getattr(layer, name)[:, :n]
            if layer.qsum is not None:
                tensors[f"{i}.qsum"] = layer.qsum
            st = layer.heap.state()
            tensors[f"{i}.positions"] = torch.from_numpy(st["positions"])
            tensors[f"{i}.counters"] = torch.from_numpy(st["counters"])
            tensors[f"{i}.recalled"] = torch.from_numpy(st["recalled"])
        else:
            meta["layers"].append({"kind": "sliding", "cumulative_length": layer.cumulative_length})
            if layer.is_initialized:
                tensors[f"{i}.keys"], tensors[f"{i}.values"] = layer.keys, layer.values
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    path = Path(path)
    private_dir(path.parent)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    try:
        save_file(tensors, str(tmp), metadata={"localheap": json.dumps(meta)})
        os.chmod(tmp, FILE_MODE)
    except BaseException:   # a full disk: leave no partial file behind
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def load_heap(model, path: Path, pages_dir: Optional[Path] = None) -> HeapCache:
    """A heap saved by save_heap; with recall on, `pages_dir` (a fork's own directory) gets a
    copy of the saved page store (paging.saved_pages_root)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["localheap"])
    tensors = load_file(str(path))
    cfg = HeapConfig(**meta["config"])
    cache = make_heap_cache(model, cfg, saved_pages_root(path, meta, pages_dir) if cfg.recall else None,
                            saved_pages_state(meta))
    cache.recall_log = list(meta.get("recall_log", []))
    cache.mark_at = meta.get("mark")   # a heap-only cache rolls back to it (backends/slots.py)
    device = cache.device
    for i, (layer, entry) in enumerate(zip(cache.layers, meta["layers"])):
        assert (entry["kind"] == "heap") == isinstance(layer, HeapLayer), f"layer {i} changed kind"
        if entry["kind"] == "heap":
            layer.heap.load_state({"positions": tensors[f"{i}.positions"].numpy(),
                                   "counters": tensors[f"{i}.counters"].numpy(),
                                   **({"recalled": tensors[f"{i}.recalled"].numpy()}
                                      if f"{i}.recalled" in tensors else {})})
            n = layer.heap.resident
            layer.keys[:, :, :n] = tensors[f"{i}.keys"].to(device)
            layer.values[:, :, :n] = tensors[f"{i}.values"].to(device)
            for name in _OPTIONAL:
                if f"{i}.{name}" in tensors:
                    getattr(layer, name)[:, :n] = tensors[f"{i}.{name}"].to(device)
            layer.qcount = entry["qcount"]
            layer.qsum = tensors[f"{i}.qsum"].to(device) if f"{i}.qsum" in tensors else None
        elif f"{i}.keys" in tensors:
            layer.lazy_initialization(tensors[f"{i}.keys"].to(device), tensors[f"{i}.values"].to(device))
            layer.keys, layer.values = tensors[f"{i}.keys"].to(device), tensors[f"{i}.values"].to(device)
            layer.cumulative_length = entry["cumulative_length"]
    return cache
