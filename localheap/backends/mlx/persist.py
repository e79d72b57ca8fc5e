"""Save and restore a heap bit for bit (safetensors + JSON metadata)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...heap import HeapConfig
from ...heap.private import FILE_MODE, private_dir
from ..paging import checkpoint_pages, saved_pages_root, saved_pages_state
from .cache import HeapKVCache
from .heapcache import HeapPromptCache, make_heap_cache

_OPTIONAL = ("scores", "window", "counts")
LAYOUT_KEY = "localheap_layout"   # a heap saved by several ranks: its file holds the layout, each rank a shard


def write_layout(path: Path, layout: dict) -> None:
    """The file a heap saved by several ranks leaves at `path` (atomically): no arrays, only the
    layout ({"mode", "ranks"}); each rank's shard sits beside it (distributed.shard_path)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), {"layout": mx.array([layout["ranks"]])}, metadata={LAYOUT_KEY: json.dumps(layout)})
    os.replace(tmp, path)


def read_layout(path: Path) -> Optional[dict]:
    """The layout of a heap saved by several ranks at `path`; None for a heap saved by one process."""
    _, metadata = mx.load(str(path), return_metadata=True)
    return json.loads(metadata[LAYOUT_KEY]) if LAYOUT_KEY in metadata else None


def save_heap(cache: HeapPromptCache, path: Path, snapshot: bool = False) -> None:
    """Write atomically: a crash mid-save never leaves a half file under `path`. With recall on,
    the page store is checkpointed first and the file records where it is; a `snapshot` (a
    checkpoint) gets its own links of the store (paging.checkpoint_pages)."""
    path = Path(path)
    arrays: dict[str, mx.array] = {}
    meta: dict = {"config": cache.cfg.to_dict(), "layers": [], **checkpoint_pages(cache, path, snapshot),
                  "mark": cache.saved_mark}
    for i, c in enumerate(cache):
        if isinstance(c, HeapKVCache):
            entry = {"kind": "heap", "qcount": c.qcount}
            if c.keys is not None:
                n = c.heap.resident
                arrays[f"{i}.keys"] = c.keys[..., :n, :]
                arrays[f"{i}.values"] = c.values[..., :n, :]
                for name in _OPTIONAL:
                    if getattr(c, name) is not None:
                        arrays[f"{i}.{name}"] = getattr(c, name)[:, :n]
                if c.qsum is not None:
                    arrays[f"{i}.qsum"] = c.qsum
            st = c.heap.state()
            arrays[f"{i}.positions"] = mx.array(st["positions"])
            arrays[f"{i}.counters"] = mx.array(st["counters"])
            arrays[f"{i}.recalled"] = mx.array(st["recalled"])
        else:   # mlx-lm's own (a sliding window's RotatingKVCache): its state's arrays, and its numbers
            entry = {"kind": "stock", "state": None}   # (mlx-lm 0.32 keeps them in `state`; older ones in meta_state)
            if not c.empty():
                numbers = {}
                for j, a in enumerate(c.state):
                    if isinstance(a, mx.array):
                        arrays[f"{i}.state{j}"] = a
                    else:
                        numbers[str(j)] = a
                entry["state"] = {"n": len(c.state), "numbers": numbers}
                if getattr(c, "meta_state", None):
                    entry["meta_state"] = list(c.meta_state)
        meta["layers"].append(entry)
    private_dir(path.parent)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata={"localheap": json.dumps(meta)})
        os.chmod(tmp, FILE_MODE)
    except BaseException:   # a full disk: leave no partial file behind
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def load_heap(model, path: Path, pages_dir: Optional[Path] = None, budgets: Optional[list] = None) -> HeapPromptCache:
    """A heap saved by save_heap; with recall on, `pages_dir` (a fork's own directory) gets a
    copy of the saved page store (paging.saved_pages_root). `budgets`: make_heap_cache's."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    if LAYOUT_KEY in metadata:
        layout = json.loads(metadata[LAYOUT_KEY])
        raise ValueError(f"{path} was saved as {layout['mode']} on {layout['ranks']} ranks; this run is one process: "
                         f"restore it with the layout it was saved with (--distributed {layout['mode']} on "
                         f"{layout['ranks']} ranks)")
    meta = json.loads(metadata["localheap"])
    cfg = HeapConfig(**meta["config"])
    cache = make_heap_cache(model, cfg, saved_pages_root(path, meta, pages_dir) if cfg.recall else None, budgets,
                            saved_pages_state(meta))
    cache.recall_log = list(meta.get("recall_log", []))
    cache.mark_at = meta.get("mark")   # a heap-only cache rolls back to it (backends/slots.py)
    for i, (c, entry) in enumerate(zip(cache, meta["layers"])):
        if entry["kind"] == "heap":
            c.heap.load_state({"positions": np.array(arrays[f"{i}.positions"]),
                               "counters": np.array(arrays[f"{i}.counters"]),
                               **({"recalled": np.array(arrays[f"{i}.recalled"])}
                                  if f"{i}.recalled" in arrays else {})})
            c.qcount = entry["qcount"]
            if f"{i}.keys" in arrays:
                k, v = arrays[f"{i}.keys"], arrays[f"{i}.values"]
                n = k.shape[2]
                cap = c.heap.capacity
                c.keys = mx.zeros((1, k.shape[1], cap, k.shape[3]), k.dtype)
                c.values = mx.zeros((1, v.shape[1], cap, v.shape[3]), v.dtype)
                c.put("keys", slice(0, n), k)
                c.put("values", slice(0, n), v)
                for name in _OPTIONAL:
                    if f"{i}.{name}" in arrays:
                        c.put(name, slice(0, n), arrays[f"{i}.{name}"])
                c.qsum = arrays.get(f"{i}.qsum")
        elif entry.get("state") is not None:
            numbers = entry["state"]["numbers"]
            c.state = tuple(numbers[str(j)] if str(j) in numbers else arrays[f"{i}.state{j}"]
                            for j in range(entry["state"]["n"]))
            if entry.get("meta_state"):
                c.meta_state = tuple(entry["meta_state"])
        elif entry.get("meta_state") is not None:   # a file of an mlx-lm before 0.32: the arrays, the rest there
            n_state = sum(1 for key in arrays if key.startswith(f"{i}.state"))
            c.state = tuple(arrays[f"{i}.state{j}"] for j in range(n_state))
            c.meta_state = tuple(entry["meta_state"])
    mx.eval([c.state for c in cache])
    return cache
