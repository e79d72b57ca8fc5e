"""`localheap bench structured`: what constrained decoding (response_format json_schema) costs per
token, against unconstrained decoding of the same model in the same run (interleaved A,B,A,B);
the tool-call grammar of tool_choice auto (its cost on a reply that opens no call, and calls
opened held or free: how many come back valid); and the grammar libraries' mask time alone on one
tokenizer (llguidance, the one used; xgrammar where installed, for comparison)."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

from ..generation import SamplingParams
from ..grammar import JSON_STYLE, Grammar, LazyGrammar, LeadingTokens, json_grammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "notes"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "notes": {"type": "array", "items": {"type": "string"}}}}
PROMPT = "Describe a person as a JSON object with a name, an age and some notes."


def _decode(backend, cfg, prompt: list[int], tokens: int, seed: int, constraint,
            out: Optional[list] = None) -> tuple[int, float]:
    """(tokens decoded after the first, seconds they took): prefill and the first token excluded.
    `out` gets the ids sampled."""
    cache = backend.new_cache(cfg)
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, constraint=constraint)
    n, start = 0, None
    for tok in backend.generate(cache, prompt, params):
        if out is not None:
            out.append(tok)
        if start is None:
            start = time.perf_counter()
        else:
            n += 1
        if tok in backend.eos_token_ids:
            break
    sync = getattr(backend, "synchronize", None)
    if sync is not None:
        sync()
    return n, time.perf_counter() - (start or time.perf_counter())


def run_decode(backend, cfg, tokens: int, repeats: int, log: Callable[[str], None]) -> list[dict]:
    prompt = list(backend.tokenizer.encode(PROMPT))
    grammar = json_grammar(SCHEMA)
    totals = {p: [0, 0.0] for p in ("unconstrained", "json_schema")}
    _decode(backend, cfg, prompt, 8, 0, None)   # warm-up
    for rep in range(repeats):
        for path in totals:   # interleaved
            constraint = Grammar(backend.tokenizer, backend.eos_token_ids, grammar) if path == "json_schema" else None
            n, s = _decode(backend, cfg, prompt, tokens, rep, constraint)
            totals[path][0] += n
            totals[path][1] += s
            log(f"{path} repeat {rep}: {n} tokens in {s:.3f} s")
    rows = [{"path": p, "tokens": n, "ms_per_token": 1e3 * s / n if n else None} for p, (n, s) in totals.items()]
    base = rows[0]["ms_per_token"]
    for r in rows:
        r["x_unconstrained"] = r["ms_per_token"] / base if base and r["ms_per_token"] else None
    return rows


TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                                           "unit": {"type": "string", "enum": ["C", "F"]}}}}},
         {"type": "function", "function": {
             "name": "get_time", "description": "The time in a zone",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                            "properties": {"zone": {"type": "string", "maxLength": 24}}}}}]


def _valid_call(call) -> bool:
    """Whether a parsed call names one of TOOLS with arguments its schema takes (TOOLS' keywords only)."""
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == call.name), None)
    if tool is None or call.error is not None:
        return False
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return False
    schema = tool["parameters"]
    if not isinstance(args, dict) or set(args) - set(schema["properties"]) or set(schema["required"]) - set(args):
        return False
    for key, value in args.items():
        prop = schema["properties"][key]
        if not isinstance(value, str) or ("enum" in prop and value not in prop["enum"]) \
                or len(value) > prop.get("maxLength", len(value)):
            return False
    return True


class _ReadAtOnce:
    """The lazy grammar as a constraint without `see`: the sampler reads each token on the host as
    it is drawn (what the grammar would cost without its one-step-late reads)."""

    def __init__(self, inner: LazyGrammar):
        self.inner = inner

    def allowed(self):
        return self.inner.allowed()

    def advance(self, token: int) -> None:
        self.inner.advance(token)


