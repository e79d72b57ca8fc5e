"""llama.cpp's server API (llama-server's own routes, not its OpenAI ones) in localheap's terms:
the /completion and /infill request body, its prompt forms (text, ids, text and ids mixed, several
prompts), infill's prompt (repo-level where the model has the tokens), and the reply's fields
(content, stop_type, timings, tokens_cached, completion_probabilities, response_fields).

Editors' code completion (llama.vim, llama.vscode) and tools written against llama-server send
these; they run on the same engine, sessions, heap and prefix reuse as every other API.

Options are llama-server's, with its defaults (temperature 0.8, top_k 40, top_p 0.95, min_p
0.05). Samplers this server does not have (repetition, DRY, XTC, Mirostat, typical, top-n-sigma)
are accepted at the value that turns them off and refused otherwise; options that tune llama.cpp's
runtime (slots, progress) are accepted and unused (`n_cache_reuse` is serve --cache-reuse for the
request); any other field is a 400."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ..dry import DEFAULT_BREAKERS, breaker_ids
from ..engine import InvalidTokens
from ..generation import LOGIT_BIAS_RANGE, SEED_MIN, SEED_SPACE, LogprobRecorder, SamplingParams
from ..sessions import Prompt
from ..sessions.session import token_array
from .errors import BadRequest, PromptTooLong, Unsupported
from .fim import fim_format, fim_ids, require_fim
from .logprobs import TokenText, finite
from .logonce import warn_once
from .schemas import MAX_CHOICES, NullIsAbsent
from .tokens import encode_bounded, encode_plain, leading_specials

# llama-server's sampler names, and the letters of its --sampling-seq form
SAMPLER_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p", "x": "xtc",
                   "t": "temperature", "s": "top_n_sigma", "e": "penalties", "i": "infill", "a": "adaptive_p"}
OURS = ("top_k", "top_p", "min_p", "temperature")   # the cut-offs `switched` turns off where a list leaves them out
# the other names a samplers list may hold: `named` says whether each runs ("infill": none here, accepted;
# "adaptive_p": named, adaptive-p draws last in place of the plain draw, as llama.cpp puts it)
OTHERS = {"dry", "typ_p", "xtc", "top_n_sigma", "penalties", "infill", "mirostat", "adaptive_p"}
ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}   # llama.cpp's, beside top-k and topk forms

# options this server has nothing for: accepted only at the value that leaves them off
OFF = {"lora": lambda v: not v}
OFF_WHY = {"lora": "this server applies no LoRA adapters"}
# llama.cpp's runtime options and tuning that changes nothing here: accepted, unused
UNUSED = {"penalize_nl", "min_keep",
          "t_max_prompt_ms", "n_keep", "n_discard", "timings_per_token",
          "sse_ping_interval", "model", "id_task", "response_fields", "penalty_last_n"}
# the options a SamplingParams check may name in its message (a 400's param)
OPTION_NAMES = ("repeat_penalty", "repeat_last_n", "dry_multiplier", "dry_base", "dry_allowed_length",
                "dry_penalty_last_n", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "mirostat",
                "dynatemp_range", "adaptive_target")
MAX_PROMPTS = 64
MAX_PROBS = 20
REPO_TOKENS = ("<|repo_name|>", "<|file_sep|>")   # Qwen2.5-Coder's repo-level format (llama.cpp's FIM_REP, FIM_SEP)
REPO_NAME = "myproject"                           # the repository's name in that format, as llama-server writes it


class ExtraChunk(BaseModel):
    """One of infill's input_extra: another file's text (llama.vim also sends `time`)."""
    model_config = ConfigDict(extra="ignore")
    filename: str = ""
    text: str = ""


class LlamaRequest(NullIsAbsent):
    """POST /completion and /infill (infill: input_prefix, input_suffix, input_extra; its `prompt`
    is text after the middle token, the reply's start). A null for a field that takes none is the
    field's default."""
    model_config = ConfigDict(extra="allow")

    prompt: Any = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    n_predict: int = -1
    max_tokens: Optional[int] = None            # (llama-server's other name for n_predict)
    seed: Optional[int] = Field(-1, ge=SEED_MIN, lt=SEED_SPACE)   # a 64-bit number, signed or not (-1: random)
    stop: Union[str, list[str], None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    typical_p: float = 1.0
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = Field(default_factory=lambda: list(DEFAULT_BREAKERS))
    logit_bias: Union[list, dict, None] = None
    ignore_eos: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_PROBS)
    post_sampling_probs: bool = False   # n_probs' of the distribution drawn from (LogprobRecorder.post), as probs
    return_progress: bool = False       # a stream's prompt_progress pieces while the prompt is read
    grammar: Optional[str] = None
    json_schema: Optional[dict] = None
    samplers: Union[list[str], str, None] = None
    stream: bool = False
    cache_prompt: bool = True
    n_cache_reuse: Optional[int] = Field(None, ge=0)   # serve --cache-reuse for this request (0: off; None: the server's)
    id_slot: int = -1   # run on this slot, once it is free (-1: any); its session is still the one the prompt extends
    return_tokens: bool = False
    response_fields: Optional[list[str]] = None
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = Field(0, ge=0)
    n_cmpl: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)   # completions of each prompt (llama-server's;
    n: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)        # `n` is its other name)

    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _extras(self) -> "LlamaRequest":
        self._ignored = check_options(self.model_extra or {}, strict=False)
        self._ignored += [f"samplers:{n}" for n in sampler_names(self.samplers)[1]]
        if self._ignored:
            warn_once("llama-server options this server does not have, ignored (as llama-server ignores them): %s",
                      self._ignored)
        return self

    @property
    def ignored(self) -> list[str]:
        """The options (and `samplers` entries, as "samplers:NAME") this request sent that llama-server
        does not have either: ignored, as llama-server ignores them; the reply's `localheap` lists them."""
        return self._ignored

    def completions(self, prompts: int) -> int:
        """How many completions of each prompt (n_cmpl, else n, else 1); a 400 past MAX_PROMPTS in all."""
        n = self.n_cmpl or self.n or 1
        if prompts * n > MAX_PROMPTS:
            raise BadRequest(f"{prompts} prompts x n_cmpl {n} is {prompts * n} completions; at most {MAX_PROMPTS} "
                             f"a request", "n_cmpl")
        return n

    def limit(self, default: int) -> int:
        """n_predict (or max_tokens); -1 (llama-server: no limit) is this server's default reply limit."""
        n = self.max_tokens if self.max_tokens is not None and self.n_predict == -1 else self.n_predict
        if n < -1:
            raise BadRequest("n_predict must be -1 (no limit of its own) or >= 0", "n_predict")
        return default if n == -1 else n

    def params(self, default: int, vocab: Optional[int], eos: Sequence[int], tokenizer: Any, constraint: Any = None,
               stop_ids: Sequence[int] = (), seed_offset: int = 0) -> SamplingParams:
        temperature, top_k, top_p, min_p = switched(self.samplers, self.temperature, self.top_k, self.top_p,
                                                    self.min_p)
        penalties = penalties_on(self.samplers)
        dry = {**dry_fields(self, tokenizer, self.samplers), **cut_fields(self, self.samplers)}
        bias = logit_bias(self.logit_bias, tokenizer, vocab)
        if self.ignore_eos:
            for t in eos:
                bias[int(t)] = LOGIT_BIAS_RANGE[0]
        seed = None if self.seed is None or self.seed < 0 or self.seed == 0xFFFFFFFF else self.seed + seed_offset
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(max_tokens=self.limit(default), temperature=max(0.0, temperature),
                                  top_k=max(0, top_k), top_p=min(1.0, top_p) if top_p > 0 else 1.0,
                                  min_p=min(1.0, max(0.0, min_p)), seed=seed, stop=stop,
                                  presence_penalty=self.presence_penalty if penalties else 0.0,
                                  frequency_penalty=self.frequency_penalty if penalties else 0.0,
                                  windowed_penalties=True,
                                  repeat_penalty=self.repeat_penalty if penalties else 1.0,
                                  repeat_last_n=self.repeat_last_n, **dry, logit_bias=bias, constraint=constraint,
                                  logprobs=LogprobRecorder(self.n_probs, self.post_sampling_probs)
                                  if self.n_probs else None,
                                  stop_token_ids=list(stop_ids))
        except ValueError as e:
            raise BadRequest(str(e), next((f for f in OPTION_NAMES if f in str(e)),
                                          "n_predict" if "max_tokens" in str(e) else None)) from e

    def settings(self, params: SamplingParams, n_ctx: Optional[int], model: str) -> dict:
        """generation_settings: the options as this request ran with them."""
        return {"n_ctx": n_ctx, "model": model, "n_predict": self.n_predict, "max_tokens": params.max_tokens,
                "seed": 0xFFFFFFFF if params.seed is None else params.seed, "temperature": params.temperature,
                "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
                "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                "repeat_penalty": params.repeat_penalty, "repeat_last_n": params.repeat_last_n,
                "dry_multiplier": params.dry_multiplier, "dry_base": params.dry_base,
                "dry_allowed_length": params.dry_allowed_length, "dry_penalty_last_n": params.dry_penalty_last_n,
                "dry_sequence_breakers": self.dry_sequence_breakers, "typical_p": params.typical_p,
                "top_n_sigma": params.top_n_sigma, "xtc_probability": params.xtc_probability,
                "xtc_threshold": params.xtc_threshold, "mirostat": params.mirostat,
                "mirostat_tau": params.mirostat_tau, "mirostat_eta": params.mirostat_eta,
                "adaptive_target": params.adaptive_target, "adaptive_decay": params.adaptive_decay,
                "dynatemp_range": params.dynatemp_range, "dynatemp_exponent": params.dynatemp_exponent,
                "stop": params.stop, "ignore_eos": self.ignore_eos, "n_probs": self.n_probs, "stream": self.stream,
                "post_sampling_probs": self.post_sampling_probs,
                "grammar": self.grammar or "",
                "samplers": (["penalties"] if penalties_on(self.samplers) else []) + (["dry"] if params.dry else [])
                + (["top_n_sigma"] if params.top_n_sigma else []) + [s for s in OURS if params_has(params, s)]
                + (["typ_p"] if params.typical_p < 1.0 else []) + (["xtc"] if params.xtc_probability else [])
                + (["adaptive_p"] if params.adaptive else []),
                "n_indent": self.n_indent, "t_max_predict_ms": self.t_max_predict_ms}


