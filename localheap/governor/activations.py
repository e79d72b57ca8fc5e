"""The prefill activation peak: bytes one forward of a prefill chunk holds beyond weights and heaps.

Pure integers from the model's shapes (ModelShapes, from the backend) and the heap config;
knows nothing about tensors. One engine thread runs one forward at a time, so the server
plans one peak, not one per session. Terms are summed, not maxed over the phases of a
layer: the plan errs high (tests/test_activation_plan.py holds it within 4x of measured).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..backends.base import ModelShapes
from ..generation import scored_bytes
from ..heap import HeapConfig
from ..heap.pages import SUMMARY_FIELDS, PageGeometry, record_dtype
from ..heap.recall import WINDOW, window_batch

SCORE_BYTES = 4               # attention scores and softmax run in float32
MASK_BYTES = 5                # a [chunk, T] boolean causal mask plus its additive float32 copy (torch)
SUMMARY_BYTES = 2             # page summaries stay in RAM as float16
RECALL_BASE_TOKENS = 1 << 16  # recall on: each planned heap includes page summaries of 64K tokens; a session
                              # past them counts what it grows by (MemoryPlan.recall_extra)
GROWTH = 9 / 8                # the summary arrays grow by 1/8 (heap/pages.py): at most this much allocated


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
    logits: int      # logits in the model dtype and float32: the last row, or every row (a forward that
                     # computes them all, and a scored prefill's: echo's prompt logprobs, scored_bytes)
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
        logits=max((L if s.full_logits else 1) * s.vocab * (db + 4), scored_bytes(L, s.vocab, db)),
        recall=recall_scoring_bytes(s, cfg),
    )


def recall_plan_tokens(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """Tokens of pages each planned heap includes (0 without recall): RECALL_BASE_TOKENS, or fewer
    where --disk-budget holds fewer. A session past them counts its growth (recall_token_bytes)."""
    if not cfg.recall:
        return 0
    if not cfg.disk_budget:
        return RECALL_BASE_TOKENS
    g = PageGeometry(shapes.layers, shapes.kv_heads, shapes.head_dim, cfg.page_size, cfg.page_format)
    disk_per_token = shapes.layers * record_dtype(g).itemsize / cfg.page_size
    return min(RECALL_BASE_TOKENS, int(cfg.disk_budget / disk_per_token))


def _pages(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """Pages per layer for the planned context (0 without recall)."""
    return -(-recall_plan_tokens(shapes, cfg) // cfg.page_size)


SPAN_BYTES = 16                # a page's first and last position per KV head (int64 each), in RAM


def _summary_per_page(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """RAM of one page's summaries and spans, all KV heads of one layer."""
    return (len(SUMMARY_FIELDS[cfg.recall_summary]) * shapes.head_dim * SUMMARY_BYTES + SPAN_BYTES) * shapes.kv_heads


def _scoring_per_page(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """Scratch of a question scored against one layer, per page of that layer: the summaries'
    float32 copy and the [H_q, w, pages] bounds; span recall adds the votes (8 B per WINDOW
    tokens), a batch's window x page overlap and, at worst, every page's positions."""
    per = len(SUMMARY_FIELDS[cfg.recall_summary]) * shapes.kv_heads * shapes.head_dim * 4
    per += 3 * shapes.q_heads * max(1, cfg.obs_window) * 4
    if cfg.recall_select == "spans":
        P = cfg.page_size
        per += P * 8 // WINDOW + window_batch(cfg.recall_budget) + P * shapes.kv_heads * 8
    return per


def recall_summary_bytes(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """RAM one session's page summaries and page spans hold at the planned context (all layers,
    with the arrays' growth margin; 0 without recall)."""
    return int(shapes.layers * _pages(shapes, cfg) * _summary_per_page(shapes, cfg) * GROWTH)


def recall_scoring_bytes(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """A question scored against one layer's pages at the planned context (0 without recall)."""
    return _pages(shapes, cfg) * _scoring_per_page(shapes, cfg)


def recall_token_bytes(shapes: ModelShapes, cfg: HeapConfig) -> int:
    """RAM one more token of pages costs a session past the planned context: its summaries (all
    layers, with the growth margin) and its share of the scoring scratch (0 without recall)."""
    if not cfg.recall:
        return 0
    per_page = shapes.layers * _summary_per_page(shapes, cfg) * GROWTH + _scoring_per_page(shapes, cfg)
    return int(-(-per_page // cfg.page_size))
