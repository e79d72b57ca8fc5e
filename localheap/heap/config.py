"""Heap configuration: how many tokens a session keeps, and how it picks them.

This module knows nothing about tensors: budgets are integers, profiles are lists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

POLICIES = ("h2o", "snapkv", "geometry", "streaming", "random")
PAGE_FORMATS = ("f32", "f16", "int8")
RECALL_SUMMARIES = ("minmax", "mean")
RECALL_SCORES = ("bound", "zscore")
RECALL_SELECTS = ("spans", "pages")
POSITION_MODES = ("compact", "absolute")
PROFILES = ("uniform", "pyramid")


class HeapConfigError(ValueError):
    """A heap setting that cannot work (user-facing)."""


@dataclass(frozen=True)
class HeapConfig:
    """Per-session heap settings.

    capacity (per layer) = sinks + layer budget + slack. Appends go into the slack;
    when it is full the policy keeps sinks + budget tokens and frees the slack again.
    """

    budget: int = 4096           # scored tokens kept per layer (beyond the sinks)
    sinks: int = 4               # first tokens of the stream, never evicted
    recent: int = 256            # most recent tokens, never evicted
    slack: int = 256             # decode append room = the decode eviction interval
    prefill_chunk: int = 0       # tokens per prefill forward (evict before each); 0 = the slack
    stagger: bool = False        # decode evictions spread one layer a step (torch; HeapCache.due), not all at once
    policy: str = "snapkv"       # the default keeps facts that h2o loses (docs/needle.md)
    positions: str = "compact"   # compact: RoPE positions follow slot order; absolute: original positions
    profile: str = "uniform"     # per-layer budget profile
    pyramid_ratio: float = 0.5   # pyramid: top layer gets (1 - ratio) x budget, bottom (1 + ratio) x
    h2o_normalize: bool = False  # h2o: divide mass by how many queries could see the token
    obs_window: int = 32         # queries of a prefill chunk whose attention is scored
    pool_kernel: int = 7         # snapkv: 1-D pooling width over the token axis
    noise: float = 0.0           # relative noise floor on scores (timing side channels); 0 = off
    seed: int = 0                # random policy and noise
    recall: bool = False         # page evicted K/V out to disk; recall the best pages per question
    recall_budget: int = 2048    # slots of the budget reserved for recalled tokens (whole pages); docs/recall.md
    page_size: int = 32          # tokens per page (per layer, per KV head)
    page_format: str = "f16"     # f32 (exact), f16, int8 (per token and head scale)
    recall_summary: str = "minmax"   # page summary scored against the queries: minmax (Quest) or mean key
    recall_score: str = "zscore"     # a page's score: best bound over the queries, or best per-query z-score
    recall_select: str = "spans"     # spans: the same windows in every layer and head (voted); pages: each head its own
    disk_budget: int = 0         # bytes of pages per session; past it the lowest-value pages are dropped; 0 = no bound
    recall_ram_tokens: int = 0   # tokens of pages per session whose summaries RAM holds (serve sets it from
                                 # --ram-budget); past it the lowest-value pages are dropped; 0 = no bound
    rewind: bool = True          # a turn that rewrites the last reply (past an eviction) rewinds the heap to
                                 # where the reply began; False: the conversation is read again (backends/slots.py)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise HeapConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.positions not in POSITION_MODES:
            raise HeapConfigError(f"unknown position mode {self.positions!r}; choose compact or absolute")
        if self.profile not in PROFILES:
            raise HeapConfigError(f"unknown budget profile {self.profile!r}; choose uniform or pyramid")
        for name in ("budget", "slack"):
            if getattr(self, name) < 1:
                raise HeapConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sinks", "recent", "obs_window", "prefill_chunk"):
            if getattr(self, name) < 0:
                raise HeapConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.recent > self.budget:
            raise HeapConfigError(f"recent window ({self.recent}) cannot exceed the budget ({self.budget})")
        if not 0.0 <= self.pyramid_ratio < 1.0:
            raise HeapConfigError("pyramid_ratio must be in [0, 1)")
        if self.noise < 0:
            raise HeapConfigError("noise must be >= 0")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise HeapConfigError("pool_kernel must be a positive odd number")
        if self.page_format not in PAGE_FORMATS:
            raise HeapConfigError(f"unknown page format {self.page_format!r}; choose one of {', '.join(PAGE_FORMATS)}")
        if self.recall_summary not in RECALL_SUMMARIES:
            raise HeapConfigError(f"unknown recall summary {self.recall_summary!r}; choose minmax or mean")
        if self.recall_score not in RECALL_SCORES:
            raise HeapConfigError(f"unknown recall score {self.recall_score!r}; choose bound or zscore")
        if self.recall_select not in RECALL_SELECTS:
            raise HeapConfigError(f"unknown recall selection {self.recall_select!r}; choose spans or pages")
        if self.page_size < 1 or self.disk_budget < 0 or self.recall_ram_tokens < 0:
            raise HeapConfigError("page_size must be >= 1, disk_budget and recall_ram_tokens >= 0")
        if self.recall:
            if self.recall_budget < self.page_size:
                raise HeapConfigError(f"recall budget ({self.recall_budget}) must hold a page "
                                      f"({self.page_size} tokens)")
            if self.recall_budget + self.recent > self.budget:
                raise HeapConfigError(f"recall budget ({self.recall_budget}) + recent window ({self.recent}) "
                                      f"cannot exceed the budget ({self.budget})")

    def with_(self, **changes) -> "HeapConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d

    @property
    def needs_attention(self) -> bool:
        """Whether the backend must run the attention side pass."""
        return self.policy in ("h2o", "snapkv")

    @property
    def needs_query_stats(self) -> bool:
        return self.policy == "geometry"

    @property
    def moves_keys(self) -> bool:
        """Whether the backend must turn a cached key to another RoPE position (or back to none):
        compact positions shift keys, recall stores pages before RoPE, geometry un-rotates queries."""
        return self.positions == "compact" or self.needs_query_stats or self.recall

    def layer_budgets(self, n_layers: int) -> list[int]:
        """Budget of each layer. Pyramid keeps the same total, more in lower layers."""
        if self.profile == "uniform" or n_layers == 1:
            return [self.budget] * n_layers
        total = self.budget * n_layers
        hi, lo = 1.0 + self.pyramid_ratio, 1.0 - self.pyramid_ratio
        weights = [hi + (lo - hi) * i / (n_layers - 1) for i in range(n_layers)]
        budgets = [max(self.recent, 1, int(self.budget * w)) for w in weights]
        # hand rounding leftovers to the lowest layers so the total is exact
        i = 0
        while sum(budgets) < total:
            budgets[i % n_layers] += 1
            i += 1
        return budgets

    @property
    def recall_slots(self) -> int:
        """Slots of each layer's budget reserved for recalled pages (whole pages); 0 without recall."""
        return (self.recall_budget // self.page_size) * self.page_size if self.recall else 0

    @property
    def append_room(self) -> int:
        """Slots beyond sinks + budget: room for a decode slack or a whole prefill chunk."""
        return max(self.slack, self.prefill_chunk)

    @property
    def chunk(self) -> int:
        """Tokens per prefill forward. The CLI sets prefill_chunk to the backend's device default."""
        return self.prefill_chunk or self.slack

    def layer_capacity(self, layer_budget: int) -> int:
        return self.sinks + layer_budget + self.append_room