def check_options(extras: dict, strict: bool = True) -> list[str]:
    """llama-server's options beyond a request's own fields: those of samplers this server lacks at
    the value that turns them off, runtime ones (unused). Any other is a 400 naming it, or, not
    `strict` (llama-server's own routes: it ignores what it does not know, and clients such as
    SillyTavern send other backends' options there), ignored: the names come back, sorted."""
    ignored = []
    for name, value in extras.items():
        if name in UNUSED:
            continue
        if name not in OFF:
            if strict:
                raise BadRequest(f"{name} is not an option this server knows", name)
            ignored.append(name)
            continue
        try:
            ok = OFF[name](value)
        except TypeError:
            ok = False
        if not ok:
            raise BadRequest(f"{name} {value!r:.80} is not supported: {OFF_WHY.get(name, 'this server has no such sampler')} "
                             f"(leave it out, or send the value that turns it off)", name)
    return sorted(ignored)


def sampler_names(samplers: Union[list[str], str, None]) -> tuple[list[str], list[str]]:
    """(the samplers a `samplers` list names, as llama-server's canonical names; the entries it
    ignores): names in any case, kebab-case or without underscores, its aliases, or a string of
    --sampling-seq letters, as llama-server reads them. A list of anything but texts is a 400."""
    if samplers is None:
        return [], []
    if isinstance(samplers, str):
        return ([SAMPLER_LETTERS[c] for c in samplers if c in SAMPLER_LETTERS],
                [c for c in samplers if c not in SAMPLER_LETTERS])
    if not all(isinstance(n, str) for n in samplers):
        raise BadRequest("samplers: a list of sampler names (or a string of their letters)", "samplers")
    known, unknown = [], []
    for name in samplers:
        low = name.lower()
        found = low if low in OURS or low in OTHERS else ALIASES.get(low) or next(
            (k for k in (*OURS, *OTHERS) if "_" in k and low in (k.replace("_", "-"), k.replace("_", ""))), None)
        (known if found else unknown).append(found or name)
    return known, unknown


