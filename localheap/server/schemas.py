"""Request bodies (pydantic). Unknown fields are refused, never silently ignored; fields
we know but cannot honour are refused with a message saying so (see `unsupported`)."""

from __future__ import annotations

import functools
import json
import types
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator,
                      model_validator)

from ..generation import (DRY_BASE_MAX, DRY_MULTIPLIER_MAX, DYNATEMP_MAX, LOGIT_BIAS_RANGE, MIN_P_RANGE,
                          MIROSTAT_TAU_MAX, PENALTY_RANGE, REPEAT_PENALTY_MAX, SEED_MIN, SEED_SPACE, TOP_LOGPROBS_MAX,
                          TOP_N_SIGMA_MAX)
from .errors import BadRequest


TITLE_MAX_CHARS = 200
TOKENIZE_MAX_CHARS = 4_000_000
COMPLETION_LOGPROBS_MAX = 5   # the legacy completions' logprobs (top ids per token): OpenAI's limit
MAX_CHOICES = 8               # n: the engine's default decode batch
MAX_PROMPTS = 32              # a completion request's batch of prompts (times n): the engine's default queue


class NullIsAbsent(BaseModel):
    """A request body where a null sent for a field that has a default and takes no null reads as
    absent: OpenAI's API takes null for any optional parameter, and SDKs send it so
    (`temperature=None`, a LangChain default); llama-server's json_value reads a null as the default.
    A float field refuses NaN and Infinity, which Python's JSON reader takes (no JSON writer sends them)."""
    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            defaulted = _defaulted(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


class Strict(NullIsAbsent):
    """A request body (or part of one) that refuses unknown fields (a null: NullIsAbsent)."""
    model_config = ConfigDict(extra="forbid")


@functools.lru_cache(maxsize=None)
def _defaulted(cls: type) -> frozenset:
    """The keys of `cls`'s fields that have a default and do not take None."""
    return frozenset(f.alias or name for name, f in cls.model_fields.items()
                     if not f.is_required() and not _takes_none(f.annotation))


def _takes_none(annotation: Any) -> bool:
    if annotation in (None, type(None), Any):
        return True
    if get_origin(annotation) is Annotated:
        return _takes_none(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType, Literal):
        return any(a is None or _takes_none(a) for a in get_args(annotation))
    return False


# OpenAI's reasoning efforts ("none": no reasoning, where the template can); prompts.EFFORTS maps them
EFFORT_VALUES = ("none", "minimal", "low", "medium", "high", "xhigh")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An image, audio or file part (OpenAI's chat schema): parsed only to be refused by name."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file"]


class RefusalPart(Strict):
    """An assistant's refusal, as OpenAI's SDKs send a past reply back (read as its text)."""
    type: Literal["refusal"]
    refusal: str


MEDIA_NAMES = {"image_url": "an image", "input_audio": "audio", "file": "a file"}


class FunctionCall(Strict):
    name: str
    arguments: str               # JSON text, as OpenAI sends it


class CustomCall(Strict):
    name: str
    input: str


class ToolCallItem(Strict):
    """A call in an assistant message: a function's, or a custom tool's (its `input`), which reads
    as the function call the model wrote for it (custom tools are offered as a function of `input`)."""
    id: str
    type: Literal["function", "custom"] = "function"
    function: Optional[FunctionCall] = None
    custom: Optional[CustomCall] = None

    @model_validator(mode="after")
    def _as_function(self):
        if self.type == "custom" and self.custom is not None:
            self.function = FunctionCall(name=self.custom.name,
                                         arguments=json.dumps({"input": self.custom.input}, ensure_ascii=False))
        if self.function is None or (self.type == "custom") != (self.custom is not None):
            raise ValueError(f"a {self.type} tool call carries its `{self.type}` object (and only that)")
        return self


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Annotated[Union[TextPart, MediaPart, RefusalPart], Field(discriminator="type")]],
                   None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallItem]] = None     # assistant: the calls it made
    tool_call_id: Optional[str] = None                  # tool: the call this answers
    reasoning_content: Optional[str] = None             # assistant: its reasoning (the template decides)
    refusal: Optional[str] = None                       # sent back by SDKs with an assistant message
    function_call: None = None                          # likewise (always null here)
    annotations: Optional[list[Any]] = None             # likewise
    audio: None = None                                  # likewise

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.role != "assistant" and isinstance(self.content, list) and \
                any(isinstance(p, RefusalPart) for p in self.content):
            raise ValueError("only an assistant message carries a refusal part")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            p.text if isinstance(p, TextPart) else p.refusal for p in self.content
            if isinstance(p, (TextPart, RefusalPart)))


