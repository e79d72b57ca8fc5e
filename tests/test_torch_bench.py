"""The torch bench functions `localheap bench` calls: rows, ratios, and a model left as it was."""

import pytest
import torch

from localheap.backends.torch import TorchBackend
from localheap.backends.torch.bench import run_memory, run_speed, speed_ratios
from localheap.heap import HeapConfig


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_run_speed_rows_and_ratios(model_dirs):
    backend = TorchBackend.load(model_dirs("llama"))
    cfg = HeapConfig(budget=64, sinks=4, recent=16, slack=32)
    rows = speed_ratios(run_speed(backend, [300], cfg, decode_tokens=8, paths=("stock-full", "heap", "heap-fused"),
                                  threads=1))
    assert [r["path"] for r in rows] == ["stock-full", "heap", "heap-fused"]
    by = {r["path"]: r for r in rows}
    assert by["stock-full"]["decode_vs_stock"] == 1.0
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["context"] == 300 for r in rows)
    # the heap holds capacity slots; the stock cache holds every token seen
    per_token = backend.kv_bytes_per_token()
    assert by["heap"]["kv_bytes"] == per_token * (4 + 64 + 32)
    assert by["stock-full"]["kv_bytes"] == per_token * (300 + 8)
    assert backend.model.config._attn_implementation == "localheap_sdpa"
    assert torch.is_grad_enabled(), "the stock loop must not leak no_grad"


def test_paging_rows_time_the_next_questions_recall(model_dirs):
    """bench speed --recall on: the paging row gets the next question's recall (it recalled the
    full region after 400 tokens through a 96-slot heap), the others none."""
    backend = TorchBackend.load(model_dirs("llama"))
    cfg = HeapConfig(budget=96, sinks=4, recent=16, slack=32, recall_budget=32, page_size=8)
    rows = run_speed(backend, [400], cfg, decode_tokens=4, paths=("stock-full", "heap", "heap-paging"), threads=1)
    by = {r["path"]: r for r in rows}
    paging = by["heap-paging"]
    assert paging["recalled_tokens"] == 32 and 0 < paging["recall_ms"] <= paging["question_ms"]
    assert paging["question_again_ms"] > 0
    parts = paging["recall_parts"]   # where the recall's time went, phase by phase, inside its total
    assert set(parts) == {"evict", "probe", "drain", "pick", "load"} and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= paging["recall_ms"] + 0.05
    assert "question_ms" not in by["heap"] and "question_ms" not in by["stock-full"]


def test_bandwidth_bound(model_dirs):
    """The bound's arithmetic (on CUDA by default; forced here on the CPU)."""
    backend = TorchBackend.load(model_dirs("llama"))
    rows = run_speed(backend, [64], HeapConfig(budget=32, sinks=4, recent=8, slack=16), decode_tokens=3, bound=True)
    for r in rows:
        assert r["bandwidth_bytes_s"] > 1e8
        assert r["bound_tok_s"] == pytest.approx(r["bandwidth_bytes_s"] / (backend.weights_bytes + r["kv_bytes"]))
        assert r["share_of_bound"] == pytest.approx(r["decode_tok_s"] / r["bound_tok_s"])


def test_run_memory_heap_stays_flat(model_dirs):
    backend = TorchBackend.load(model_dirs("llama"))
    cfg = HeapConfig(budget=64, sinks=4, recent=16, slack=32)
    rows = run_memory(backend, 600, [200, 400], cfg, stock_limit=400)
    heap = [r for r in rows if r["path"] == "heap"]
    stock = [r for r in rows if r["path"] == "stock-full"]
    assert [r["tokens"] for r in heap] == [200, 400, 600] and [r["tokens"] for r in stock] == [200, 400]
    assert len({r["kv_bytes"] for r in heap}) == 1
    assert stock[1]["kv_bytes"] == 2 * stock[0]["kv_bytes"]
    assert all(r["tok_s"] > 0 for r in rows), "prefill rate per checkpoint"


