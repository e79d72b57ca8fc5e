"""The heap package is pure logic: it imports with mlx and torch blocked."""

import subprocess
import sys
import textwrap


def test_heap_imports_without_mlx_or_torch():
    code = textwrap.dedent("""
        import sys
        for name in ("mlx", "mlx.core", "mlx_lm", "torch", "transformers"):
            sys.modules[name] = None   # any import of these now raises ImportError
        import localheap.heap as heap
        import numpy as np
        cfg = heap.HeapConfig(budget=8, sinks=2, recent=2, slack=4, policy="h2o")
        layer = heap.LayerHeap(cfg, n_kv_heads=2, budget=8)
        layer.append(14)
        plan = layer.plan(heap.SlotView(positions=layer.view_positions(),
                                        attention=np.random.default_rng(0).random((2, 14))))
        layer.apply(plan)
        assert layer.resident == 10
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_stats_to_dict_is_asdict_with_the_layers_extras_and_copies_the_pages():
    from dataclasses import asdict

    from localheap.heap.stats import HeapStats, LayerStats

    layers = [LayerStats(layer=i, capacity=100, budget=90, resident=80 + i, seen=500, evicted=420 - i, evictions=3,
                         sinks=4, recent=16, recalled=i) for i in range(3)]
    pages = {"pages": 7, "last_recall": {"tokens": 64, "ms": 1.5, "parts": {"pick": 0.7}}, "spans": [(1, 2), (5, 9)],
             "degraded": None}
    stats = HeapStats(tokens_seen=500, resident=82, evicted=420, capacity=100, kv_bytes=4096, evictions=3,
                      layers=layers, recalled=2, pages=pages)
    want = asdict(stats)
    for ld, ls in zip(want["layers"], layers):
        ld["heavy_hitters"], ld["free"] = ls.heavy_hitters, ls.free
    got = stats.to_dict()
    assert got == want and list(got) == list(want)
    assert [list(ld) for ld in got["layers"]] == [list(ld) for ld in want["layers"]]
    assert got["pages"]["spans"] == [(1, 2), (5, 9)] and isinstance(got["pages"]["spans"][0], tuple)
    got["pages"]["last_recall"]["parts"]["pick"] = 99.0     # a reader's copy: the stats keep theirs
    got["pages"]["spans"].append((0, 0))
    assert pages["last_recall"]["parts"]["pick"] == 0.7 and len(pages["spans"]) == 2
    flat = stats.to_dict(per_layer=False)
    want.pop("layers")
    assert flat == {k: v for k, v in want.items()} and "layers" not in flat
    none = HeapStats(tokens_seen=0, resident=0, evicted=0, capacity=0, kv_bytes=0, evictions=0)
    assert none.to_dict() == asdict(none)