def object_schema(schema: Optional[dict]) -> Optional[dict]:
    """A tool's parameters (input_schema): a JSON Schema of an object, as OpenAI and Anthropic require;
    one of another type is refused (its calls' arguments, an object, could never match it)."""
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"a tool's parameters must be a JSON Schema (an object), not {type(schema).__name__}")
    kind = (schema or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(f"a tool's parameters must be a JSON Schema of type 'object', not {kind!r}")
    return schema


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    _object = field_validator("parameters")(object_schema)


class CustomToolDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    format: Optional[dict[str, Any]] = None   # {"type": "text"} or {"type": "grammar", "grammar": {syntax, definition}}


class _FunctionOrCustom(Strict):
    """A tool, or a choice of one: of type T, it carries its T object (`function` or `custom`), and only that."""
    type: Literal["function", "custom"]

    @model_validator(mode="after")
    def _one(self):
        if (self.custom is not None, self.function is not None) != (self.type == "custom", self.type == "function"):
            raise ValueError(f"a {self.type} tool carries its `{self.type}` object (and only that)")
        return self

    @property
    def name(self) -> str:
        return self.custom.name if self.custom is not None else self.function.name


class Tool(_FunctionOrCustom):
    """A function tool, or a custom (freeform) one as Chat Completions writes it: offered to the model
    as a function of one string, `input`, its format grammar holding that string (as the Responses
    API's custom tools); its calls come back as {"type": "custom", "custom": {"name", "input"}}."""
    function: Optional[FunctionDef] = None
    custom: Optional[CustomToolDef] = None

    def responses_format(self) -> Optional[dict]:
        """A custom tool's format in the Responses API's shape ({"type": "grammar", "syntax", "definition"})."""
        fmt = self.custom.format
        if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("grammar"), dict):
            return {"type": "grammar", **fmt["grammar"]}
        return fmt


class NamedFunction(Strict):
    name: str


class NamedToolChoice(_FunctionOrCustom):
    function: Optional[NamedFunction] = None
    custom: Optional[NamedFunction] = None


class AllowedSet(Strict):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedTools(Strict):
    """tool_choice {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}: every tool stays in
    the prompt (its prefix, and the session's cache, do not change), the model may call only these."""
    type: Literal["allowed_tools"]
    allowed_tools: AllowedSet


