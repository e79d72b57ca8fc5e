"""The prefill activation peak in the RAM plan: the formula (pure), the plan and /metrics with a
fake backend, and the formula against peaks measured on both backends (tiny random models)."""

from __future__ import annotations

import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from test_engine import FakeBackend

from localheap.backends.base import ModelShapes
from localheap.governor import BudgetTooSmall, plan_for, prefill_activations
from localheap.governor.activations import (GROWTH, RECALL_BASE_TOKENS, recall_plan_tokens, recall_summary_bytes,
                                           recall_token_bytes)
from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app

MiB = 1024**2
# llama:tiny as the MLX backend on a CPU reports it (two score tensors at once)
TINY_MLX = ModelShapes(layers=2, hidden=64, intermediate=128, q_heads=4, kv_heads=2, head_dim=16, vocab=1024,
                       dtype_bytes=4, score_copies=2)
HEAP_32K = HeapConfig(budget=32768, recent=64, slack=256, prefill_chunk=512)   # the issue's server


def total(shapes=TINY_MLX, **cfg) -> int:
    return prefill_activations(shapes, HEAP_32K.with_(**cfg)).total


def test_activations_grow_with_the_chunk_and_the_capacity():
    chunks = [total(prefill_chunk=c) for c in (64, 256, 512, 1024, 2048)]
    budgets = [total(budget=b) for b in (1024, 4096, 32768, 131072)]
    assert chunks == sorted(chunks) and len(set(chunks)) == len(chunks)
    assert budgets == sorted(budgets) and len(set(budgets)) == len(budgets)
    fused = ModelShapes(**{**TINY_MLX.__dict__, "score_copies": 0})
    assert total(fused) < total()
    # the recall region is inside the budget: it costs no extra capacity, only the page summaries
    recall = HEAP_32K.with_(recall=True, recall_budget=1024)
    assert prefill_activations(TINY_MLX, recall).scores == prefill_activations(TINY_MLX, HEAP_32K).scores


def test_the_issues_32k_heap_plans_what_the_old_margin_missed():
    a = prefill_activations(TINY_MLX, HEAP_32K)
    # 4 query heads x 512 x 33,284 slots x 4 B = 260 MiB per score tensor; measured peak 570 MiB
    assert a.scores == 2 * 4 * 512 * (4 + 32768 + 512) * 4
    assert a.total > 570 * MiB > 256 * MiB


class ShapedBackend(FakeBackend):
    def __init__(self, shapes: ModelShapes, heap_bytes: int = 17 * MiB):
        super().__init__()
        self.shapes, self._heap = shapes, heap_bytes

    def model_shapes(self):
        return self.shapes

    def heap_bytes(self, cfg):
        return self._heap


class FixedRSS:
    """psutil.Process as the plan reads it, with a fixed RSS: what the plan measures of this test
    process would otherwise be whatever the tests before it left loaded (run after the others, it
    passed 1.8 GiB, and the runtime, not the activations, was then what did not fit)."""

    def __init__(self, rss: int):
        self.rss = rss

    def __call__(self):
        return self

    def memory_info(self):
        return self


def test_an_800m_budget_is_refused_for_the_32k_heap_and_says_why(monkeypatch):
    import localheap.governor.setup as setup

    monkeypatch.setattr(setup, "psutil", SimpleNamespace(Process=FixedRSS(200 * MiB),
                                                         virtual_memory=setup.psutil.virtual_memory))
    with pytest.raises(BudgetTooSmall) as e:
        plan_for(ShapedBackend(TINY_MLX), HEAP_32K, 800 * MiB)
    msg = str(e.value)
    assert "prefill activations" in msg and "--prefill-chunk" in msg and "\n" not in msg
    # a smaller chunk shrinks them: the plan says how much the budget must grow otherwise
    small = plan_for(ShapedBackend(TINY_MLX), HEAP_32K.with_(prefill_chunk=64, slack=64), 4096 * MiB)
    assert small.activations < prefill_activations(TINY_MLX, HEAP_32K).total / 4


