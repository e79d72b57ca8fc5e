"""The recall tier through the backend protocol, on both backends: recalled pages stay pinned until
the next question replaces them, the device eviction keeps the numpy rule's slots, the disk
budget drops pages, sessions keep their pages through spills, restarts and durable saves, and
the question recalls the page holding the fact. Backend-specific checks (exact page contents,
RoPE positions, stock equivalence) are in test_torch_recall.py and test_mlx_recall.py."""

import importlib
from pathlib import Path

import numpy as np
import pytest
from recall_checks import CFG, prompt

import localheap
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

DEMO = Path(localheap.__file__).parent / "demo_model"


def load(name: str, path):
    if name == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
        from localheap.backends.mlx import MLXBackend
        return MLXBackend.load(path)
    pytest.importorskip("torch")
    from localheap.backends.torch import TorchBackend
    return TorchBackend.load(path)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def backend_name(request):
    if request.param == "torch":
        pytest.importorskip("torch")
        request.getfixturevalue("torch_one_thread")
    return request.param


@pytest.fixture(scope="module")
def llama(backend_name, model_dirs):
    return load(backend_name, model_dirs("llama"))


def generate(backend, cache, tokens, max_tokens):
    return list(backend.generate(cache, tokens, SamplingParams(max_tokens=max_tokens)))


def host(x) -> np.ndarray:
    """A device array (torch tensor or mx array) as float32 numpy."""
    if hasattr(x, "cpu"):
        return x.float().cpu().numpy()
    return np.array(x).astype(np.float32)


def test_recall_pins_until_the_next_turn_replaces_it(llama):
    cache = llama.new_cache(CFG)
    generate(llama, cache, prompt(llama, 300, seed=3), 40)
    layer = cache.heap_layers[1]
    assert layer.heap.n_recalled == CFG.recall_budget     # still resident after decode evictions
    assert layer.heap.evictions > 1
    first = layer.heap.positions[0, : layer.heap.resident][layer.heap.recalled[0, : layer.heap.resident]]
    generate(llama, cache, prompt(llama, 50, seed=4), 40)
    assert len(cache.recall_log) == 2 and layer.heap.n_recalled == CFG.recall_budget
    assert layer.heap.resident <= layer.heap.capacity
    second = layer.heap.positions[0, : layer.heap.resident][layer.heap.recalled[0, : layer.heap.resident]]
    assert (np.diff(layer.heap.positions[0, : layer.heap.resident]) > 0).all()
    assert len(first) == len(second) == CFG.recall_budget


def test_device_eviction_pins_recalled_slots_like_the_numpy_rule(llama, backend_name):
    """After a recall, plan_eviction (device) keeps the numpy LayerHeap.plan's slots: every recalled
    slot, and the policy's share of the rest."""
    from localheap.heap import SlotView

    plan_eviction = importlib.import_module(f"localheap.backends.{backend_name}.select").plan_eviction
    cache = llama.new_cache(CFG.with_(policy="h2o"))
    generate(llama, cache, prompt(llama, 300, seed=8), 20)
    layers = [layer for layer in cache.heap_layers if layer.heap.n_recalled]
    assert layers
    plan = plan_eviction(layers)
    for layer, got in zip(plan.layers, plan.host_indices()):
        view = SlotView(positions=layer.heap.view_positions(), **{k: host(v) for k, v in layer.pending_view().items()})
        want = layer.heap.plan(view).keep_indices
        np.testing.assert_array_equal(got, want)
        kept_recalled = np.take_along_axis(layer.heap.recalled[:, : layer.heap.resident], got, axis=1).sum(axis=1)
        assert (kept_recalled == layer.heap.n_recalled).all()


