"""Ollama's API in localheap's terms: /api/chat and /api/generate request bodies (pydantic, unknown
fields refused), their conversion to the chat messages and sampling the OpenAI routes use (so
every API shares templates, sessions, heap, recall and prefix reuse), and the reply's NDJSON lines.

Ollama's clients (its Python and JavaScript libraries, Open WebUI, editors' plugins) send the whole
conversation each turn: the session it extends is found and its prefix reused, as for chat."""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from ..engine import Finished
from ..generation import SEED_MIN, SEED_SPACE, TOP_LOGPROBS_MAX, LogprobRecorder, SamplingParams
from .chat import ChatPlan
from .errors import BadRequest
from .logonce import warn_once
from .prompts import with_effort
from .schemas import MAX_EMBED_INPUTS, ChatMessage, Strict, object_schema
from .toolformats import ToolCall


# GET /api/version: the Ollama version whose API these routes follow: /api/* as of 0.12.11 (logprobs,
# truncate, shift) and /v1/responses, which Ollama serves from 0.13.4 (Codex --oss asks for 0.13.4 or newer)
OLLAMA_VERSION = "0.13.4"

# options that tune the runtime, not the reply: accepted, unused (the heap replaces num_ctx: any length fits)
RUNTIME_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "use_mmap", "use_mlock",
                   "low_vram", "numa", "vocab_only", "f16_kv", "logits_all", "embedding_only"}
# sampling options this server has no sampler for: accepted at their neutral value only
NEUTRAL_OPTIONS = {"tfs_z": 1.0, "penalize_newline": None}


class OllamaFunction(Strict):
    name: str
    arguments: Union[dict[str, Any], str] = Field(default_factory=dict)
    index: Optional[int] = None
    description: Optional[str] = None


class OllamaToolCall(Strict):
    function: OllamaFunction
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None


class OllamaMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = ""
    thinking: Optional[str] = None
    images: Optional[list[str]] = None
    tool_calls: Optional[list[OllamaToolCall]] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None


class OllamaTool(Strict):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ShowRequest(Strict):
    model: Optional[str] = None
    name: Optional[str] = None   # (older clients)
    verbose: Optional[bool] = None


class EmbedRequest(Strict):
    """POST /api/embed: a text or a batch of texts (none: the model is loaded, nothing embedded)."""
    model: str
    input: Union[str, Annotated[list[str], Field(max_length=MAX_EMBED_INPUTS)]] = ""
    truncate: bool = True                 # an input past the heap's size is cut to it (False: an error)
    dimensions: Optional[int] = Field(None, ge=1)
    options: Optional[dict[str, Any]] = None          # accepted: nothing in them changes a vector here
    keep_alive: Union[str, int, float, None] = None

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class LegacyEmbeddingsRequest(Strict):
    """POST /api/embeddings (Ollama's older route): one prompt, its vector not normalized."""
    model: str
    prompt: str = ""
    options: Optional[dict[str, Any]] = None
    keep_alive: Union[str, int, float, None] = None


# the options read as numbers (Ollama's: each a JSON number; an integer option takes a float's whole part)
OPTION_NUMBERS = ("num_predict", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repeat_penalty", "repeat_last_n", "typical_p", "mirostat", "mirostat_tau",
                  "mirostat_eta")


def _number(options: dict, name: str, default: Any, kind: type = float) -> Any:
    """options[name] (or `default`) as `kind`: a 400 naming it where it is not a finite JSON number."""
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"options.{name} must be a number (it was {value!r:.80})", f"options.{name}")
    return kind(value)


