"""The recall tier on torch: pages hold the evicted K/V, recalled keys sit at correct RoPE
positions, the question recalls the page with the fact, sessions keep their pages, the
disk budget drops pages, and a heap that never evicts is still the stock cache."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from localheap.backends.torch import TorchBackend
from localheap.backends.torch import recall as recall_mod
from localheap.backends.torch.generate import generate_tokens, prefill
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CFG = HeapConfig(budget=96, sinks=4, recent=16, slack=32, policy="snapkv", recall=True,
                 recall_budget=32, page_size=8, page_format="f32", obs_window=8)


@pytest.fixture(scope="module")
def llama(model_dirs):
    return TorchBackend.load(model_dirs("llama"))


def prompt(backend, n, seed=0):
    return np.random.default_rng(seed).integers(10, backend.model.config.vocab_size, n).tolist()


def stock_kv(backend, tokens):
    """Layer 0's keys/values [H, T, D] from transformers' own cache (its inputs do not depend on eviction)."""
    cache = DynamicCache(config=backend.model.config)
    backend.model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            backend.model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
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
    cache.writer.drain()
    store = cache.pages
    assert store.pages > 0 and recorded
    rope = cache.heap_layers[0].rope
    for layer_id in range(len(cache.heap_layers)):
        mine = [r for r in recorded if r[0] == layer_id]
        pos = np.concatenate([r[1] for r in mine], axis=1)
        keys = torch.cat([rope.rotate(r[2], -torch.as_tensor(r[4])) for r in mine], dim=1)   # pre-RoPE
        values = torch.cat([r[3] for r in mine], dim=1)
        slots, *_ = store.summaries(layer_id)
        H = pos.shape[0]
        got_pos, got_k, got_v = store.load(layer_id, np.broadcast_to(slots, (H, len(slots))).copy())
        n = got_pos.shape[1]                          # full pages; the rest waits in RAM
        assert n == len(slots) * CFG.page_size and n > 0
        for h in range(H):
            order = np.argsort(pos[h], kind="stable")[: n]
            want_pos = pos[h][order]
            at = np.searchsorted(want_pos, got_pos[h])
            np.testing.assert_array_equal(want_pos[at], got_pos[h])
            np.testing.assert_array_equal(got_v[h], values[h][order][at].numpy())        # f32 pages: exact
            np.testing.assert_allclose(got_k[h], keys[h][order][at].numpy(), atol=1e-6)  # one un-rotation


def test_recalled_keys_equal_a_fresh_rotation_at_their_new_slot(llama):
    tokens = prompt(llama, 300, seed=1)
    for positions in ("compact", "absolute"):
        cache = llama.new_cache(CFG.with_(positions=positions))
        list(generate_tokens(llama.model, cache, tokens, SamplingParams(max_tokens=1)))
        assert cache.recall_log and cache.recall_log[-1]["tokens"] == CFG.recall_budget
        layer = cache.heap_layers[0]
        stock_k, stock_v = stock_kv(llama, tokens)
        n = layer.heap.resident
        rec = layer.heap.recalled[:, :n]
        assert rec.sum(axis=1).tolist() == [CFG.recall_budget] * rec.shape[0]
        for h in range(rec.shape[0]):
            slots = np.flatnonzero(rec[h])
            pos = layer.heap.positions[h, slots]
            at = slots if positions == "compact" else pos
            want = layer.rope.rotate(stock_k[h, pos], torch.as_tensor(at - pos))   # R(at) k_raw = R(at - p) R(p) k_raw
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


def test_recall_pins_until_the_next_turn_replaces_it(llama):
    cache = llama.new_cache(CFG)
    params = SamplingParams(max_tokens=40)
    list(generate_tokens(llama.model, cache, prompt(llama, 300, seed=3), params))
    layer = cache.heap_layers[1]
    assert layer.heap.n_recalled == CFG.recall_budget     # still resident after decode evictions
    first = layer.heap.positions[0, : layer.heap.resident][layer.heap.recalled[0, : layer.heap.resident]]
    list(generate_tokens(llama.model, cache, prompt(llama, 50, seed=4), params))
    assert len(cache.recall_log) == 2 and layer.heap.n_recalled == CFG.recall_budget
    assert layer.heap.resident <= layer.heap.capacity
    second = layer.heap.positions[0, : layer.heap.resident][layer.heap.recalled[0, : layer.heap.resident]]
    assert (np.diff(layer.heap.positions[0, : layer.heap.resident]) > 0).all()
    assert len(first) == len(second) == CFG.recall_budget


def test_disk_budget_drops_pages_and_says_so(llama):
    cache = llama.new_cache(CFG)
    record = cache.pages.record_bytes
    cache = llama.new_cache(CFG.with_(disk_budget=10 * record))
    list(generate_tokens(llama.model, cache, prompt(llama, 500, seed=5), SamplingParams(max_tokens=2)))
    cache.writer.drain()
    stats = cache.stats().to_dict()["pages"]
    assert stats["pages"] == 10 and stats["pages_dropped"] == stats["pages_written"] - 10 > 0
    assert stats["disk_bytes"] <= 10 * record


def test_spilled_and_restarted_sessions_keep_their_pages(llama, tmp_path):
    from localheap.sessions.store import SessionStore

    params = SamplingParams(max_tokens=6)
    first, second = prompt(llama, 300, seed=6), prompt(llama, 40, seed=7)
    # the reference: one session that never leaves memory
    ref = llama.new_cache(CFG)
    ref_tokens = [list(generate_tokens(llama.model, ref, t, params)) for t in (first, second)]

    store = SessionStore(llama, CFG, spill_dir=tmp_path / "s")
    s = store.create("sess_a")
    store.make_resident(s)
    assert list(generate_tokens(llama.model, s.cache, first, params)) == ref_tokens[0]
    s.extend(first + ref_tokens[0][:-1])              # the last yielded token is not fed
    s.cache.writer.drain()
    pages = s.cache.stats().pages["pages"]
    assert pages > 0 and store.pages_dir(s).is_dir()
    store.persist_all("m")                            # a restart: spill, index
    again = SessionStore(llama, CFG, spill_dir=tmp_path / "s")
    assert again.load_persisted("m") == 1
    t = again.get("sess_a")
    again.make_resident(t)
    assert t.cache.stats().pages["pages"] == pages and [e["tokens"] for e in t.cache.recall_log] == [CFG.recall_budget]
    assert list(generate_tokens(llama.model, t.cache, second, params)) == ref_tokens[1]
    again.delete("sess_a")
    assert not again.pages_dir(t).exists()


def test_the_question_recalls_the_page_with_the_fact():
    """The bundled demo model, a pass key planted early in 2K tokens, a heap that keeps only sinks
    and the recent window (streaming): the key is evicted, and the question recalls it."""
    from pathlib import Path

    import localheap
    from localheap.bench import needle

    demo = TorchBackend.load(Path(localheap.__file__).parent / "demo_model")
    ep = needle.episodes(demo.tokenizer, 2048, 5, seed=0)[1]
    cfg = HeapConfig(budget=192, recent=96, slack=128, policy="streaming", recall=True,
                     recall_budget=64, page_size=16)
    cache = demo.new_cache(cfg)
    out = list(generate_tokens(demo.model, cache, ep.tokens, SamplingParams(max_tokens=8)))
    assert needle.read_key(demo.tokenizer.decode(out)) == ep.key
    needle_pos = set(range(ep.needle_start, ep.needle_start + ep.needle_len))
    found = []
    for layer in cache.heap_layers:
        h = layer.heap
        recalled = h.positions[:, : h.resident][h.recalled[:, : h.resident]]
        found.append(len(needle_pos & set(recalled.tolist())))
    print("needle tokens recalled per layer", found)
    assert max(found) == len(needle_pos)
    stock = demo.new_cache(cfg.with_(recall=False))
    out = list(generate_tokens(demo.model, stock, ep.tokens, SamplingParams(max_tokens=8)))
    assert needle.read_key(demo.tokenizer.decode(out)) != ep.key   # without recall the key is gone


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
               "--recall", "on", "--recall-budget", "32", "--page-size", "16", "--plots", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "snapkv+recall" in out and "ms / 1K recalled" in out
    assert out.count("+recall") >= 2 * 5   # every policy, at 256 and at 320


def llama_path(backend):
    return backend.model.config._name_or_path


def test_device_eviction_pins_recalled_slots_like_the_numpy_rule(llama):
    """After a recall, plan_eviction (device) keeps the numpy LayerHeap.plan's slots: every recalled
    slot, and the policy's share of the rest."""
    from localheap.backends.torch.select import plan_eviction
    from localheap.heap import SlotView

    cache = llama.new_cache(CFG.with_(policy="h2o"))
    list(generate_tokens(llama.model, cache, prompt(llama, 300, seed=8), SamplingParams(max_tokens=20)))
    layers = [layer for layer in cache.heap_layers if layer.heap.n_recalled]
    assert layers
    plan = plan_eviction(layers)
    for layer, got in zip(plan.layers, plan.host_indices()):
        view = SlotView(positions=layer.heap.view_positions(),
                        **{k: v.float().cpu().numpy() for k, v in layer.pending_view().items()})
        want = layer.heap.plan(view).keep_indices
        np.testing.assert_array_equal(got, want)
        kept_recalled = np.take_along_axis(layer.heap.recalled[:, : layer.heap.resident], got, axis=1).sum(axis=1)
        assert (kept_recalled == layer.heap.n_recalled).all()


def test_durable_sessions_keep_one_page_store_across_generations(llama, tmp_path):
    """The engine saves a session after every turn (a new heap file generation each time): the page
    store stays one directory, checkpointed with each generation, and a restart finds it."""
    from localheap.sessions.store import SessionStore

    params = SamplingParams(max_tokens=4)
    store = SessionStore(llama, CFG, spill_dir=tmp_path / "s", durable=True)
    s = store.create("sess_b")
    store.make_resident(s)
    for turn in (prompt(llama, 300, seed=9), prompt(llama, 60, seed=10)):
        out = list(generate_tokens(llama.model, s.cache, turn, params))
        s.extend(turn + out[:-1])
        store.save(s)
    s.cache.writer.drain()
    pages = s.cache.pages.pages
    assert s.saved_gen == 1 and pages > 0
    assert sorted(p.name for p in (tmp_path / "s").glob("sess_b.pages")) == ["sess_b.pages"]
    again = SessionStore(llama, CFG, spill_dir=tmp_path / "s", durable=True)
    again.load_persisted()
    t = again.get("sess_b")
    again.make_resident(t)
    assert t.cache.pages.root == tmp_path / "s" / "sess_b.pages" and t.cache.pages.pages == pages