def test_recall_scores_every_page_it_makes_room_with(llama):
    """Room for the recall region is made before the pages are scored: whatever that eviction pages
    out competes with the older pages (evicting after scoring paged out tokens no question scored).
    Prompt lengths put the heap at several fills when the question arrives."""
    crowded = 0
    for n in range(230, 300, 9):
        cache = llama.new_cache(CFG)
        store = cache.pages
        at_scoring = []
        summaries = store.summaries_by_dim   # what the pick reads its summaries with
        store.summaries_by_dim = lambda layer, **kw: (at_scoring.append(store.written), summaries(layer, **kw))[1]
        before = []
        evict = cache.evict
        cache.evict = lambda layers: (before.append(len(at_scoring)), evict(layers))[1]
        generate(llama, cache, prompt(llama, n, seed=11), 1)
        cache.writer.drain()
        assert cache.recall_log and at_scoring, n
        assert store.written == at_scoring[-1], f"{n} tokens: pages written after scoring"
        crowded += bool(before)
        assert all(b == 0 for b in before), "an eviction after scoring began"
    assert crowded, "no prompt length made the recall evict: the test checks nothing"


def test_disk_budget_drops_pages_and_says_so(llama):
    record = llama.new_cache(CFG).pages.record_bytes
    cache = llama.new_cache(CFG.with_(disk_budget=10 * record))
    generate(llama, cache, prompt(llama, 500, seed=5), 2)
    cache.writer.drain()
    stats = cache.stats().to_dict()["pages"]
    assert stats["pages"] == 10 and stats["pages_dropped"] == stats["pages_written"] - 10 > 0
    assert stats["disk_bytes"] <= 10 * record


def test_spilled_and_restarted_sessions_keep_their_pages(llama, tmp_path):
    from localheap.sessions.store import SessionStore

    first, second = prompt(llama, 300, seed=6), prompt(llama, 40, seed=7)
    # the reference: one session that never leaves memory
    ref = llama.new_cache(CFG)
    ref_tokens = [generate(llama, ref, t, 6) for t in (first, second)]

    store = SessionStore(llama, CFG, spill_dir=tmp_path / "s")
    s = store.create("sess_a")
    store.make_resident(s)
    assert generate(llama, s.cache, first, 6) == ref_tokens[0]
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
    assert t.cache.heap_layers[0].heap.n_recalled == CFG.recall_budget
    assert generate(llama, t.cache, second, 6) == ref_tokens[1]
    again.delete("sess_a")
    assert not again.pages_dir(t).exists()


def test_durable_sessions_keep_one_page_store_across_generations(llama, tmp_path):
    """The engine saves a session after every turn (a new heap file generation each time): the page
    store stays one directory, checkpointed with each generation, and a restart finds it."""
    from localheap.sessions.store import SessionStore

    store = SessionStore(llama, CFG, spill_dir=tmp_path / "s", durable=True)
    s = store.create("sess_b")
    store.make_resident(s)
    for turn in (prompt(llama, 300, seed=9), prompt(llama, 60, seed=10)):
        out = generate(llama, s.cache, turn, 4)
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


def test_the_question_recalls_the_page_with_the_fact(backend_name):
    """The bundled demo model, a pass key planted early in 2K tokens, a heap that keeps only sinks
    and the recent window (streaming): the key is evicted, and the question recalls it."""
    from localheap.bench import needle

    demo = load(backend_name, DEMO)
    ep = needle.episodes(demo.tokenizer, 2048, 5, seed=0)[1]
    cfg = HeapConfig(budget=192, recent=96, slack=128, policy="streaming", recall=True,
                     recall_budget=64, page_size=16)
    cache = demo.new_cache(cfg)
    assert needle.read_key(demo.tokenizer.decode(generate(demo, cache, ep.tokens, 8))) == ep.key
    needle_pos = set(range(ep.needle_start, ep.needle_start + ep.needle_len))
    found = []
    for layer in cache.heap_layers:
        h = layer.heap
        recalled = h.positions[:, : h.resident][h.recalled[:, : h.resident]]
        found.append(len(needle_pos & set(recalled.tolist())))
    print("needle tokens recalled per layer", found)
    assert max(found) == len(needle_pos)
    stock = demo.new_cache(cfg.with_(recall=False))
    # without recall the key is gone
    assert needle.read_key(demo.tokenizer.decode(generate(demo, stock, ep.tokens, 8))) != ep.key