class JsonSchemaFormat(Strict):
    name: str = Field("response", max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None   # the SDK may send it; nothing to obfuscate here


def _ollama_style(data: dict, known: set) -> dict:
    """Ollama's options where Open WebUI puts them on an OpenAI connection (its Advanced Params, at
    the body's top level, for any model): the runtime ones (num_ctx, num_gpu, ...) and keep_alive
    accepted and unused, as the Ollama routes take them; tfs_z at its neutral 1 only; on chat, think
    as chat_template_kwargs' enable_thinking and format as response_format (Ollama's meanings), each
    unless the OpenAI field is sent too."""
    from .ollama import NEUTRAL_OPTIONS, RUNTIME_OPTIONS

    data = {k: v for k, v in data.items() if k in known or (k not in RUNTIME_OPTIONS and k != "keep_alive")}
    tfs = data.pop("tfs_z", None) if "tfs_z" not in known else None
    if tfs is not None and tfs != NEUTRAL_OPTIONS["tfs_z"]:
        raise BadRequest(f"tfs_z {tfs!r} is not supported (this server has no tail-free sampler; leave it out or 1)",
                         "tfs_z")
    if "messages" in known:
        think = data.pop("think", None) if "think" not in known else None
        if think is not None and not data.get("chat_template_kwargs"):
            data["chat_template_kwargs"] = {"enable_thinking": think is not False}
            if isinstance(think, str) and not data.get("reasoning_effort"):   # Ollama's think levels (gpt-oss)
                data["reasoning_effort"] = think
        fmt = data.pop("format", None) if "format" not in known else None
        if (fmt or fmt == {}) and data.get("response_format") is None:   # ({}: any JSON, as Ollama's)
            if fmt == "json":
                data["response_format"] = {"type": "json_object"}
            elif isinstance(fmt, dict):
                data["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
            else:
                raise BadRequest(f"format {fmt!r}: \"json\" or a JSON schema (Ollama's)", "format")
    return data


class SamplingFields(Strict):
    """Fields chat and completions share; also llama-server's extensions its clients send on these
    routes (llama.vscode): `samplers` and `cache_prompt`, and the options of samplers this server
    lacks, at the value that turns them off (llamacpp.check_options)."""
    model: Optional[str] = None                  # absent: the served model (as llama-server and LM Studio)
    # (strict: "yes", "0.5" and true are 400s, as OpenAI's, not read as true, 0.5 and 1)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)            # extension (OpenAI has none)
    min_p: float = Field(0.0, ge=MIN_P_RANGE[0], le=MIN_P_RANGE[1])   # extension (vLLM's, llama.cpp's): 0 = off
    seed: Optional[int] = Field(None, ge=SEED_MIN, lt=SEED_SPACE)   # a 64-bit number, signed or not
    stop: Optional[Union[str, list[str]]] = None
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)   # choices: they decode together in the batch
    presence_penalty: Optional[float] = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: Optional[float] = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    # extensions: the repetition penalty (generation.SamplingParams.repeating); vLLM's looks back over
    # the whole context, llama-server's over its last repeat_last_n tokens
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=REPEAT_PENALTY_MAX)
    repeat_penalty: Optional[float] = Field(None, gt=0.0, le=REPEAT_PENALTY_MAX)
    repeat_last_n: Optional[int] = Field(None, ge=-1)
    # extensions (llama-server's): typical_p, top_n_sigma, XTC (llamacpp.cut_fields), off at their off values
    typical_p: Optional[float] = Field(None, gt=0.0)
    top_n_sigma: Optional[float] = Field(None, le=TOP_N_SIGMA_MAX)
    xtc_probability: Optional[float] = Field(None, ge=0.0, le=1.0)
    xtc_threshold: Optional[float] = Field(None, ge=0.0)
    dynatemp_range: Optional[float] = Field(None, ge=0.0, le=DYNATEMP_MAX)
    dynatemp_exponent: Optional[float] = Field(None, ge=0.0, le=DYNATEMP_MAX)
    mirostat: Optional[Literal[0, 1, 2]] = None
    mirostat_tau: Optional[float] = Field(None, gt=0.0, le=MIROSTAT_TAU_MAX)
    mirostat_eta: Optional[float] = Field(None, ge=0.0, le=1.0)
    adaptive_target: Optional[float] = Field(None, le=1.0)   # (llama-server's adaptive-p: negative off,
    adaptive_decay: Optional[float] = Field(None, ge=0.0, le=1.0)   # and only where `samplers` names it)
    # extensions (llama-server's): DRY (localheap.dry), off at multiplier 0
    dry_multiplier: float = Field(0.0, ge=0.0, le=DRY_MULTIPLIER_MAX)
    dry_base: float = Field(1.75, ge=1.0, le=DRY_BASE_MAX)
    dry_allowed_length: int = Field(2, ge=1)
    dry_penalty_last_n: int = Field(-1, ge=-1)
    dry_sequence_breakers: Optional[list[str]] = None
    logit_bias: Optional[dict[str, float]] = None   # token id (as text) -> bias added to its logit
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(None, max_length=64)   # extension (vLLM's):
    # sampling one of these ends the reply as end-of-sequence does
    user: Optional[str] = None                   # accepted, unused (an end-user id for abuse tracking)
    metadata: Optional[dict[str, str]] = None    # accepted, unused
    safety_identifier: Optional[str] = None      # accepted, unused (OpenAI's successor to user)
    prompt_cache_key: Optional[str] = None       # accepted, unused (a session's prefix is always reused)
    service_tier: Optional[str] = None           # accepted, unused (one tier here)
    store: Optional[bool] = None
    samplers: Union[list[str], str, None] = None   # extension (llama-server's): the samplers left out are off
    cache_prompt: Optional[bool] = None            # extension (llama-server's): accepted (prefixes are always reused)
    n_cache_reuse: Optional[int] = Field(None, ge=0)   # extension (llama-server's): serve --cache-reuse for this
    # request (0: off; absent: the server's)
    id_slot: Optional[int] = None                  # extension (llama-server's): the first choice runs on this slot
    # once it is free (-1 or absent: any; POST /slots/ID?action=save then saves that session)
    return_progress: Optional[bool] = None         # extension (llama-server's): stream chunks with prompt_progress
    post_sampling_probs: Optional[bool] = None     # extension (llama-server's): logprobs of the distribution drawn
    # from, after the sampler chain (generation.LogprobRecorder.post); chat writes them as prob and top_probs

    @model_validator(mode="before")
    @classmethod
    def _llama_server_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        from .llamacpp import OFF, UNUSED, check_options

        known = set(cls.model_fields)
        if "n_cmpl" in data:   # llama-server's name for n (it wins where both are sent, as there)
            data = {**{k: v for k, v in data.items() if k != "n_cmpl"}, "n": data["n_cmpl"]}
        data = _ollama_style(data, known)
        extras = {k: v for k, v in data.items() if k not in known and (k in OFF or k in UNUSED)}
        check_options(extras)
        return {k: v for k, v in data.items() if k not in extras}

    @model_validator(mode="after")
    def _known_samplers(self) -> "SamplingFields":
        from .llamacpp import sampler_names

        unknown = sampler_names(self.samplers)[1]
        if unknown:   # (llama-server's own routes ignore these; the OpenAI routes name them)
            raise ValueError(f"samplers: {unknown[0]!r} is not a sampler llama-server names")
        return self

    @model_validator(mode="after")
    def _one_repetition_penalty(self) -> "SamplingFields":
        if self.repetition_penalty not in (None, 1.0) and self.repeat_penalty not in (None, 1.0):
            raise ValueError("send repetition_penalty (vLLM's: the whole context) or repeat_penalty (llama-server's: "
                             "the last repeat_last_n tokens), not both")
        return self

    def repetition(self) -> dict:
        """The repetition penalty's SamplingParams fields."""
        if self.repetition_penalty not in (None, 1.0):
            return {"repeat_penalty": self.repetition_penalty, "repeat_last_n": -1}
        return {"repeat_penalty": self.repeat_penalty or 1.0,
                "repeat_last_n": 64 if self.repeat_last_n is None else self.repeat_last_n}

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        lo, hi = LOGIT_BIAS_RANGE
        for key, bias in (v or {}).items():
            if not (key.strip().isascii() and key.strip().isdigit()):   # ("²" and "١٢" are digits to str.isdigit)
                raise ValueError(f"logit_bias keys are token ids (as text), not {key!r}")
            if not lo <= bias <= hi:
                raise ValueError(f"logit_bias values must be in [{lo:g}, {hi:g}] (token {key}: {bias:g})")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        return stops

    def common_unsupported(self) -> Optional[tuple[str, str]]:
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    n_predict: Optional[int] = Field(None, ge=-1)    # extension (llama-server's name for max_tokens): -1 the server's
    # default, 0 the prompt read into its session and no reply (llama.vim's warm-up before an instruction)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, AllowedTools, None] = None
    parallel_tool_calls: Optional[bool] = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        """An object is read by its `type`, so that its error says what is wrong with it (the union's
        first branch's "should be 'none', 'auto' or 'required'" did, for a choice missing its function)."""
        if not isinstance(v, dict):
            return v
        model = {"function": NamedToolChoice, "custom": NamedToolChoice, "allowed_tools": AllowedTools}.get(v.get("type"))
        if model is None:
            raise ValueError(f"a tool_choice object's type is 'function', 'custom' or 'allowed_tools', not {v.get('type')!r}")
        try:
            return model.model_validate(v)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}") from None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None   # extension (vLLM's): e.g. {"enable_thinking": false}
    reasoning_effort: Optional[Literal[EFFORT_VALUES]] = None   # the template's reasoning_effort (gpt-oss's)
    verbosity: Optional[Literal["low", "medium", "high"]] = None   # accepted, unused (OpenAI's gpt-5 hint)
    prediction: Optional[dict[str, Any]] = None   # accepted, unused (a speed hint: the reply is the same)
    modalities: Optional[list[Literal["text"]]] = None   # text only: this server writes no audio

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for the first field set to something this server cannot do."""
        for i, m in enumerate(self.messages):
            for j, p in enumerate(m.content if isinstance(m.content, list) else ()):
                if isinstance(p, MediaPart):
                    return (f"messages.{i}.content.{j}", f"this model reads text only: messages[{i}].content[{j}] "
                            f"is {MEDIA_NAMES[p.type]} ({p.type!r} part); send the content as text parts")
        if self.functions or self.function_call not in (None, "none"):
            name = "functions" if self.functions else "function_call"
            return name, "the legacy functions/function_call fields are not supported: use tools and tool_choice"
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        custom = [t.name for t in self.tools or () if t.type == "custom"]
        if len(set(custom)) < len(custom) or set(custom) & {t.name for t in self.tools or () if t.type == "function"}:
            return "tools", "a custom tool's name is the name of no other tool (its calls come back by name)"
        named = [self.tool_choice] if isinstance(self.tool_choice, NamedToolChoice) else \
            self.tool_choice.allowed_tools.tools if isinstance(self.tool_choice, AllowedTools) else []
        for n in named:
            if (n.type, n.name) not in {(t.type, t.name) for t in self.tools}:
                return "tool_choice", f"tool_choice names the {n.type} tool {n.name!r}, which is not in tools"
        if self.response_format is not None and self.response_format.type != "text" and \
                self.tool_choice not in (None, "none", "auto") and not (
                    isinstance(self.tool_choice, AllowedTools) and self.tool_choice.allowed_tools.mode == "auto"):
            return "response_format", "response_format and a forced tool_choice cannot be combined"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        return self.common_unsupported()

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _no_limit(cls, v):
        return None if v == -1 else v   # llama-server's "no limit of its own": the server's default

    def limit(self, default: int) -> int:
        n_predict = self.n_predict if self.n_predict is not None and self.n_predict >= 0 else None
        return next((n for n in (self.max_completion_tokens, self.max_tokens, n_predict) if n is not None), default)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]   # (ids: never true/false)
    max_tokens: StrictInt = Field(16, ge=0)   # 0: with echo, the prompt's logprobs alone
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=COMPLETION_LOGPROBS_MAX)
    suffix: Optional[str] = None   # fill in the middle (a model with FIM tokens: fim.py): the text after the reply
    best_of: Optional[int] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """Its prompts: a text or a list of ids, or a batch of either (at least one)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def unsupported(self) -> Optional[tuple[str, str]]:
        count = len(self.prompts())
        if count > MAX_PROMPTS:
            return "prompt", f"at most {MAX_PROMPTS} prompts per request ({count} sent)"
        if count * self.n > MAX_PROMPTS:
            return "n", f"{count} prompts x n {self.n} is {count * self.n} choices; at most {MAX_PROMPTS} per request"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 (no reply) needs echo: the prompt and its logprobs are the answer"
        if self.suffix is not None and not all(isinstance(p, str) for p in self.prompts()):
            return "suffix", "suffix (fill in the middle) needs the prompt as text"
        if self.suffix is not None and self.echo:
            return "suffix", "suffix (fill in the middle) and echo cannot be combined"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        return self.common_unsupported()


