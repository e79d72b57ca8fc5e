"""The recall tier on MLX: pages hold exactly the evicted K/V, recalled keys sit at correct RoPE
positions, a heap that never evicts is still mlx-lm's cache, torch pages out the same tokens,
and the speed bench times paging. What both backends share is in test_recall_backends.py."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from recall_checks import CFG, assert_recorded_pages, load_all, prompt  # noqa: E402

from localheap.backends.mlx import MLXBackend  # noqa: E402
from localheap.backends.mlx import recall as recall_mod  # noqa: E402
from localheap.backends.mlx.generate import generate_steps, generate_tokens, prefill  # noqa: E402
from localheap.generation import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llama(model_dirs):
    return MLXBackend.load(model_dirs("llama"))


def stock_kv(backend, tokens):
    """Layer 0's keys (rotated at their positions) and values [H, T, D] from mlx-lm's own cache."""
    cache = make_prompt_cache(backend.model)
    mx.eval(backend.model(mx.array(tokens)[None], cache=cache))
    return np.array(cache[0].keys[0, :, : len(tokens)]), np.array(cache[0].values[0, :, : len(tokens)])


def unrotate(rope, keys: np.ndarray, at: np.ndarray) -> np.ndarray:
    """keys [H, n, D] rotated at positions `at` [H, n] -> pre-RoPE."""
    return np.array(rope.rotate(mx.array(keys), -at))


def test_pages_hold_exactly_the_evicted_kv(llama, monkeypatch):
    recorded = []   # (layer id, positions [H, n], keys [H, n, D] as rotated in their slots, values, slots)
    real = recall_mod.gather_evicted

    def spy(cache, plan):
        for group in plan.groups:
            keep = np.array(group.keep_indices)                                # [B, H, keep]
            for b, layer in enumerate(group.layers):
                n = layer.heap.resident
                H = keep.shape[1]
                slots = np.stack([np.setdiff1d(np.arange(n), keep[b, h]) for h in range(H)])
                if slots.shape[1] == 0:
                    continue
                pos = np.take_along_axis(layer.heap.positions[:, :n], slots, axis=1)
                keys = np.take_along_axis(np.array(layer.keys[0, :, :n]), slots[..., None], axis=1)
                values = np.take_along_axis(np.array(layer.values[0, :, :n]), slots[..., None], axis=1)
                recorded.append((layer.heap.layer, pos, keys, values, slots))
        return real(cache, plan)

    monkeypatch.setattr(recall_mod, "gather_evicted", spy)
    tokens = prompt(llama, 400)
    cache = llama.new_cache(CFG)
    prefill(llama.model, cache, tokens, CFG.chunk)
    rope = cache.heap_layers[0].rope
    assert_recorded_pages(cache, recorded, lambda keys, slots: unrotate(rope, keys, slots))   # compact: at the slot
    store = cache.pages
    # layer 0's inputs do not depend on eviction: its pages are mlx-lm's own K/V, pre-RoPE
    stock_k, stock_v = stock_kv(llama, tokens)
    got_pos, got_k, got_v = load_all(store, 0)
    for h in range(stock_k.shape[0]):
        np.testing.assert_allclose(got_v[h], stock_v[h, got_pos[h]], atol=1e-6)
        want = unrotate(rope, stock_k[h, got_pos[h]][None], got_pos[h][None])[0]
        np.testing.assert_allclose(got_k[h], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "phi3", "glm4", "glm4_moe"])
def test_recalled_keys_equal_a_fresh_rotation_at_their_new_slot(model_dirs, llama, family):
    """Also where RoPE turns part of each head (phi3: 3/4 in split halves; glm4: 1/2, interleaved)."""
    backend = llama if family == "llama" else MLXBackend.load(model_dirs(family))
    tokens = prompt(backend, 300, seed=1)
    stock_k, stock_v = stock_kv(backend, tokens)
    rope = backend.model.model.layers[0].self_attn.rope
    for positions in ("compact", "absolute"):
        cache = backend.new_cache(CFG.with_(positions=positions))
        list(generate_tokens(backend.model, cache, tokens, SamplingParams(max_tokens=1)))
        assert cache.recall_log and cache.recall_log[-1]["tokens"] == CFG.recall_budget
        layer = cache.heap_layers[0]
        n = layer.heap.resident
        rec = layer.heap.recalled[:, :n]
        assert rec.sum(axis=1).tolist() == [CFG.recall_budget] * rec.shape[0]
        keys, values = np.array(layer.keys[0]), np.array(layer.values[0])
        for h in range(rec.shape[0]):
            slots = np.flatnonzero(rec[h])
            pos = layer.heap.positions[h, slots]
            at = slots if positions == "compact" else pos
            # R(at) k_raw = R(at - p) R(p) k_raw, by the model's own rope module (one token per row)
            moved = rope(mx.array(stock_k[h, pos])[:, None, None], offset=mx.array((at - pos).astype(np.int32)))
            want = np.array(moved)[:, 0, 0]
            np.testing.assert_allclose(keys[h, slots], want, atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(values[h, slots], stock_v[h, pos], atol=1e-5, rtol=1e-5)


def test_a_heap_that_never_evicts_is_mlx_lms_cache_with_recall_on(llama):
    tokens = prompt(llama, 120, seed=2)
    big = CFG.with_(budget=400, recall_budget=64)
    n = 12
    stock = generate_step(mx.array(tokens), llama.model, max_tokens=n, sampler=make_sampler(0.0),
                          prefill_step_size=big.chunk, prompt_cache=make_prompt_cache(llama.model))
    want = [(int(t), np.array(lp)) for t, lp in stock]
    cache = llama.new_cache(big)
    got = [(t, np.array(lp)) for t, lp in generate_steps(llama.model, cache, tokens, SamplingParams(max_tokens=n))]
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert cache.pages.pages == 0 and cache.recall_log == []


def test_torch_and_mlx_page_out_the_same_tokens(model_dirs, llama):
    """The same weights, prompt and heap on both backends: the same pages (streaming evicts the
    same slots on both), holding the same K/V within float tolerance."""
    pytest.importorskip("torch")
    from localheap.backends.torch import TorchBackend
    from localheap.backends.torch.generate import prefill as torch_prefill

    cfg = CFG.with_(policy="streaming")
    tokens = prompt(llama, 300, seed=11)
    pt = TorchBackend.load(model_dirs("llama"))
    caches = {"mlx": llama.new_cache(cfg), "torch": pt.new_cache(cfg)}
    prefill(llama.model, caches["mlx"], tokens, cfg.chunk)
    torch_prefill(pt.model, caches["torch"], tokens)
    for c in caches.values():
        c.writer.drain()
    a, b = caches["mlx"].pages, caches["torch"].pages
    assert a.pages == b.pages > 0 and a.g == b.g
    for layer in range(a.g.n_layers):
        (pa, ka, va), (pb, kb, vb) = load_all(a, layer), load_all(b, layer)
        np.testing.assert_array_equal(pa, pb)
        np.testing.assert_allclose(ka, kb, atol=2e-4, rtol=1e-3)
        np.testing.assert_allclose(va, vb, atol=2e-4, rtol=1e-3)


def test_speed_bench_times_paging_against_off(model_dirs, capsys):
    from localheap.cli import main

    rc = main(["bench", "speed", "--model", str(model_dirs("llama")), "--backend", "mlx", "--contexts", "300",
               "--decode-tokens", "2", "--budget", "96", "--slack", "32", "--recent", "16",
               "--recall", "on", "--recall-budget", "32", "--page-size", "8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "heap-paging" in out and "stock-full" in out
