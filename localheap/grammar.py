"""Constraints on sampling (generation.Constraint): JSON / JSON-schema grammars through
llguidance, and a test's forced token sequence. Backend-agnostic: masks are numpy bool
arrays over token ids; each backend's Sampler applies them to its own logits."""

from __future__ import annotations

import copy
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

log = logging.getLogger("localheap.grammar")

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A schema the grammar library cannot compile (the request's fault: a 400)."""


def rust_tokenizer(tokenizer: Any) -> Any:
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
            rust = copy.copy(rust_tokenizer(tokenizer))
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


def has_local_refs(value: Any) -> bool:
    """Whether a JSON schema refers into itself ({"$ref": "#/$defs/A"}, "#")."""
    if isinstance(value, dict):
        ref = value.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(has_local_refs(v) for v in value.values())
    return isinstance(value, list) and any(has_local_refs(v) for v in value)


def rebased(value: Any, base: str) -> Any:
    """A JSON schema's copy whose references into itself point under `base` (a JSON pointer, e.g.
    "/$defs/args"): to place it inside another schema that holds it there too, where its own
    "#/$defs/A" would no longer resolve."""
    if isinstance(value, dict):
        return {k: "#" + base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebased(v, base)
                for k, v in value.items()}
    return [rebased(v, base) for v in value] if isinstance(value, list) else value


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


_VALID: dict[str, Optional[str]] = {}   # grammar text -> llguidance's complaint (None: it compiles)


def grammar_error(grammar: str) -> Optional[str]:
    """Why llguidance cannot enforce `grammar`, or None; remembered (a client sends the same tools
    on every turn)."""
    import llguidance

    with _LOCK:
        if grammar not in _VALID:
            if len(_VALID) > 256:
                _VALID.clear()
            _VALID[grammar] = llguidance.LLMatcher.validate_grammar(grammar) or None
        return _VALID[grammar]


@dataclass(frozen=True)
class Trigger:
    """Where a call opens in a free reply: the text `text`; what follows it is held to `grammar`.
    `at_start`: only as the reply's first text (after its reasoning and spaces; `exact`: no spaces);
    `inclusive`: the grammar begins with `text` itself (the call's own first bytes, as Llama's `{"name"`)."""
    text: str
    grammar: str
    at_start: bool = False
    inclusive: bool = False
    exact: bool = False            # (at_start) at the very first byte: no whitespace before it (GLM-4)


@dataclass
class IfLast:
    """A mask that applies only where the token still on the device (the sampler's last draw,
    unread on the host) is one of a few ids: what a lazy grammar allows after a call's opener that
    is one token by itself (Qwen's `<tool_call>`, Phi-4-mini's `<|tool_call|>`), so the token after
    it is held without reading the one before it. `masks`: (id, bool [vocab] the grammar allows
    after it) pairs; `cache`: the sampler's copies of them on its device (kept across steps)."""
    token: Any
    masks: list
    cache: dict


def _penalties(c: IfLast, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """[len(masks) + 1, vocab] float32 to add to the scores (row 0: nothing; row i + 1: -inf where
    opener i's grammar refuses), and the openers' ids."""
    table = np.zeros((len(c.masks) + 1, vocab), dtype=np.float32)
    for i, (_, mask) in enumerate(c.masks):
        keep = np.zeros(vocab, dtype=bool)
        n = min(len(mask), vocab)
        keep[:n] = mask[:n]
        table[i + 1][~keep] = -np.inf
    return table, np.array([tid for tid, _ in c.masks], dtype=np.int64)


def if_last_torch(scores: Any, c: IfLast) -> Any:
    """scores [1, vocab] (torch) with the ids an opener's grammar refuses at -inf where the token in
    flight is that opener: one row of a table picked on the device and added, no host sync."""
    import torch

    key = ("torch", scores.device, scores.shape[-1])
    if key not in c.cache:
        table, ids = _penalties(c, scores.shape[-1])
        c.cache[key] = (torch.from_numpy(table).to(scores.device), torch.from_numpy(ids).to(scores.device),
                        torch.arange(1, len(ids) + 1, device=scores.device))
    table, ids, rows = c.cache[key]
    row = ((c.token.reshape(-1)[:1] == ids).long() * rows).sum()   # 0: not an opener
    return scores + table[row]


def if_last_mlx(scores: Any, c: IfLast) -> Any:
    """if_last_torch for an mlx [..., vocab] array."""
    import mlx.core as mx

    key = ("mlx", scores.shape[-1])
    if key not in c.cache:
        table, ids = _penalties(c, scores.shape[-1])
        c.cache[key] = (mx.array(table), mx.array(ids), mx.arange(1, len(ids) + 1))
    table, ids, rows = c.cache[key]
    row = ((c.token.reshape(-1)[:1].astype(mx.int64) == ids).astype(mx.int64) * rows).sum()
    return scores + table[row]


class LazyGrammar:
    """A Constraint for a reply that may call tools (tool_choice auto): the reply is free (nothing
    masked: a reply that opens no call samples exactly as with no constraint) until a trigger opens
    a call outside its reasoning; from there the call is held to the trigger's grammar (a tool's
    name, arguments valid for its schema) until that is complete, then the reply is free again
    (`once`, parallel_tool_calls false: then it can only end).
    The trigger is found in the reply's bytes, so it may span tokens (or end inside one: what the
    token says past it is fed to the grammar).

    A sampler that can hand it the token still on the device (`see`, not `advance`) keeps its decode
    pipelining while the reply is free: a token is read on the host one step late, once the next
    one is queued, unless the mask depends on it (inside a call, or where the text so far ends with
    part of a trigger). A trigger that is one token by itself (Qwen's `<tool_call>`) is read a step
    late too: while the reply is free (past its reasoning) the mask is an IfLast, which the sampler
    applies on the device only where the token in flight is that opener, so the token after it is
    held by the call's grammar all the same (a sampler that hands tokens with `advance` reads each
    at once and never gets one)."""

    THINK, END_THINK = b"<think>", b"</think>"

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], triggers: Sequence[Trigger], in_think: bool = False,
                 once: bool = False):
        self.tokenizer, self.eos_ids = tokenizer, list(eos_ids)
        self.once = once                       # one call at most (parallel_tool_calls false): then the end
        self.ll = _ll_tokenizer(tokenizer, eos_ids)
        self.triggers = [(t, t.text.encode()) for t in triggers]
        self.out = bytearray()                 # the reply so far
        self.thinking: Optional[bool] = True if in_think else None   # None: not known yet
        self.free_from = 0                     # where the reply's text past its reasoning begins
        self.scanned = 0                       # bytes of `out` searched for triggers
        self.starts = [t for t in self.triggers if t[0].at_start]   # at_start triggers still possible
        self.active: Optional[Grammar] = None
        self.held = 0                          # calls held to a grammar (tests and logs)
        self.broken: Optional[str] = None      # a grammar that could not go on (its call is free)
        self.pending: list = []                # tokens seen on the device, not yet read (see)
        self.prefixes = {text[:k] for _, text in self.triggers for k in range(1, len(text))}
        self.longest = max(map(len, self.prefixes), default=0)
        self.openers = {}                      # id -> trigger: a trigger that is that one token
        for t, text in self.triggers:
            ids = [] if t.at_start or t.inclusive else tokenizer.encode(t.text, add_special_tokens=False)
            if len(ids) == 1 and self.ll.decode_bytes(ids) == text:
                self.openers.setdefault(ids[0], t)
        self.if_last: Optional[IfLast] = None  # made at the first free step with a token in flight

    def allowed(self) -> Optional[np.ndarray]:
        while self.pending and (len(self.pending) > 1 or self._must_read()):
            self.advance(int(self.pending.pop(0).item()))
        if self.active is not None:
            return self.active.allowed()
        if self.once and self.held and self.broken is None:   # its one call is complete: only the end
            mask = np.zeros(max(self.eos_ids) + 1, dtype=bool)
            mask[self.eos_ids] = True
            return mask
        if self.pending and self.openers and self.thinking is not True:   # it may be an opener
            if self.if_last is None:
                masks = [(i, Grammar(self.tokenizer, self.eos_ids, t.grammar).allowed())
                         for i, t in self.openers.items()]
                self.if_last = IfLast(None, [(i, m) for i, m in masks if m is not None], {})
            if self.if_last.masks:
                self.if_last.token = self.pending[-1]
                return self.if_last
        return None

    def see(self, token: Any) -> None:
        """The token just sampled, still on the device (a [1] array): read at the next allowed()."""
        self.pending.append(token)

    def _must_read(self) -> bool:
        """Whether the next mask depends on the token in flight: inside a call, while the reply's
        first text could be an at-start trigger, or where the text so far ends with a trigger's start."""
        if self.active is not None or (self.once and self.held) or (self.starts and self.thinking is not True):
            return True
        tail = bytes(self.out[-self.longest:]) if self.longest else b""
        return any(tail.endswith(p) for p in self.prefixes)

    def advance(self, token: int) -> None:
        piece = self.ll.decode_bytes([token])
        self.out += piece
        if self.active is not None:
            m = self.active.matcher
            if not m.consume_token(token) or m.is_error():
                self._release(m.get_error() or "the token was refused")
            elif m.is_stopped():
                self._release(None)
            return
        if not self._past_reasoning():
            return
        self._scan()

    def _past_reasoning(self) -> bool:
        """Whether the reply is past its reasoning (the region triggers are looked for in)."""
        if self.thinking is None:
            head = bytes(self.out).lstrip()
            if self.THINK.startswith(head):   # still could open a think block
                return False
            self.thinking = head.startswith(self.THINK)
            if self.thinking:
                self.free_from = self.scanned = len(self.out) - len(head) + len(self.THINK)
        if self.thinking:
            at = self.out.find(self.END_THINK, max(self.free_from, self.scanned - len(self.END_THINK) + 1))
            if at < 0:
                self.scanned = len(self.out)
                return False
            self.thinking = False
            self.free_from = self.scanned = at + len(self.END_THINK)
        return True

    def _scan(self) -> None:
        if self.starts:   # (only while the reply's first text could still be one: it is short)
            region = bytes(self.out[self.free_from:])
            head = region.lstrip()
            for trig, text in list(self.starts):
                lead = region if trig.exact else head
                if lead.startswith(text):
                    return self._hold(trig, self.free_from + len(region) - len(lead), text)
                if not text.startswith(lead):
                    self.starts.remove((trig, text))
        found = None
        for trig, text in self.triggers:
            if trig.at_start:
                continue
            at = self.out.find(text, max(self.free_from, self.scanned - len(text) + 1))
            if at >= 0 and (found is None or at < found[1]):
                found = (trig, at, text)
        self.scanned = len(self.out)
        if found is not None:
            self._hold(*found)

    def _hold(self, trig: Trigger, at: int, text: bytes) -> None:
        self.starts = []
        self.active = Grammar(self.tokenizer, self.eos_ids, trig.grammar)
        self.held += 1
        tail = bytes(self.out[at if trig.inclusive else at + len(text):])
        if tail:   # written already: the grammar takes it as it came (any tokenization of it)
            m = self.active.matcher
            if not m.consume_tokens(self.ll.tokenize_bytes(tail)) or m.is_error():
                self._release(m.get_error() or f"the call began {tail!r}")
            elif m.is_stopped():
                self._release(None)

    def _release(self, error: Optional[str]) -> None:
        self.active = None
        self.scanned = len(self.out)
        if error is not None:
            self.broken = error


