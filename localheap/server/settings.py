"""Server settings: one dataclass, filled from the command line (or by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional

from ..governor.budget import parse_size as parse_bytes  # noqa: F401  (re-exported)
from ..heap import HeapConfig

def url_host(host: str) -> str:
    """A host as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def package_web_dir() -> Optional[Path]:
    """localheap/web when it holds an index.html (the UI ships there)."""
    path = Path(str(resources.files("localheap.web")))
    return path if (path / "index.html").exists() else None


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None              # when set, every API route needs "Authorization: Bearer KEY"
    served_model_names: list[str] = field(default_factory=list)   # the names the model answers to (vLLM's
    # --served-model-name; the first is the one replies carry); none: the model's own name
    api_keys: list[str] = field(default_factory=list)   # more keys; each owns the sessions it creates
    cors_origins: list[str] = field(default_factory=list)   # beyond the server's own origin
    max_body_bytes: int = 16 << 20             # a 1M-token document is ~4-6 MB of JSON
    max_prompt_tokens: Optional[int] = None    # None: derived from the RAM budget (see limits.py)
    max_active: int = 8                        # requests running at once (decoding, or prefilling)
    max_batch: int = 8                         # decoding runs advanced in one forward pass per step
    batched: bool = True                       # False: the round-robin engine (one run per forward)
    mixed_chunk: int = 64                      # prefill tokens per step riding beside decoding runs
    prefill_lane: Optional[bool] = None        # a second thread reads prompts beside the batch (None: backend's)
    max_queued: int = 32                       # waiting beyond those; more -> 503
    max_sessions: int = 256
    max_resident_sessions: int = 8             # more idle sessions are spilled to disk
    cache_reuse: int = 0                       # a trimmed history keeps runs of at least this many tokens (0: read again)
    sessions_dir: Optional[Path] = None        # spill directory (default: a temporary one)
    disk_total: Optional[int] = 0              # bytes the whole sessions directory may hold (0: no bound; None: auto, serve fills it in)
    persist_sessions: bool = False             # save sessions at shutdown, load them at start
    slot_save_path: Optional[Path] = None      # llama-server's slot files (POST /slots/ID?action=save): None: a 501
    ram_budget: Optional[int] = None           # bytes (None: 75% of physical memory)
    default_max_tokens: int = 8192             # chat replies when the request sets no limit
    max_tokens_limit: int = 32768              # the largest max_tokens a request may ask (400 beyond)
    shutdown_grace_s: float = 10.0             # SIGTERM: requests get this long, then are cancelled
    heap: HeapConfig = field(default_factory=HeapConfig)
    tool_format: Optional[str] = None          # hermes | qwen3_xml | glm45 | glm4 | mistral | llama3_json | harmony | phi4_mini | prompted (None: from the template)
    tool_grammar: bool = True                  # tool_choice auto: a call the reply opens is held to the tools' schemas
    web_dir: Optional[Path] = field(default_factory=package_web_dir)
    heap_events_interval: float = 0.5          # seconds between /v1/heap/events messages
    max_observers: int = 8                     # open /v1/heap/events streams; more -> 503
    admission_timeout: float = 30.0            # seconds a request may queue for RAM before 503
    allowed_hosts: list[str] = field(default_factory=list)   # Host names accepted beyond the bound ones
    embed_pooling: str = "mean"                # embeddings: mean or last of the last hidden states (embedding.POOLING)

    @property
    def keys(self) -> list[str]:
        """Every accepted API key (none: the API is open to whoever reaches the port)."""
        return list(dict.fromkeys(([self.api_key] if self.api_key else []) + list(self.api_keys)))

    @property
    def own_origins(self) -> list[str]:
        hosts = {self.host, "127.0.0.1", "localhost"} if self.host in ("127.0.0.1", "localhost") else {self.host}
        return sorted(f"http://{url_host(h)}:{self.port}" for h in hosts)

    @property
    def base_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"
