"""What the torch, MLX and backend-neutral recall tests share: a small heap with recall on,
random prompts, and checks of a page store (numpy in, no backend)."""

import numpy as np

from localheap.heap import HeapConfig

# f32 pages (exact); 32 of the 96 slots are the recall region, 4 pages of 8 tokens
CFG = HeapConfig(budget=96, sinks=4, recent=16, slack=32, policy="snapkv", recall=True,
                 recall_budget=32, page_size=8, page_format="f32", obs_window=8)


def prompt(backend, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, backend.vocab_size, n).tolist()


def load_all(store, layer: int):
    """Every live full page of `layer`: positions [H, n], keys (pre-RoPE), values [H, n, D]."""
    slots, *_ = store.summaries(layer)
    return store.load(layer, np.broadcast_to(slots, (store.g.n_kv_heads, len(slots))).copy())


def assert_pages_hold(store, layer: int, pos: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    """The full pages of `layer` hold exactly these evicted tokens (f32 pages: values bit for bit,
    keys within one un-rotation). pos [H, m]; keys (pre-RoPE), values [H, m, D]; m >= what is on
    disk (the partial page waits in RAM)."""
    got_pos, got_k, got_v = load_all(store, layer)
    n = got_pos.shape[1]
    assert n == len(store.summaries(layer)[0]) * store.g.page_size and n > 0
    for h in range(pos.shape[0]):
        order = np.argsort(pos[h], kind="stable")[: n]
        want_pos = pos[h][order]
        at = np.searchsorted(want_pos, got_pos[h])
        np.testing.assert_array_equal(want_pos[at], got_pos[h])
        np.testing.assert_array_equal(got_v[h], values[h][order][at])
        np.testing.assert_allclose(got_k[h], keys[h][order][at], atol=1e-6)


def assert_recorded_pages(cache, recorded, unrotate) -> None:
    """Each layer's pages hold exactly what a spy on gather_evicted recorded: rows of (layer id,
    positions [H, n], keys as rotated in their slots, values, slots); unrotate(keys, slots) gives
    the pre-RoPE keys as numpy."""
    cache.writer.drain()
    assert cache.pages.pages > 0 and recorded
    for layer_id in range(len(cache.heap_layers)):
        mine = [r for r in recorded if r[0] == layer_id]
        pos = np.concatenate([r[1] for r in mine], axis=1)
        keys = np.concatenate([unrotate(r[2], r[4]) for r in mine], axis=1)
        values = np.concatenate([np.asarray(r[3]) for r in mine], axis=1)
        assert_pages_hold(cache.pages, layer_id, pos, keys, values)
