"""The torch decode loop: one host read per token, and pipelining that changes no token."""

import numpy as np
import pytest
import torch

from localheap.backends.torch import TorchBackend
from localheap.backends.torch.generate import generate_steps
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")
CFG = HeapConfig(budget=48, sinks=4, recent=8, slack=16, policy="snapkv")


@pytest.fixture(scope="module")
def llama(model_dirs):
    return TorchBackend.load(model_dirs("llama"), dtype=torch.float32)


def prompt():
    return np.random.default_rng(1).integers(10, 1000, 120).tolist()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40),
                                    SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=5)])
def test_pipelined_decode_gives_the_same_tokens(llama, params):
    runs = {}
    for pipeline in (False, True):
        cache = llama.new_cache(CFG)
        steps = list(generate_steps(llama.model, cache, prompt(), params, pipeline=pipeline))
        runs[pipeline] = ([t for t, _ in steps], torch.stack([lg for _, lg in steps]), cache.tokens_seen)
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])
    assert runs[True][2] == runs[False][2] == 120 + 39, "run to the end, both feed all but the last token"


def test_pipelined_decode_feeds_the_yielded_token_ahead(llama):
    fed = {}
    for pipeline in (False, True):
        cache = llama.new_cache(CFG)
        gen = generate_steps(llama.model, cache, prompt(), SamplingParams(max_tokens=40), pipeline=pipeline)
        for _ in range(5):
            next(gen)
        gen.close()
        fed[pipeline] = cache.tokens_seen - 120
    assert fed == {False: 4, True: 5}


class HostReads:
    """Counts every way a tensor's value reaches Python (each is a device sync on CUDA). `numpy` is
    not among them: a CUDA tensor has none, so it always follows a counted `cpu`."""

    NAMES = ("item", "tolist", "cpu", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("defer", ["never", "always"])
def test_one_host_read_per_decode_token(llama, monkeypatch, defer):
    """Between eviction events a decode step reads exactly one value (the token id); an event
    adds one transfer (keep indices of all layers), however many layers evict. Deferred (the
    CUDA default, cache.defers_positions): an event adds none; its indices settle the host's
    position table when first read, here by the next event's selection, copied without a read."""
    from localheap.backends.torch import cache as cache_module

    monkeypatch.setattr(cache_module, "DEFER_POSITIONS", defer)
    cache = llama.new_cache(CFG)
    gen = generate_steps(llama.model, cache, prompt(), SamplingParams(max_tokens=60), pipeline=False)
    next(gen)
    reads = HostReads(monkeypatch)
    per_step, events = [], []
    for _ in range(50):
        before_reads, before_events = reads.count, evictions(cache)
        next(gen)
        per_step.append(reads.count - before_reads)
        events.append(evictions(cache) - before_events)
    monkeypatch.undo()
    n_layers = len(cache.heap_layers)
    assert sum(e > 0 for e in events) >= 2, "the window must include eviction events"
    for reads_here, evicted in zip(per_step, events):
        assert reads_here == (1 if evicted == 0 or defer == "always" else 2), (per_step, events)
        assert evicted in (0, n_layers)


def evictions(cache) -> int:
    return sum(layer.heap.evictions for layer in cache.heap_layers)


@pytest.mark.parametrize("cfg", [CFG, CFG.with_(policy="h2o", positions="absolute")], ids=["snapkv", "h2o-absolute"])
def test_deferred_position_tables_settle_to_the_same_heap(llama, monkeypatch, tmp_path, cfg):
    """cache.defers_positions (on CUDA by default; forced here): events leave the host's position
    table to settle when first read. Through prefill chunks, decode events, a rollback, stats and
    a save and load, every read sees the table the immediate bookkeeping has, and the tokens and
    the heap's keys are the same."""
    from localheap.backends.torch import cache as cache_module

    runs = {}
    for defer in ("never", "always"):
        monkeypatch.setattr(cache_module, "DEFER_POSITIONS", defer)
        cache = llama.new_cache(cfg.with_(prefill_chunk=32))
        llama.prefill(cache, prompt()[:100])
        pending_after_prefill = any(layer.heap._later is not None for layer in cache.heap_layers)
        tokens = [t for t, _ in generate_steps(llama.model, cache, prompt()[100:], SamplingParams(max_tokens=30),
                                                pipeline=False)]
        floor = cache.rollback_floor()
        stats = cache.stats()
        cache.truncate(floor)
        path = tmp_path / f"{defer}.heap"
        llama.save_cache(cache, path)
        loaded = llama.load_cache(cfg, path)
        runs[defer] = (tokens, [layer.heap.view_positions() for layer in cache.heap_layers],
                       [layer.heap.view_positions() for layer in loaded.heap_layers],
                       [layer.keys[0, :, : layer.heap.resident].clone() for layer in cache.heap_layers],
                       (stats.resident, stats.evicted, floor), pending_after_prefill)
    (t0, p0, l0, k0, s0, pending0), (t1, p1, l1, k1, s1, pending1) = runs["never"], runs["always"]
    assert not pending0 and pending1, "deferred: the last prefill event was still unsettled"
    assert t0 == t1 and s0 == s1
    for a, b, c, d in zip(p0, p1, l0, l1):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, d)
        np.testing.assert_array_equal(a, c)
    for a, b in zip(k0, k1):
        assert torch.equal(a, b)