class OllamaRequest(Strict):
    """What /api/chat and /api/generate share."""
    model: str
    format: Union[Literal["", "json"], dict[str, Any], None] = None
    options: Optional[dict[str, Any]] = None
    stream: bool = True
    keep_alive: Union[str, int, float, None] = None   # accepted: the model stays loaded; sessions are on disk
    think: Union[bool, Literal["low", "medium", "high"], None] = None
    logprobs: Optional[bool] = None                   # each generated token's logprob, in the line it comes in
    top_logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS_MAX)   # with logprobs: alternatives per token
    truncate: Optional[bool] = None   # accepted: the heap holds any length, there is never history to cut
    shift: Optional[bool] = None      # accepted: the context never fills, so it never shifts

    def params(self, default_max: int, constraint: Any = None) -> SamplingParams:
        """The options as sampling (num_predict -1 or absent: the server's default reply limit)."""
        o = {k: v for k, v in (self.options or {}).items() if v is not None}   # null: the option's default
        for name, neutral in NEUTRAL_OPTIONS.items():
            value = o.pop(name, None)
            if value is not None and neutral is not None and value != neutral:
                raise BadRequest(f"options.{name} {value!r} is not supported (this server has no {name} sampler; "
                                 f"leave it out or {neutral})", f"options.{name}")
        for name in RUNTIME_OPTIONS:
            o.pop(name, None)
        unknown = sorted(set(o) - set(OPTION_NUMBERS) - {"stop"})
        if unknown:   # Ollama logs "invalid option provided" and goes on (llm.nvim sends rope_frequency_base)
            warn_once("Ollama options this server does not know, ignored (as Ollama ignores them): %s", unknown)
        limit = o.get("num_predict")
        stop = o.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest(f"options.stop must be a string or a list of strings (it was {stop!r:.80})",
                             "options.stop")
        seed = None if o.get("seed") in (None, -1) else _number(o, "seed", None, int)   # -1: Ollama's default, random
        if seed is not None and not SEED_MIN <= seed < SEED_SPACE:
            raise BadRequest(f"options.seed must be a 64-bit number (it was {seed})", "options.seed")
        try:
            return SamplingParams(max_tokens=default_max if limit in (None, -1, -2) else _number(o, "num_predict", 0, int),
                                  temperature=_number(o, "temperature", 0.8), top_p=_number(o, "top_p", 0.9),
                                  top_k=_number(o, "top_k", 40, int), min_p=_number(o, "min_p", 0.0),
                                  seed=seed, stop=stop,
                                  presence_penalty=_number(o, "presence_penalty", 0.0),
                                  frequency_penalty=_number(o, "frequency_penalty", 0.0),
                                  windowed_penalties=True,
                                  repeat_penalty=_number(o, "repeat_penalty", 1.0),
                                  repeat_last_n=_number(o, "repeat_last_n", 64, int),
                                  typical_p=min(1.0, _number(o, "typical_p", 1.0)),
                                  mirostat=_number(o, "mirostat", 0, int), mirostat_tau=_number(o, "mirostat_tau", 5.0),
                                  mirostat_eta=_number(o, "mirostat_eta", 0.1), constraint=constraint,
                                  logprobs=LogprobRecorder(self.top_logprobs or 0) if self.logprobs else None)
        except ValueError as e:
            name = next((n for n in sorted(OPTION_NUMBERS, key=len, reverse=True) if n in str(e)), None)
            raise BadRequest(f"options: {e}", f"options.{name}" if name else "options") from e

    def schema(self) -> Optional[dict]:
        """The JSON the reply must be: {} for "json" or the empty schema {} (any object; Ollama turns
        any object into a grammar), a schema, or None ("" or null: no format)."""
        if self.format == "json":
            return {}
        return self.format if isinstance(self.format, dict) else None

    def template_kwargs(self) -> Optional[dict]:
        if self.think is None:
            return None
        return with_effort({"enable_thinking": self.think is not False}, self.think if isinstance(self.think, str) else None)