def test_profile_splits_a_prefill(model_dirs):
    from localheap.bench.profile import profile_prefill, report

    backend = TorchBackend.load(model_dirs("llama"))
    cfg = HeapConfig(budget=64, sinks=4, recent=16, slack=16, prefill_chunk=48)
    row = profile_prefill(backend, cfg, 500)
    assert row["evictions"] >= 8 and row["chunk"] == 48
    assert 0 < row["events_s"] < row["wall_s"] and 0 < row["observe_s"] < row["wall_s"]
    assert 0 < row["heap_bookkeeping_s"] < row["wall_s"]
    assert "host-side heap work" in report(row, backend)


def test_memory_report_compares_the_last_interval_with_the_one_ending_at_8k():
    from localheap.commands.bench import _rate_ratio

    rows = [{"path": "heap", "tokens": 4096, "tok_s": 400.0}, {"path": "heap", "tokens": 8192, "tok_s": 200.0},
            {"path": "heap", "tokens": 1_000_000, "tok_s": 180.0}, {"path": "stock-full", "tokens": 8192, "tok_s": 9.0}]
    assert _rate_ratio(rows) == "\nheap prefill rate over (8,192, 1,000,000] is 0.90x its rate over (4,096, 8,192]"
    assert _rate_ratio(rows[:2]) == "" and _rate_ratio([r for r in rows if r["tokens"] != 8192]) == ""


def test_profile_splits_decode_steps(model_dirs):
    from localheap.bench.profile import profile_decode, report_decode

    backend = TorchBackend.load(model_dirs("llama"))
    cfg = HeapConfig(budget=64, sinks=4, recent=16, slack=16, prefill_chunk=48)
    row = profile_decode(backend, cfg, 200, steps=40)
    parts = row["parts_s"]
    assert row["ms_per_step"] > 0 and row["steps"] == 40
    for name in ("matmuls (linear: projections, MLP, head)", "attention (sdpa)",
                 "heap scoring side pass (observe)", "heap eviction events (make_room)", "sampling and host sync"):
        assert 0 < parts[name] < row["wall_s"], name
    assert abs(sum(parts.values()) - row["wall_s"]) < 1e-9
    assert "ms/token" in report_decode(row, backend)


def test_batch_step_tables(model_dirs, monkeypatch):
    """bench batch-step: a row per batch size and per mixed chunk, the rows' heaps out of the slab after."""
    from localheap.bench.batch_step import beside_table, events_table, rows_table

    backend = TorchBackend.load(model_dirs("llama"), dtype=torch.float32)
    cfg = HeapConfig(budget=64, sinks=4, recent=16, slack=16, prefill_chunk=48)
    rows = rows_table(backend, cfg, 100, [1, 2, 3], steps=3, repeats=2)
    assert [r["rows"] for r in rows] == [1, 2, 3] and rows[0]["vs_one"] == rows[0]["vs_one_wall"] == 1.0
    assert all(r["step_ms"] > 0 and r["wall_ms"] > 0 for r in rows)
    assert all(not slab.members for slab in backend.slabs.values())
    side = beside_table(backend, cfg, 100, [8, 16], repeats=1)
    assert [r["chunk"] for r in side] == [8, 16]
    assert all(0 < r["chat_kept"] and 0 < r["doc_kept"] for r in side)
    events = events_table(backend, cfg, 100, [1, 3], repeats=1)
    assert [r["rows"] for r in events] == [1, 3] and all(r["batched_ms"] > 0 < r["alone_ms"] for r in events)
    from localheap.backends.torch import batch, lean

    before, seen = lean.BATCH_GEMM, set()

    def watching(weight):   # which matmul each step of several sessions asked for
        seen.add(lean.BATCH_GEMM)
        return lean.batch_linear(weight)

    monkeypatch.setattr(batch, "batch_linear", watching)
    rows = rows_table(backend, cfg, 100, [1, 2], steps=2, repeats=2, aten=True)   # --aten-gemm
    assert seen == {before, "aten"} and lean.BATCH_GEMM == before
    assert all(r["aten_ms"] > 0 and r["aten_x"] > 0 for r in rows) and rows[0]["aten_vs_one"] == 1.0