def switched(samplers: Union[list[str], str, None], temperature: float, top_k: int, top_p: float,
             min_p: float) -> tuple[float, int, float, float]:
    """(temperature, top_k, top_p, min_p) with the samplers a `samplers` list leaves out turned off
    (temperature 1: the logits as they are); the list's order is not followed (this server's is fixed)."""
    if samplers is None:
        return temperature, top_k, top_p, min_p
    names, _ = sampler_names(samplers)
    return (temperature if "temperature" in names else 1.0, top_k if "top_k" in names else 0,
            top_p if "top_p" in names else 1.0, min_p if "min_p" in names else 0.0)


def named(samplers: Union[list[str], str, None], sampler: str) -> bool:
    """Whether llama-server runs `sampler` ("penalties": the repeat, presence and frequency
    penalties; "dry"): always, unless a `samplers` list leaves it out."""
    return samplers is None or sampler in sampler_names(samplers)[0]


def penalties_on(samplers: Union[list[str], str, None]) -> bool:
    return named(samplers, "penalties")


def cut_fields(body: Any, samplers: Union[list[str], str, None]) -> dict:
    """SamplingParams' typical_p, top_n_sigma and XTC fields from llama-server's options, each off
    at its off value (typical_p >= 1, top_n_sigma <= 0, xtc_probability 0 or xtc_threshold > 0.5,
    as llama.cpp turns them off) or where a samplers list leaves out typ_p, top_n_sigma or xtc."""
    out = {}
    typical = getattr(body, "typical_p", None)
    if typical is not None and typical < 1.0 and named(samplers, "typ_p"):
        out["typical_p"] = typical
    sigma = getattr(body, "top_n_sigma", None)
    if sigma is not None and sigma > 0.0 and named(samplers, "top_n_sigma"):
        out["top_n_sigma"] = sigma
    spread = getattr(body, "dynatemp_range", None)
    if spread and spread > 0.0 and named(samplers, "temperature"):
        exponent = getattr(body, "dynatemp_exponent", None)
        out.update(dynatemp_range=spread, dynatemp_exponent=1.0 if exponent is None else exponent)
    if getattr(body, "mirostat", None):   # in place of the others (llama.cpp: its chain is temperature, then mirostat)
        out.update(mirostat=body.mirostat, mirostat_tau=5.0 if body.mirostat_tau is None else body.mirostat_tau,
                   mirostat_eta=0.1 if body.mirostat_eta is None else body.mirostat_eta)
    target = getattr(body, "adaptive_target", None)
    if target is not None and target >= 0.0 and samplers is not None and named(samplers, "adaptive_p"):
        decay = getattr(body, "adaptive_decay", None)   # (only where a list names it: llama-server's default has not)
        out.update(adaptive_target=target, adaptive_decay=0.9 if decay is None else min(max(decay, 0.0), 0.99))
    chance, threshold = getattr(body, "xtc_probability", None), getattr(body, "xtc_threshold", None)
    threshold = 0.1 if threshold is None else threshold
    if chance and threshold <= 0.5 and named(samplers, "xtc"):
        out.update(xtc_probability=chance, xtc_threshold=threshold)
    return out


