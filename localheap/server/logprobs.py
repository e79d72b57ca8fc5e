"""OpenAI's logprobs in a reply: the engine's TokenLogprob entries (ids and log probabilities) as
chat's `logprobs.content` and the legacy completions' `logprobs` object, with each token's text
and bytes as the tokenizer writes them."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from ..generation import TokenLogprob

_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte is written as one printable character, the
    printable Latin-1 bytes as themselves and the others as the characters from U+0100 on, in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TokenText:
    """Each id's (text, UTF-8 bytes) as a reply's logprobs give them: the bytes the token stands for
    (byte-level BPE: its characters mapped back to bytes; SentencePiece: `▁` a space, `<0xNN>` that
    byte), the text those bytes decode to (a token that ends inside a character has U+FFFD there),
    so that the tokens' texts joined give the reply's text. Cached per id."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._table = _byte_level_table() if self.byte_level else {}
        self._specials = set(getattr(tokenizer, "all_special_ids", []) or [])

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            got = self._cache[token] = self._lookup(token)
        return got

    def _lookup(self, token: int) -> tuple[str, list[int]]:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token)
        except Exception:   # noqa: BLE001 - an id past the tokenizer's vocabulary (a padded head)
            piece = None
        if piece is None:
            return "", []
        if token in self._specials:
            data = piece.encode()
        elif self.byte_level and all(c in self._table for c in piece):
            data = bytes(self._table[c] for c in piece)
        elif (m := _SP_BYTE.fullmatch(piece)) is not None:
            data = bytes([int(m.group(1), 16)])
        else:
            data = piece.replace("\u2581", " ").encode()
        return data.decode("utf-8", errors="replace"), list(data)


def finite(x: float) -> float:
    """JSON has no infinities: an impossible id's log probability is written as -9999.0 (OpenAI's floor)."""
    return x if math.isfinite(x) else -9999.0


def chat_content(text_of: TokenText, entries: list[TokenLogprob], post: bool = False) -> list[dict]:
    """`logprobs.content` of a chat reply (or of one stream chunk); `post` (llama-server's
    post_sampling_probs: entries of the distribution drawn from) as llama-server writes those:
    id, token, bytes, prob and top_probs."""
    out = []
    for e in entries:
        token, data = text_of(e.token)
        top = []
        for i, lp in e.top:
            t, b = text_of(i)
            top.append({"id": i, "token": t, "bytes": b, "prob": math.exp(lp)} if post else
                       {"token": t, "logprob": finite(lp), "bytes": b})
        out.append({"id": e.token, "token": token, "bytes": data, "prob": math.exp(e.logprob), "top_probs": top}
                   if post else {"token": token, "logprob": finite(e.logprob), "bytes": data, "top_logprobs": top})
    return out


def chat_logprobs(text_of: TokenText, entries: Optional[list[TokenLogprob]], post: bool = False) -> Optional[dict]:
    return None if entries is None else {"content": chat_content(text_of, entries, post), "refusal": None}


def completion_logprobs(text_of: TokenText, entries: Optional[list[TokenLogprob]], offset: int = 0) -> Optional[dict]:
    """The legacy completions' `logprobs`: tokens, their logprobs, each position's top ids (the
    sampled one always among them: up to logprobs + 1, as OpenAI's) and each token's offset in the
    text, counted from `offset` (a stream chunk's: the characters sent before it)."""
    if entries is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text, _ = text_of(e.token)
        tokens.append(legacy_key(text_of, e.token))
        values.append(finite(e.logprob))
        top = {legacy_key(text_of, i): finite(lp) for i, lp in e.top}
        top[tokens[-1]] = finite(e.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def legacy_key(text_of: TokenText, token: int) -> str:
    """A token as the legacy logprobs name it: its text, or where its bytes are not whole UTF-8 (part
    of a character: its text is U+FFFD, which several such tokens share) "bytes:\\xNN...", as
    OpenAI's, so that each id has a key of its own in top_logprobs."""
    text, data = text_of(token)
    if "\ufffd" in text:
        try:
            bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    return text


def echo_logprobs(text_of: TokenText, tokens: list[int], entries: list[TokenLogprob], hidden: int = 0) -> dict:
    """The legacy `logprobs` of an echoed prompt: every prompt token, the first with none (null,
    as OpenAI's: nothing came before it), each other one with its entry (Run.scored: the model's
    log-probability of it after the tokens before it, as the prefill read them). Offsets count the
    tokens' texts; the first `hidden` (special tokens the server put before a text prompt, a BOS:
    not in the echoed text) take no room."""
    rest = completion_logprobs(text_of, entries)
    texts = [text_of(tokens[0])[0]] + rest["tokens"]
    offsets, at = [], 0
    for i, text in enumerate(texts):
        offsets.append(at)
        at += len(text) if i >= hidden else 0
    return {"tokens": texts, "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": offsets}


def joined(parts: list[Optional[dict]]) -> Optional[dict]:
    """Legacy `logprobs` objects one after the other as one (an echo's, then the reply's)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return {key: [x for p in parts for x in p[key]] for key in parts[0]}