def run_tools(backend, cfg, tokens: int, repeats: int, log: Callable[[str], None]) -> list[dict]:
    """tool_choice auto, in the model's own tool-call syntax (serve's default): the lazy grammar on a
    reply that opens no call (its cost, and whether the tokens are the same as with no grammar), and
    replies made to open a call (their first tokens forced to the family's opener) with the call held
    by the grammar (to one call) or free (serve --no-tool-grammar): how many calls come back valid."""
    from ..server.chat import call_triggers
    from ..server.toolformats import tool_format

    tok, eos = backend.tokenizer, backend.eos_token_ids
    fmt = tool_format(tok)
    # GLM-4-0414's call is a reply that begins with the tool's name (and is the whole reply)
    opener = TOOLS[0]["function"]["name"] if fmt.leading_name else (fmt.starts or ('{"name"',))[0]
    lead = list(tok.encode(opener, add_special_tokens=False))
    prompt = list(tok.encode(PROMPT))   # (a prompt the model writes on from: the demo model stops at once on some)
    triggers = call_triggers(fmt, TOOLS, tok)
    one = call_triggers(fmt, TOOLS, tok, parallel=False)

    def lazy():
        return LazyGrammar(tok, eos, triggers, once=fmt.leading_name)

    paths: dict[str, Callable[[], Any]] = {
        "auto, no grammar": lambda: None, "auto, grammar": lazy,
        "auto, grammar read at once": lambda: _ReadAtOnce(lazy()),
        "call opened, free": lambda: LeadingTokens(lead, eos, None),
        # one call (parallel_tool_calls false): a random model's list of calls runs on to the token cap
        "call opened, held": lambda: LeadingTokens(lead, eos, LazyGrammar(tok, eos, one, once=True))}
    totals = {p: {"tokens": 0, "s": 0.0, "calls": 0, "valid": 0, "outputs": []} for p in paths}
    for rep in range(repeats):
        for path, make in paths.items():   # interleaved
            out: list[int] = []
            n, s = _decode(backend, cfg, prompt, tokens, rep, make(), out)
            t = totals[path]
            t["tokens"] += n
            t["s"] += s
            t["outputs"].append(out)
            if path.startswith("call opened"):
                text = tok.decode([i for i in out if i not in eos], skip_special_tokens=False)
                if fmt.leading_name:   # the reply is the call, its name included
                    calls = fmt.parse(text) or []
                else:
                    body = text[text.find(opener) + len(opener):]
                    calls = (fmt.parse(body.split(fmt.end)[0]) if fmt.end is None or fmt.end in body else None) or []
                t["calls"] += 1
                t["valid"] += bool(calls) and all(_valid_call(c) for c in calls)
            log(f"tools {path} repeat {rep}: {n} tokens in {s:.3f} s")
    rows = []
    base = totals["auto, no grammar"]
    for path, t in totals.items():
        row = {"path": path, "tokens": t["tokens"], "ms_per_token": 1e3 * t["s"] / t["tokens"] if t["tokens"] else None}
        row["x_no_grammar"] = row["ms_per_token"] / (1e3 * base["s"] / base["tokens"]) \
            if row["ms_per_token"] and base["tokens"] else None
        if path == "auto, grammar":
            row["valid_calls"] = "same tokens" if t["outputs"] == base["outputs"] else \
                f"tokens differ in {sum(a != b for a, b in zip(t['outputs'], base['outputs']))} of {len(base['outputs'])}"
        elif path.startswith("auto, grammar"):   # reading every token at once must not change them
            same = t["outputs"] == totals["auto, grammar"]["outputs"]
            row["valid_calls"] = "same tokens as pipelined" if same else "tokens differ from pipelined"
        elif t["calls"]:
            row["valid_calls"] = f"{t['valid']} of {t['calls']}"
        rows.append(row)
    return rows


def _sample_text(tokenizer) -> list[int]:
    """A JSON reply valid under SCHEMA, as token ids: the steps a mask is computed for."""
    value = {"name": "Ada Lovelace", "age": 36,
             "notes": ["mathematician", "wrote the first published program", "worked with Babbage"] * 3}
    text = json.dumps(value, separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]))
    return list(tokenizer.encode(text, add_special_tokens=False))


def run_masks(tokenizer, eos_ids, repeats: int) -> list[dict]:
    """Mask computation alone, per token of a fixed valid reply, per library (µs)."""
    ids = _sample_text(tokenizer)
    rows = []
    libs: list[tuple[str, Callable[[], Any]]] = [("llguidance", lambda: _llguidance(tokenizer, eos_ids))]
    if _xgrammar_available():
        libs.append(("xgrammar", lambda: _xgrammar(tokenizer)))
    for name, make in libs:
        t0 = time.perf_counter()
        step = make()
        compile_s = time.perf_counter() - t0
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            step_all = step()
            for t in ids:
                step_all(t)
            per = (time.perf_counter() - t0) / len(ids)
            best = per if best is None else min(best, per)
        rows.append({"library": name, "tokens": len(ids), "us_per_token": best * 1e6, "setup_s": compile_s})
    return rows


def _llguidance(tokenizer, eos_ids):
    grammar = json_grammar(SCHEMA)
    Grammar(tokenizer, eos_ids, grammar)   # the tokenizer's llguidance view, built once (counted in setup)

    def fresh():
        g = Grammar(tokenizer, eos_ids, grammar)

        def step(token: int) -> None:
            g.allowed()
            g.advance(token)
        return step
    return fresh


def _xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:
        return False
    return True


def _xgrammar(tokenizer):
    import numpy as np
    import xgrammar as xgr

    from transformers import PreTrainedTokenizerBase

    hf = tokenizer if isinstance(tokenizer, PreTrainedTokenizerBase) else tokenizer._tokenizer   # mlx-lm's wrapper
    info = xgr.TokenizerInfo.from_huggingface(hf)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def fresh():
        m = xgr.GrammarMatcher(compiled)

        def step(token: int) -> None:   # the mask, unpacked to a bool array as ours is
            m.fill_next_token_bitmask(bitmask)
            np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
            m.accept_token(token)
        return step
    return fresh


def report(decode: list[dict], tools: list[dict], masks: list[dict], backend, vocab: Optional[int], table) -> str:
    head = f"model {backend.model_name} | backend {backend.name} | vocabulary {vocab:,}\n"
    return (head + table(decode, [("path", "path", ""), ("tokens", "tokens", ","), ("ms_per_token", "ms/token", ".3f"),
                                  ("x_unconstrained", "x unconstrained", ".2f")])
            + "\n\ntool_choice auto (the calls a reply opens, held by the grammar or free):\n"
            + table(tools, [("path", "path", ""), ("tokens", "tokens", ","), ("ms_per_token", "ms/token", ".3f"),
                            ("x_no_grammar", "x no grammar", ".2f"), ("valid_calls", "valid calls", "")])
            + "\n\nmask computation alone (a fixed valid reply, best of the repeats):\n"
            + table(masks, [("library", "library", ""), ("tokens", "tokens", ","),
                            ("us_per_token", "us/token", ",.1f"), ("setup_s", "setup s", ".3f")]))