class DocumentRequest(Strict):
    """Append a document to a session. As a chat message by default (so a question asked
    next reads it as context), or raw text with no template."""
    text: str = Field(min_length=1)
    role: Literal["system", "developer", "user", "assistant"] = "user"
    raw: bool = False
    stream: bool = True          # SSE progress events; false: one JSON answer when done
    name: Optional[str] = Field(None, max_length=TITLE_MAX_CHARS)   # e.g. a file name: titles an untitled session


class SessionFields(Strict):
    """POST /v1/sessions (optional body) and PATCH /v1/sessions/{id}."""
    title: Optional[str] = Field(None, max_length=TITLE_MAX_CHARS)


class TokenizeRequest(Strict):
    """Count tokens with the served model's tokenizer (the web UI's document dialog). Bounded:
    4M characters is about a 1M-token document, the size the heap is built for."""
    text: str = Field(max_length=TOKENIZE_MAX_CHARS)


MAX_EMBED_INPUTS = 2048   # inputs per embeddings request (OpenAI's limit)


class EmbeddingRequest(Strict):
    """POST /v1/embeddings: a text or a list of ids, or a batch of either."""
    model: str
    input: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]   # (ids: never true/false or "5")
    encoding_format: Literal["float", "base64"] = "float"   # base64: float32 little-endian (the OpenAI SDK's default)
    dimensions: Optional[int] = Field(None, ge=1)            # the first N components, then unit length again
    user: Optional[str] = None                               # accepted, unused

    def inputs(self) -> list[Union[str, list[int]]]:
        p = self.input
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def unsupported(self) -> Optional[tuple[str, str]]:
        count = len(self.inputs())
        if isinstance(self.input, list) and not self.input:
            return "input", "input is empty"
        if count > MAX_EMBED_INPUTS:
            return "input", f"at most {MAX_EMBED_INPUTS} inputs per request ({count} sent)"
        return None
