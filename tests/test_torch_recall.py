"""The recall tier on torch: pages hold the evicted K/V, recalled keys sit at correct RoPE
positions, the question recalls the page with the fact, sessions keep their pages, the
disk budget drops pages, and a heap that never evicts is still the stock cache."""

import sys

import numpy as np
import pytest
import torch
from recall_checks import CFG, assert_recorded_pages, prompt
from transformers import DynamicCache

from localheap.backends.torch import TorchBackend
from localheap.backends.torch import recall as recall_mod
from localheap.backends.torch.attention import cache_kwarg
from localheap.backends.torch.generate import generate_tokens, prefill
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def llama(model_dirs):
    # the CPU in float32 on every machine: these compare the pages' bits with numpy
    return TorchBackend.load(model_dirs("llama"), device="cpu", dtype=torch.float32)


def stock_kv(backend, tokens):
    """Layer 0's keys/values [H, T, D] from transformers' own cache (its inputs do not depend on eviction)."""
    cache = DynamicCache(config=backend.model.config)
    backend.model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            backend.model(input_ids=torch.tensor([tokens]), **cache_kwarg(backend.model, cache), use_cache=True)
    finally:
        backend.model.set_attn_implementation("localheap_sdpa")
    return cache.layers[0].keys[0], cache.layers[0].values[0]


def test_pages_hold_exactly_the_evicted_kv(llama, monkeypatch):
    recorded = []   # (layer id, positions [H, n], keys [H, n, D] as rotated in their slots, values, slots)
    real = recall_mod.gather_evicted

    def spy(cache, plan):
        for group in plan.groups:
            evicted = group.evicted.cpu().numpy()                          # [B, H, resident]
            for b, layer in enumerate(group.layers):
                H = evicted.shape[1]
                slots = np.stack([np.flatnonzero(evicted[b, h]) for h in range(H)])
                pos = np.take_along_axis(layer.heap.positions[:, : layer.heap.resident], slots, axis=1)
                idx = torch.as_tensor(slots)[..., None].expand(-1, -1, layer.keys.shape[-1])
                recorded.append((layer.heap.layer, pos, torch.gather(layer.keys[0], 1, idx).clone(),
                                 torch.gather(layer.values[0], 1, idx).clone(), slots))
        return real(cache, plan)

    monkeypatch.setattr(recall_mod, "gather_evicted", spy)
    cache = llama.new_cache(CFG)
    prefill(llama.model, cache, prompt(llama, 400))
    rope = cache.heap_layers[0].rope
    assert_recorded_pages(cache, recorded, lambda keys, slots: rope.rotate(keys, -torch.as_tensor(slots)).numpy())


@pytest.mark.parametrize("family", ["llama", "phi3", "glm4", "glm4_moe"])
def test_recalled_keys_equal_a_fresh_rotation_at_their_new_slot(model_dirs, llama, family):
    """Recalled keys sit where the model's own rotation puts them (phi3 and glm4 rotate part of each
    head, glm4 in interleaved pairs: a page-out or merge in the wrong layout lands elsewhere)."""
    backend = llama if family == "llama" else TorchBackend.load(model_dirs(family), device="cpu", dtype=torch.float32)
    model = backend.model
    apply = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def model_rotate(x, deltas):   # x [n, D] moved by deltas [n] with the model's rotary module and function
        cos, sin = model.model.rotary_emb(x[None], torch.as_tensor(deltas)[None])
        return apply(x[None, None], x[None, None], cos, sin)[1][0, 0]

    tokens = prompt(backend, 300, seed=1)
    for positions in ("compact", "absolute"):
        cache = backend.new_cache(CFG.with_(positions=positions))
        list(generate_tokens(model, cache, tokens, SamplingParams(max_tokens=1)))
        assert cache.recall_log and cache.recall_log[-1]["tokens"] == CFG.recall_budget
        layer = cache.heap_layers[0]
        stock_k, stock_v = stock_kv(backend, tokens)
        n = layer.heap.resident
        rec = layer.heap.recalled[:, :n]
        assert rec.sum(axis=1).tolist() == [CFG.recall_budget] * rec.shape[0]
        for h in range(rec.shape[0]):
            slots = np.flatnonzero(rec[h])
            pos = layer.heap.positions[h, slots]
            at = slots if positions == "compact" else pos
            want = model_rotate(stock_k[h, pos], at - pos)   # R(at) k_raw = R(at - p) R(p) k_raw
            torch.testing.assert_close(layer.keys[0, h, slots], want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values[0, h, slots], stock_v[h, pos], atol=1e-5, rtol=1e-5)