def dry_fields(body: Any, tokenizer: Any, samplers: Union[list[str], str, None]) -> dict:
    """SamplingParams' DRY fields from a request's dry_* options (off where its multiplier is 0
    or a samplers list leaves "dry" out); the breaker strings become the ids whose text holds one."""
    if not body.dry_multiplier or not named(samplers, "dry"):
        return {}
    breakers = body.dry_sequence_breakers
    if breakers is None:
        breakers = list(DEFAULT_BREAKERS)
    if not breakers or not all(isinstance(b, str) for b in breakers):
        raise BadRequest("dry_sequence_breakers must be a non-empty list of strings", "dry_sequence_breakers")
    return {"dry_multiplier": body.dry_multiplier, "dry_base": body.dry_base,
            "dry_allowed_length": body.dry_allowed_length, "dry_penalty_last_n": body.dry_penalty_last_n,
            "dry_breakers": breaker_ids(tokenizer, breakers)}


def params_has(params: SamplingParams, sampler: str) -> bool:
    return {"top_k": params.top_k > 0, "top_p": params.top_p < 1.0, "min_p": params.min_p > 0.0,
            "temperature": True}[sampler]


def logit_bias(value: Union[list, dict, None], tokenizer: Any, vocab: Optional[int]) -> dict[int, float]:
    """llama-server's logit_bias: [[id or text, bias or false], ...] or {"id or text": bias}; a text
    biases each of its tokens; false bans the id (-100 here, OpenAI's floor); biases past +-100 are
    held to it (the same effect)."""
    pairs = list(value.items()) if isinstance(value, dict) else list(value or [])
    lo, hi = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadRequest("logit_bias entries are [token, bias] pairs", "logit_bias")
        key, bias = pair
        if bias is False:
            bias = lo
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise BadRequest(f"logit_bias: {bias!r} is not a bias (a number, or false)", "logit_bias")
        if isinstance(key, str) and key.lstrip("-").isdigit() and isinstance(value, dict):
            key = int(key)
        ids = [key] if isinstance(key, int) and not isinstance(key, bool) else None
        if ids is None and isinstance(key, str):
            ids = encode_plain(tokenizer, key)
        if ids is None:
            raise BadRequest(f"logit_bias: {key!r} is neither a token id nor a text", "logit_bias")
        for t in ids:
            if t < 0 or (vocab is not None and t >= vocab):
                raise BadRequest(f"logit_bias names token id {t}; this model's ids are 0..{(vocab or 1) - 1}",
                                 "logit_bias")
            out[int(t)] = min(hi, max(lo, float(bias)))
    return out


