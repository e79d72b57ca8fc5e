"""Constraints on sampling (generation.Constraint): JSON / JSON-schema grammars through
llguidance, and a test's forced token sequence. Backend-agnostic: masks are numpy bool
arrays over token ids; each backend's Sampler applies them to its own logits."""

from __future__ import annotations

import copy
import json
import threading
import weakref
from typing import Any, Optional, Sequence

import numpy as np

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A schema the grammar library cannot compile (the request's fault: a 400)."""


def _rust_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers` library's tokenizer inside transformers' (or inside mlx-lm's wrapper of it)."""
    from tokenizers import Tokenizer

    t = tokenizer
    for _ in range(3):
        if isinstance(t, Tokenizer):
            return t
        inner = getattr(t, "backend_tokenizer", None)
        t = inner if inner is not None else getattr(t, "_tokenizer", None)
    raise GrammarError("structured output needs a fast (tokenizers-library) tokenizer")


def _ll_tokenizer(tokenizer: Any, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of the tokenizer: about a second for a 150K vocabulary, so built once."""
    import llguidance

    with _LOCK:
        ll = _TOKENIZERS.get(tokenizer)
        if ll is None:
            rust = copy.copy(_rust_tokenizer(tokenizer))
            rust.no_padding()
            rust.no_truncation()
            ll = _TOKENIZERS[tokenizer] = llguidance.LLTokenizer(rust.to_str(), eos_token=sorted(eos_ids) or None)
    return ll


# JSON as json.dumps writes it (and models are trained on): ", " and ": ", no other whitespace
# (flexible whitespace lets a weak model pad forever)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema: dict) -> str:
    """A Lark `%json` rule body (llguidance's extension) for `schema`, in JSON_STYLE."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})


def json_grammar(schema: Optional[dict]) -> str:
    """The llguidance grammar for any JSON object (schema None) or for `schema`, checked."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults=JSON_STYLE)
    except Exception as e:   # the compiler raises on schemas it cannot read
        raise GrammarError(f"the JSON schema cannot be enforced: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the JSON schema cannot be enforced: {error}")
    return grammar


class Grammar:
    """A Constraint from an llguidance grammar: the ids that keep the output in the grammar; once
    it is complete, only end-of-sequence."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], grammar: str):
        import llguidance
        import llguidance.numpy

        self.ll = _ll_tokenizer(tokenizer, eos_ids)
        self.matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {self.matcher.get_error()}")
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, self.ll.vocab_size)
        self._fill = llguidance.numpy.fill_next_token_bitmask

    def allowed(self) -> Optional[np.ndarray]:
        if self.matcher.is_error():   # a token it could not take: nothing more it can say
            return None
        self._fill(self.matcher, self.bitmask)
        bits = np.unpackbits(self.bitmask[0].view(np.uint8), bitorder="little")
        return bits[:self.ll.vocab_size].astype(bool)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None


class ForcedTokens:
    """Test-only Constraint: the sampler can pick nothing but `ids`, in order, then end-of-sequence.
    Lets a test make a random model 'say' a tool call while template, parser, stream and
    session all run for real."""

    def __init__(self, ids: Sequence[int], eos_ids: Sequence[int]):
        self.ids, self.eos_ids, self.at = list(ids), sorted(eos_ids), 0

    def allowed(self) -> np.ndarray:
        nxt = [self.ids[self.at]] if self.at < len(self.ids) else self.eos_ids
        mask = np.zeros(max(nxt) + 1, dtype=bool)
        mask[nxt] = True
        return mask

    def advance(self, token: int) -> None:
        self.at += 1