def test_a_heap_that_never_evicts_is_the_stock_cache_with_recall_on(llama):
    tokens = prompt(llama, 120, seed=2)
    big = CFG.with_(budget=400, recall_budget=64)
    params = SamplingParams(max_tokens=12)
    off = list(generate_tokens(llama.model, llama.new_cache(big.with_(recall=False)), tokens, params))
    cache = llama.new_cache(big)
    on = list(generate_tokens(llama.model, cache, tokens, params))
    assert on == off
    assert cache.pages.pages == 0 and cache.recall_log == []


def test_needle_bench_has_a_recall_column(llama, tmp_path, capsys):
    from localheap.bench import needle
    from localheap.cli import main

    base = HeapConfig(slack=64, recent=16, recall=True, recall_budget=64, page_size=16)
    result = needle.run_needle(llama, base, context=384, prune=(0.7,), policies=["snapkv"], positions=("compact",),
                               trials=2, long_contexts=(), seed=0)
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"full", "snapkv", "snapkv+recall"}
    r = rows["snapkv+recall"]
    assert r["recall_budget"] == 64 and r["recall_ms"] > 0 and r["disk_bytes_per_token"] > 0
    assert r["summary_bytes"] > 0 and "recall_ms" not in rows["snapkv"]
    assert "recall costs" in needle.tables(result) and result["settings"]["recall"]["page_size"] == 16
    rc = main(["bench", "needle", "--model", str(llama_path(llama)), "--backend", "torch", "--context", "256",
               "--trials", "1", "--prune", "70%", "--long-contexts", "320", "--long-trials", "1",
               "--budget", "96", "--slack", "64", "--recent", "16",
               "--recall", "on", "--recall-budget", "32", "--page-size", "16", "--recall-score", "zscore",
               "--plots", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "snapkv+recall" in out and "ms / 1K recalled" in out
    assert out.count("+recall") >= 2 * 5   # every policy, at 256 and at 320


def llama_path(backend):
    return backend.model.config._name_or_path


def test_a_question_whose_probe_fails_is_answered_without_recall(llama, monkeypatch):
    """An internal failure before the pick (the question's probe here) degrades that question to
    no recall, counted, and leaves the heap as a question with nothing to recall would: the reply
    is the one the same heap gives with an empty pick, and the next question recalls again."""
    from localheap.backends import paging

    tokens = prompt(llama, 300, seed=1)
    params = SamplingParams(max_tokens=4)
    empty = llama.new_cache(CFG)
    monkeypatch.setattr(paging, "pick_spans", lambda *a: {})
    want = list(generate_tokens(llama.model, empty, tokens, params))
    monkeypatch.undo()

    def broken(*a):
        raise RuntimeError("a bug in the probe")

    before = paging.FAULTS.recall_failed
    cache = llama.new_cache(CFG)
    monkeypatch.setattr(recall_mod, "probe", broken)
    assert list(generate_tokens(llama.model, cache, tokens, params)) == want
    assert paging.FAULTS.recall_failed == before + 1 and cache.recall_log[-1]["tokens"] == 0
    monkeypatch.undo()
    list(generate_tokens(llama.model, cache, prompt(llama, 8, seed=2), SamplingParams(max_tokens=1)))
    assert cache.recall_log[-1]["tokens"] > 0