PromptForm = Union[str, list]


def prompt_forms(prompt: Any) -> list[PromptForm]:
    """The request's prompts: one text, one list of ids and texts, or several of those (a list of
    texts, or a list holding lists); {"prompt_string": ...} objects stand for texts."""
    def one(p: Any) -> PromptForm:
        if isinstance(p, dict):
            if p.get("multimodal_data"):
                raise Unsupported("multimodal_data is not supported: this server reads text", "prompt")
            text = p.get("prompt_string")
            if not isinstance(text, str):
                raise BadRequest("a prompt object needs its prompt_string", "prompt")
            return text
        if isinstance(p, str):
            return p
        if isinstance(p, list) and all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
                                       for x in p):
            return p
        raise BadRequest("a prompt is a text, a list of token ids and texts, or an object with prompt_string",
                         "prompt")

    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or any(isinstance(p, (list, dict)) for p in prompt)):
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"at most {MAX_PROMPTS} prompts a request", "prompt")
        return [one(p) for p in prompt]
    return [one(prompt)]


def mixed_prompt(tokenizer: Any, p: PromptForm, limit: Optional[int]) -> Prompt:
    """A prompt of text and ids: texts tokenized without special tokens, ids as sent, and the
    tokenizer's BOS first when the prompt starts with text (llama-server's rule)."""
    parts = [p] if isinstance(p, str) else list(p)
    if not parts or parts == [""]:
        raise BadRequest("the prompt is empty", "prompt")
    ids = token_array()
    for part in parts:
        if isinstance(part, str):
            ids.extend(encode_bounded(tokenizer, part, limit, "prompt"))
        else:
            if not 0 <= int(part) < 2**31:   # (past an int32: no token's id; the vocabulary check says the rest)
                raise InvalidTokens(int(part), len(tokenizer))
            ids.append(int(part))
        if limit is not None and len(ids) > limit:
            raise PromptTooLong(limit, len(ids), "prompt")
    head = token_array(leading_specials(tokenizer)) if isinstance(parts[0], str) else token_array()
    return Prompt(head + ids, p if isinstance(p, str) else None, ids)


def infill_context(tokenizer: Any, req: "LlamaRequest", limit: Optional[int]) -> Prompt:
    """What comes before <prefix> in infill's prompt: [BOS], then, where the model has the
    repo-level tokens, <|repo_name|>myproject\\n, each extra file as <|file_sep|>NAME\\nTEXT and
    <|file_sep|>filename\\n (the file being edited); else the extra texts as they are. The files'
    names and texts are read as text, a special token's text in them too (as llama-server does:
    a file may hold `<|file_sep|>`). A 400 for a model without fill-in-the-middle tokens."""
    require_fim(tokenizer, "input_prefix", "it cannot infill; use /completion")
    vocab = tokenizer.get_vocab()
    body = token_array()

    def text(s: str) -> None:
        body.extend(encode_bounded(tokenizer, s, limit, "input_extra", specials=False))
        if limit is not None and len(body) > limit:
            raise PromptTooLong(limit, len(body), "input_extra")

    if all(t in vocab for t in REPO_TOKENS):
        repo, sep = (int(vocab[t]) for t in REPO_TOKENS)
        body.append(repo)
        text(REPO_NAME + "\n")
        for chunk in req.input_extra:
            body.append(sep)
            text(chunk.filename + "\n" + chunk.text)
        body.append(sep)
        text("filename\n")
    else:
        for chunk in req.input_extra:
            text(chunk.text)
    return Prompt(token_array(leading_specials(tokenizer)) + body, None, body)