def test_serve_refuses_the_issues_800m_budget_at_start():
    pytest.importorskip("mlx.core")
    r = subprocess.run([sys.executable, "-m", "localheap.cli", "serve", "--model", "random:llama:tiny",
                        "--backend", "mlx", "--budget", "32768", "--recent", "64", "--slack", "256",
                        "--prefill-chunk", "512", "--ram-budget", "800M", "--port", "9", "--no-persist"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("localheap: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr
    assert "RAM budget 800.0 MiB is too small" in errors[0] and "prefill activations" in errors[0]


def test_the_plan_counts_the_activations_and_metrics_show_them():
    backend = ShapedBackend(TINY_MLX)
    plan = plan_for(backend, HEAP_32K, 4096 * MiB)
    assert plan.activations == prefill_activations(TINY_MLX, HEAP_32K).total
    assert plan.overhead > plan.activations + plan.requests
    settings = ServerSettings(web_dir=None, ram_budget=4096 * MiB, heap=HEAP_32K)
    with TestClient(create_app(backend, settings), base_url="http://127.0.0.1:8000") as client:
        lines = client.get("/metrics").text.splitlines()
    gauge = next(x for x in lines if x.startswith("localheap_activation_bytes "))
    assert float(gauge.split()[1]) == plan.activations


def test_recall_counts_page_summaries_per_session():
    cfg = HEAP_32K.with_(recall=True)
    # minmax: 2 x 2 heads x 16 dims x 2 B per page and layer, and a span (2 x int64) per head;
    # 2 layers, 64K tokens / 32 per page, the arrays' growth margin
    per_page = 2 * 2 * 16 * 2 + 2 * 16
    assert recall_summary_bytes(TINY_MLX, cfg) == int(2 * (RECALL_BASE_TOKENS // 32) * per_page * GROWTH)
    assert recall_summary_bytes(TINY_MLX, HEAP_32K) == 0
    bounded = cfg.with_(disk_budget=16 * MiB)
    assert 0 < recall_plan_tokens(TINY_MLX, bounded) < RECALL_BASE_TOKENS
    plain = plan_for(ShapedBackend(TINY_MLX), HEAP_32K, 4096 * MiB)
    paged = plan_for(ShapedBackend(TINY_MLX), cfg, 4096 * MiB)
    assert paged.heap == plain.heap + recall_summary_bytes(TINY_MLX, cfg)
    assert paged.activations > plain.activations   # scoring a layer's summaries against the question
    # past the base context a session counts what it grew by, up to what the budget holds with it alone
    assert plain.recall_token_bytes == 0 and plain.recall_max_tokens == 0
    assert paged.recall_token_bytes == recall_token_bytes(TINY_MLX, cfg) > 2 * per_page * GROWTH / 32
    assert paged.recall_extra(RECALL_BASE_TOKENS) == 0
    assert paged.recall_extra(RECALL_BASE_TOKENS + 1000) == 1000 * paged.recall_token_bytes
    cap = paged.recall_max_tokens
    assert paged.heap + paged.recall_extra(cap) <= paged.free_for_heaps < paged.heap + paged.recall_extra(cap + 1)


def test_the_summary_plan_holds_what_a_store_allocates(tmp_path):
    """The plan's bytes per token of pages bound the summary RAM a real store allocates."""
    import numpy as np

    from localheap.heap.pages import PageGeometry, PageStore

    cfg = HEAP_32K.with_(recall=True, page_size=8)
    s = TINY_MLX
    store = PageStore(tmp_path / "p", PageGeometry(s.layers, s.kv_heads, s.head_dim, 8, "f16"))
    rng = np.random.default_rng(0)
    planned = recall_token_bytes(s, cfg)
    summaries = s.layers * (2 * s.kv_heads * s.head_dim * 2 + 16 * s.kv_heads) * GROWTH / 8   # per token
    assert planned > summaries   # the rest: the scoring scratch
    for step in range(40):
        n = 8 * 64
        pos = np.broadcast_to(np.arange(step * n, (step + 1) * n), (s.kv_heads, n))
        kv = rng.standard_normal((s.kv_heads, n, s.head_dim)).astype(np.float32)
        for layer in range(s.layers):
            store.append(layer, pos, kv, kv)
        tokens = (step + 1) * n
        assert store.summary_bytes <= summaries * max(tokens, 64 * 8)   # at least 64 slots are allocated
    assert store.summary_bytes >= summaries * tokens / GROWTH   # the live pages: the bound is tight


# -- measured ----------------------------------------------------------------------------------
# (budget, chunk, policy): the heap full before the measured chunks, so every one evicts and
# attends sinks + budget + chunk slots, as the plan assumes
MEASURED = [(2048, 512, "snapkv"), (1024, 128, "h2o"), (2048, 256, "streaming")]


def prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(10, 500) for _ in range(n)]


def torch_peak_bytes(fn) -> int:
    """Peak of live CPU allocations while fn runs, from the profiler's allocation events (every
    tensor the c10 allocator hands out and takes back, with its time)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("budget,chunk,policy", MEASURED)
def test_torch_plan_covers_the_measured_peak(model_dirs, torch_one_thread, budget, chunk, policy):
    from localheap.backends.torch.backend import TorchBackend
    from localheap.backends.torch.generate import prefill

    backend = TorchBackend.load(model_dirs("llama"), device="cpu")
    cfg = HeapConfig(budget=budget, recent=64, slack=64, prefill_chunk=chunk, policy=policy)
    cache = backend.new_cache(cfg)
    prefill(backend.model, cache, prompt(budget + chunk))          # heap full: buffers allocated, evicting
    measured = torch_peak_bytes(lambda: prefill(backend.model, cache, prompt(3 * chunk)))
    planned = prefill_activations(backend.model_shapes(), cfg).total
    print(f"torch {policy} budget {budget} chunk {chunk}: planned {planned / MiB:.1f} MiB, "
          f"measured {measured / MiB:.1f} MiB ({planned / measured:.2f}x)")
    assert measured <= planned <= 4 * measured


@pytest.mark.parametrize("budget,chunk,policy", MEASURED)
def test_mlx_plan_covers_the_measured_peak(model_dirs, budget, chunk, policy):
    mx = pytest.importorskip("mlx.core")
    from localheap.backends.mlx.backend import MLXBackend
    from localheap.backends.mlx.generate import prefill

    backend = MLXBackend.load(model_dirs("llama"))
    cfg = HeapConfig(budget=budget, recent=64, slack=64, prefill_chunk=chunk, policy=policy)
    cache = backend.new_cache(cfg)
    prefill(backend.model, cache, prompt(budget + chunk), chunk)   # heap full: buffers allocated, evicting
    mx.synchronize()
    before = mx.get_active_memory()                                # weights + heap
    mx.reset_peak_memory()
    prefill(backend.model, cache, prompt(3 * chunk), chunk)
    mx.synchronize()
    measured = mx.get_peak_memory() - before
    planned = prefill_activations(backend.model_shapes(), cfg).total
    print(f"mlx {policy} budget {budget} chunk {chunk}: planned {planned / MiB:.1f} MiB, "
          f"measured {measured / MiB:.1f} MiB ({planned / measured:.2f}x)")
    assert measured <= planned <= 4 * measured


def _scored(backend, cache, tokens: list[int], chunk: int) -> None:
    """prompt logprobs (an echo's): every position's logits, in the engine's chunks."""
    from localheap.generation import LogprobRecorder

    recorder = LogprobRecorder(5)
    for a in range(0, len(tokens) - 1, chunk):
        piece = tokens[a:min(a + chunk, len(tokens) - 1)]
        backend.prefill_scored(cache, piece, tokens[a + len(piece)], recorder)


def test_the_plan_covers_a_scored_prefill(model_dirs, torch_one_thread):
    """An echo's prompt logprobs hold logits for every position of a forward: the plan counts them."""
    from localheap.backends.torch.backend import TorchBackend
    from localheap.backends.torch.generate import prefill

    budget, chunk = 1024, 128
    backend = TorchBackend.load(model_dirs("llama"), device="cpu")
    cfg = HeapConfig(budget=budget, recent=64, slack=64, prefill_chunk=chunk, policy="h2o")
    cache = backend.new_cache(cfg)
    prefill(backend.model, cache, prompt(budget + chunk))
    measured = torch_peak_bytes(lambda: _scored(backend, cache, prompt(3 * chunk + 1), chunk))
    planned = prefill_activations(backend.model_shapes(), cfg).total
    print(f"torch scored: planned {planned / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB")
    assert measured <= planned <= 4 * measured
    mx = pytest.importorskip("mlx.core")
    from localheap.backends.mlx.backend import MLXBackend
    from localheap.backends.mlx.generate import prefill as mlx_prefill

    backend = MLXBackend.load(model_dirs("llama"))
    cache = backend.new_cache(cfg)
    mlx_prefill(backend.model, cache, prompt(budget + chunk), chunk)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    _scored(backend, cache, prompt(3 * chunk + 1), chunk)
    mx.synchronize()
    measured = mx.get_peak_memory() - before
    planned = prefill_activations(backend.model_shapes(), cfg).total
    print(f"mlx scored: planned {planned / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB")
    assert measured <= planned <= 4 * measured
