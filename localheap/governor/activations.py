"""The prefill activation peak: bytes one forward of a prefill chunk holds beyond weights and heaps.

Pure integers from the model's shapes (ModelShapes, from the backend) and the heap config;
knows nothing about tensors. One engine thread runs one forward at a time, so the server
plans one peak, not one per session. Terms are summed, not maxed over the phases of a
layer: the plan errs high (tests/test_activation_plan.py holds it within 4x of measured).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..backends.base import ModelShapes
from ..heap import HeapConfig
from ..heap.pages import SUMMARY_FIELDS, PageGeometry, record_dtype
from ..heap.recall import WINDOW, window_batch

SCORE_BYTES = 4               # attention scores and softmax run in float32
MASK_BYTES = 5                # a [chunk, T] boolean causal mask plus its additive float32 copy (torch)
SUMMARY_BYTES = 2             # page summaries stay in RAM as float16
RECALL_PLAN_TOKENS = 1 << 20  # recall on and no --disk-budget: plan page summaries for a 1M-token session


@dataclass(frozen=True)
class Activations:
    """Transient bytes of one prefill forward, by what holds them."""

    scores: int      # materialized attention scores/probabilities (0 with a fused kernel)
    mask: int        # the causal mask over the chunk's queries and every resident key
    observe: int     # the heap's side pass: the last obs_window queries against every key (float32)
    kv: int          # K/V as attention reads them: repeated to the query heads, float32 copies
    repack: int      # an eviction's gather and re-rotation of one layer's K/V
    mlp: int         # gate, up and their product over the chunk
    states: int      # residual stream, norms, q/k/v projections of the chunk
    logits: int      # the last row (or every row) of logits, in the model dtype and float32
    recall: int = 0  # scoring every page summary of one layer against the question (recall on)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def prefill_activations(shapes: ModelShapes, cfg: HeapConfig) -> Activations:
    """Peak bytes of one prefill chunk (cfg.chunk tokens) attending a full heap (the widest layer's
    capacity: sinks + budget + max(slack, chunk), the recall region inside the budget)."""
    s, L = shapes, cfg.chunk
    T = max(cfg.layer_capacity(b) for b in cfg.layer_budgets(s.layers))
    w = min(L, max(1, cfg.obs_window)) if cfg.needs_attention else 0
    db = s.dtype_bytes
    return Activations(
        scores=s.score_copies * s.q_heads * L * T * SCORE_BYTES,
        mask=L * T * MASK_BYTES,
        observe=2 * s.q_heads * w * T * SCORE_BYTES,
        kv=2 * s.q_heads * T * s.head_dim * max(db, 4),
        repack=3 * s.kv_heads * T * s.head_dim * 4,
        mlp=3 * L * s.intermediate * db,
        states=L * (6 * s.hidden + 2 * (s.q_heads + 2 * s.kv_heads) * s.head_dim) * db,
        logits=(L if s.full_logits else 1) * s.vocab * (db + 4),
        recall=recall_scoring_bytes(s, cfg),
    )


def recall_plan_tokens(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """Tokens of one session the recall tier is planned for: what --disk-budget holds, at most 1M."""
    if not cfg.recall:
        return 0
    if not cfg.disk_budget:
        return RECALL_PLAN_TOKENS
    g = PageGeometry(shapes.layers, shapes.kv_heads, shapes.head_dim, cfg.page_size, cfg.page_format)
    disk_per_token = shapes.layers * record_dtype(g).itemsize / cfg.page_size
    return min(RECALL_PLAN_TOKENS, int(cfg.disk_budget / disk_per_token))


def _pages(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """Pages per layer for the planned context (0 without recall)."""
    return -(-recall_plan_tokens(shapes, cfg) // cfg.page_size)


SPAN_BYTES = 16                # a page's first and last position per KV head (int64 each), in RAM


def recall_summary_bytes(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """RAM one session's page summaries and page spans hold at the planned context (all layers; 0
    without recall). Their arrays grow by doubling, so a store just past a doubling holds up to
    twice this."""
    per_page = len(SUMMARY_FIELDS[cfg.recall_summary]) * shapes.kv_heads * shapes.head_dim * SUMMARY_BYTES
    return shapes.layers * _pages(shapes, cfg) * (per_page + shapes.kv_heads * SPAN_BYTES)


def recall_scoring_bytes(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """A question scored against one layer's summaries: their float32 copy and the [H_q, w, pages]
    bounds; span recall adds the votes (8 B per WINDOW tokens), a batch's window x page overlap and, at
    worst, the positions of every page of the layer (read when their spans meet a window)."""
    pages = _pages(shapes, cfg)
    copy = len(SUMMARY_FIELDS[cfg.recall_summary]) * pages * shapes.kv_heads * shapes.head_dim * 4
    scoring = copy + 3 * shapes.q_heads * max(1, cfg.obs_window) * pages * 4
    if cfg.recall_select != "spans":
        return scoring
    tokens = pages * cfg.page_size
    step = window_batch(cfg.recall_budget)
    return scoring + tokens // WINDOW * 8 + step * pages + tokens * shapes.kv_heads * 8