def infill_prompt(tokenizer: Any, req: "LlamaRequest", limit: Optional[int]) -> Prompt:
    """infill_context, then <prefix> PREFIX <suffix> SUFFIX <middle> PROMPT: the model writes the
    middle, starting with PROMPT (PREFIX and SUFFIX read as text, special tokens' text too; PROMPT's
    special tokens' text read as those tokens, as llama-server reads them)."""
    if not isinstance(req.prompt, str):
        raise BadRequest("infill's prompt is a text (it follows the middle token)", "prompt")
    head = infill_context(tokenizer, req, limit)
    fmt = fim_format(tokenizer)
    body = token_array(head.continuation)
    body.extend(fim_ids(tokenizer, fmt, req.input_prefix, req.input_suffix, limit, ("input_prefix", "input_suffix"),
                        specials=False))
    body.extend(encode_bounded(tokenizer, req.prompt, limit, "prompt"))
    if limit is not None and len(body) > limit:
        raise PromptTooLong(limit, len(body), "prompt")
    return Prompt(token_array(leading_specials(tokenizer)) + body, None, body)


@dataclass
class Cut:
    """Where llama-server's code-completion limits end a reply early (n_indent, t_max_predict_ms)."""
    n_indent: int
    t_max_ms: int
    newline: bool = False          # the reply has a newline
    indent: Optional[int] = None   # the blanks that open the line being written, None: the first line, or one
                                   # whose text has begun

    def feed(self, piece: str, since_first_ms: float) -> tuple[str, bool]:
        """(the part of `piece` to keep, whether the reply ends here)."""
        if self.n_indent > 0:
            for i, c in enumerate(piece):
                if c == "\n":
                    self.indent = 0
                elif self.indent is None:
                    continue
                elif c in " \t":
                    self.indent += 1
                elif self.indent < self.n_indent:   # a line less indented than the cursor: cut before its text
                    return piece[:i], True
                else:
                    self.indent = None
        self.newline = self.newline or "\n" in piece
        return piece, self.t_max_ms > 0 and self.newline and since_first_ms > self.t_max_ms


def probabilities(text_of: TokenText, entries: Optional[list], post: bool = False) -> list[dict]:
    """completion_probabilities: each token's id, text, bytes and logprob, and its top alternatives;
    `post` (post_sampling_probs), as llama-server writes those: prob and top_probs."""
    def item(token: int, lp: float) -> dict:
        t, b = text_of(token)
        return {"id": token, "token": t, "bytes": b, **({"prob": math.exp(lp)} if post else {"logprob": finite(lp)})}

    top = "top_probs" if post else "top_logprobs"
    return [{**item(e.token, e.logprob), top: [item(i, lp) for i, lp in e.top]} for e in entries or []]


def prompt_progress(prompt_tokens: int, cached: int, done: int, to_read: int, began: float, now: float) -> dict:
    """llama-server's prompt_progress: the prompt's tokens, those reused from the session, those in
    the session so far (`done` of the `to_read` new tokens read in chunks; the reply's first step
    reads the last few, counted once the chunks are in) and the milliseconds since the run began."""
    processed = prompt_tokens if done >= to_read else cached + done
    return {"total": prompt_tokens, "cache": cached, "processed": processed, "time_ms": int((now - began) * 1e3)}


def stop_type(finish_reason: str, stop_word: Optional[str], cut: bool) -> str:
    if cut or finish_reason in ("length", "fed"):
        return "limit"
    if finish_reason == "stop":
        return "word" if stop_word is not None else "eos"
    return "none"


def timings(prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float) -> dict:
    def rate(n: int, s: float) -> tuple[float, float]:
        return (s * 1e3 / n if n else 0.0), (n / s if s > 0 else 0.0)

    p_tok, p_rate = rate(prompt_n, prompt_s)
    g_tok, g_rate = rate(predicted_n, predicted_s)
    return {"prompt_n": prompt_n, "prompt_ms": prompt_s * 1e3, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_rate, "predicted_n": predicted_n, "predicted_ms": predicted_s * 1e3,
            "predicted_per_token_ms": g_tok, "predicted_per_second": g_rate}


def pick_fields(body: dict, fields: Optional[list[str]]) -> dict:
    """response_fields: only these (a/b: body[a][b], under the key "a/b"); missing ones left out."""
    if fields is None:
        return body
    out = {}
    for name in fields:
        value: Any = body
        for key in name.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[name] = value
    return out


def piece_of(text_of: TokenText, token: int) -> Union[str, list[int]]:
    """/tokenize's piece: the token's text where its bytes are whole UTF-8, else the bytes."""
    _, data = text_of(token)
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