class ChatRequest(OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: Optional[list[OllamaTool]] = None

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as OpenAI-shaped chat messages. Ollama's calls carry no ids (and their
        arguments are objects): each gets one here, and a tool message answers the earliest
        unanswered call of its tool_name (else the earliest unanswered)."""
        out: list[ChatMessage] = []
        pending: list[tuple[str, str]] = []   # (id, name) of calls not answered yet
        n = 0
        for i, m in enumerate(self.messages):
            if m.images:
                raise BadRequest("images are not supported: this server serves text models", f"messages.{i}.images")
            if m.role == "tool":
                match = next((p for p in pending if p[1] == m.tool_name), pending[0] if pending else None)
                if m.tool_call_id is not None:
                    call_id = m.tool_call_id
                elif match is not None:
                    call_id = match[0]
                else:
                    raise BadRequest(f"messages[{i}] is a tool result with no tool call before it", f"messages.{i}")
                pending = [p for p in pending if p[0] != call_id]
                out.append(ChatMessage(role="tool", tool_call_id=call_id, content=m.content or ""))
                continue
            calls = []
            for c in m.tool_calls or []:
                call_id = c.id or f"call_{n}"
                n += 1
                args = c.function.arguments
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": args if isinstance(args, str) else json.dumps(args)}})
                pending.append((call_id, c.function.name))
            if m.role == "assistant":
                out.append(ChatMessage(role="assistant", content=m.content if m.content or not calls else None,
                                       tool_calls=calls or None, reasoning_content=m.thinking or None))
            else:
                out.append(ChatMessage(role=m.role, content=m.content or ""))
        if not out:
            raise BadRequest("messages is empty", "messages")
        return out

    def plan(self) -> ChatPlan:
        for i, t in enumerate(self.tools or []):
            try:
                object_schema(t.function.get("parameters"))
            except ValueError as e:
                raise BadRequest(str(e), f"tools.{i}.function.parameters") from None
        tools = [{"type": "function", "function": t.function} for t in self.tools or []] or None
        return ChatPlan(tools, "auto", True, self.schema(), self.template_kwargs(), schema_param="format")


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False
    suffix: Optional[str] = None   # fill in the middle (a model with FIM tokens: fim.py); "" = none
    template: Optional[str] = None
    context: Optional[list[int]] = None   # an earlier reply's context (its prompt's and reply's ids): read first
    images: Optional[list[str]] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.images:
            return "images", "images are not supported: this server serves text models"
        if self.suffix and self.system:
            return "system", "a fill-in-the-middle prompt (suffix) has no place for a system message"
        if self.template:
            return "template", "a template of the request's own is not supported: the model's chat template is used"
        if self.context and self.suffix:
            return "context", "a fill-in-the-middle prompt (suffix) takes no context"
        if self.raw and self.system:
            return "system", "raw prompts take no system message"
        return None

    def chat_messages(self) -> list[ChatMessage]:
        system = [ChatMessage(role="system", content=self.system)] if self.system else []
        return system + [ChatMessage(role="user", content=self.prompt)]

    def plan(self) -> ChatPlan:
        return ChatPlan(None, "auto", True, self.schema(), self.template_kwargs(), schema_param="format")


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def call_dict(call: ToolCall, index: int) -> dict:
    """A tool call as Ollama writes it: arguments as an object (as written, under "arguments", when
    they are not JSON: named in the line's `localheap`)."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = call.arguments
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": args}}


def final_fields(done: Finished, began: float, first_token: Optional[float], ended: float) -> dict:
    """The last line's figures: done_reason, durations (ns) and token counts."""
    first = first_token if first_token is not None else ended
    u = done.usage
    return {"done": True, "done_reason": "length" if done.finish_reason == "length" else "stop",
            "total_duration": int((ended - began) * 1e9), "load_duration": 0,
            "prompt_eval_count": u.prompt_tokens - u.cached_tokens, "prompt_eval_duration": int((first - began) * 1e9),
            "eval_count": u.completion_tokens, "eval_duration": int((ended - first) * 1e9)}


def model_entry(svc, name: Optional[str] = None) -> dict:
    """The served model as /api/tags and /api/ps list it (under `name`: one of its served names)."""
    b = svc.backend
    family = _family(svc)
    name = name or svc.model_id
    digest = hashlib.sha256(f"{svc.backend.model_name}:{b.weights_bytes}".encode()).hexdigest()
    return {"name": tag(name), "model": tag(name), "size": b.weights_bytes, "digest": digest,
            "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(svc.started)),
            "details": {"parent_model": "", "format": "mlx" if b.name == "mlx" else "safetensors", "family": family,
                        "families": [family], "parameter_size": _parameters(b), "quantization_level": ""}}


def tag(model_id: str) -> str:
    return model_id if ":" in model_id else f"{model_id}:latest"


def _family(svc) -> str:
    config = getattr(getattr(svc.backend, "model", None), "config", None)
    kind = getattr(config, "model_type", None)
    if kind is None:
        kind = getattr(getattr(getattr(svc.backend, "model", None), "args", None), "model_type", None)
    return str(kind or "unknown")


def _parameters(backend) -> str:
    n = backend.weights_bytes / max(1, backend.model_shapes().dtype_bytes)
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