# id(LLTokenizer) -> (it, bool [vocab]: the ids whose text is only whitespace); it is held so that its id
# names no other (it takes no weak reference)
_BLANKS: dict[int, tuple[Any, np.ndarray]] = {}


def _blank_ids(ll: Any) -> np.ndarray:
    with _LOCK:
        if id(ll) not in _BLANKS:
            _BLANKS[id(ll)] = (ll, np.array([(lambda b: bool(b) and not b.strip())(ll.decode_bytes([i]))
                                             for i in range(ll.vocab_size)], dtype=bool))
        return _BLANKS[id(ll)][1]


class AfterReasoning:
    """A Constraint for a reply that begins inside its reasoning (the prompt ends inside <think>)
    and must then be `grammar` (a forced call, structured output): nothing is masked until
    </think>; then up to BLANKS whitespace-only tokens (the blank line models write after it) or
    the grammar's first token; from there the grammar holds the rest, and once it is complete only
    end-of-sequence. The grammar is compiled at once (GrammarError: it cannot be enforced)."""

    END_THINK = b"</think>"
    BLANKS = 2

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], grammar: str):
        self.grammar = Grammar(tokenizer, eos_ids, grammar)
        self.ll = self.grammar.ll
        self.out = bytearray()        # the reasoning so far
        self.scanned = 0              # bytes of it searched for </think>
        self.reasoning = True
        self.blanks = 0               # whitespace-only tokens after </think>
        self.held = False             # the grammar has taken a token

    def allowed(self) -> Optional[np.ndarray]:
        if self.reasoning:
            return None
        mask = self.grammar.allowed()
        if mask is not None and not self.held and self.blanks < self.BLANKS:
            mask = mask | _blank_ids(self.ll)[:len(mask)]
        return mask

    def advance(self, token: int) -> None:
        if self.reasoning:
            self.out += self.ll.decode_bytes([token])
            at = self.out.find(self.END_THINK, max(0, self.scanned - len(self.END_THINK) + 1))
            self.scanned = len(self.out)
            if at >= 0:
                self.reasoning = False
                tail = bytes(self.out[at + len(self.END_THINK):]).lstrip()
                if tail:   # the token that closed the reasoning went on: the grammar takes the rest
                    self.held = True
                    m = self.grammar.matcher
                    if not m.consume_tokens(self.ll.tokenize_bytes(tail)) or m.is_error():
                        log.warning("a held reply goes free: the grammar refused what followed </think> (%r)",
                                    tail[:40])
            return
        if not self.held and self.blanks < self.BLANKS and _blank_ids(self.ll)[token]:
            self.blanks += 1
            return
        self.held = True
        self.grammar.advance(token)


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



class LeadingTokens:
    """Test-only Constraint: the reply begins with `ids`, then `inner` (None: nothing) holds it.
    `inner` sees every token, the leading ones included: a test can open a call a random model
    would never open, and the request's own grammar goes on from there."""

    def __init__(self, ids: Sequence[int], eos_ids: Sequence[int], inner: Any):
        self.lead, self.inner = ForcedTokens(ids, eos_ids), inner

    def allowed(self) -> Optional[np.ndarray]:
        if self.lead.at < len(self.lead.ids):
            return self.lead.allowed()
        return self.inner.allowed() if self.inner is not None else None

    def advance(self, token: int) -> None:
        self.lead.advance(token)
        if self.inner is not None:
            self.inner.advance(token)

    def see(self, token: Any) -> None:
        """(the sampler's device-side handoff: the inner constraint's, where it has one)"""
        self.lead.at += 1
        if hasattr(self.inner, "see"):
            self.inner.see(token)
        elif self.inner is not None:
            self.inner.advance(int(token.item()))
