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
