"""Tokenization bounded by the prompt-token limit: a text too long for it is refused before it
is tokenized whole, and a long text is tokenized in pieces, so a request never holds more
than the limit's worth of token ids plus one piece's transient (a Hugging Face fast tokenizer
needs ~530 bytes a token while it works: 5 GiB for a 30 MB message tokenized in one call).

Pieces are cut before a space between two words, and a cut is used only when the tokenizer
gives the same ids across it as without it (checked on a window around the cut), so the ids
are those of one call. Only a text with no such gap in 64K characters, or a tokenizer that
marks the start of every call (SentencePiece's legacy prefix), is cut where it stands: its
ids may differ at the cut; memory stays bounded. Knows the tokenizer, never a tensor.
"""

from __future__ import annotations

import ctypes
import gc
import re
from array import array
from typing import Any, Optional

from ..sessions.session import token_array

from .errors import InvalidUnicode, PromptTooLong

PIECE_CHARS = 1 << 16      # ~16K tokens a piece: ~10 MB of tokenizer transient at a time
WINDOW_CHARS = 48          # context checked on each side of a cut
CUT_TRIES = 8              # candidate cuts tried before a piece is extended
NORMALIZER_SLACK = 2       # a normalizer (NFC) may fold two characters into one


def release_freed_memory() -> None:
    """Give the memory a large request freed back to the system (glibc keeps it otherwise,
    and RSS would stay high long after the request). No-op where there is no malloc_trim."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        gc.collect()
        _TRIM(0)


_TRIM: Any = None


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, param: Optional[str]) -> str:
    r"""JSON may carry lone surrogates ("\ud800") that no tokenizer encodes: 400, not 500.
    A search, not an encode: no copy of a large document."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise InvalidUnicode(f"{param or 'the request'} holds invalid unicode (a lone surrogate, "
                         f"\\u{ord(bad.group()):04x}, at character {bad.start()})", param)
    return text


# a surrogate's JSON escape, or its three UTF-8 bytes (which Python's JSON reader takes too); each
# search starts at a literal byte, so it runs at memchr's pace (25 ms for a 16 MB body)
_MAYBE_SURROGATE = (re.compile(rb"\\u[dD][89a-fA-F]"), re.compile(rb"\xed[\xa0-\xbf]"))


def may_hold_surrogates(body: bytes) -> bool:
    """Whether a JSON body may hold a lone surrogate ("\\ud800": JSON allows it, no tokenizer encodes
    it, no UTF-8 file holds it). A pair (an emoji as ensure_ascii writes it) passes here too: then
    check_surrogates on the parsed body tells."""
    return any(rx.search(body) for rx in _MAYBE_SURROGATE)


def check_surrogates(value: Any) -> None:
    """InvalidUnicode naming the field (messages.0.name) of a parsed JSON body that holds a lone
    surrogate, whichever field it is."""
    where = surrogate_path(value, "")
    if where is not None:
        raise InvalidUnicode(f"{where or 'the request body'} holds invalid unicode (a lone surrogate: JSON's "
                             f"\\ud800-\\udfff escapes come in pairs)", where or None)


def surrogate_path(value: Any, path: str) -> Optional[str]:
    """The dotted path (tools.0.function.description) of the first string in `value` (dicts,
    lists, strings) that holds a lone surrogate; None where none does."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):   # (named as an escape: the error is UTF-8 too)
            key = key.encode("utf-8", "backslashreplace").decode()
            return f"{path}.{key}" if path else key
        found = surrogate_path(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def encode_plain(tokenizer: Any, text: str, param: Optional[str] = None, specials: bool = True) -> list[int]:
    """The ids of `text`, no special tokens added; a special token's text read as that token, or with
    `specials` False as text (llama-server's parse_special false)."""
    try:
        if not specials:
            text_only = _text_only(tokenizer)
            if text_only is not None:
                return list(text_only.encode(text, add_special_tokens=False).ids)
            return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        return list(tokenizer.encode(text, add_special_tokens=False))
    except (TypeError, UnicodeEncodeError):   # (what the tokenizers library raises on a lone surrogate)
        check_unicode(text, param)
        raise


def _text_only(tokenizer: Any) -> Any:
    """A copy of the tokenizer's Rust tokenizer (the `tokenizers` library's) that reads a special
    token's text as text; cached on the tokenizer; None where it has none. Its own copy: asked for
    split_special_tokens, transformers sets that on the one Rust tokenizer every thread encodes
    with, and leaves it until another call sets it back, so a chat prompt tokenized meanwhile on
    another thread lost its template's special tokens (and the other way round)."""
    cached = getattr(tokenizer, "_localheap_text_only", False)
    if cached is not False:
        return cached
    from tokenizers import Tokenizer

    from ..grammar import GrammarError, rust_tokenizer

    try:
        copy = Tokenizer.from_str(rust_tokenizer(tokenizer).to_str())
        copy.encode_special_tokens = True
    except GrammarError:   # (no fast tokenizer)
        copy = None
    try:
        tokenizer._localheap_text_only = copy
    except AttributeError:
        pass
    return copy


def special_head(tokenizer: Any) -> Optional[list[int]]:
    """The special tokens the tokenizer puts before a text (a BOS; [] for none); None where it adds
    some elsewhere too (after the text): then a text's ids with them take a call of their own."""
    probe = list(tokenizer.encode("a", add_special_tokens=True))
    plain = encode_plain(tokenizer, "a")
    n = len(probe) - len(plain)
    return probe[:n] if n >= 0 and probe[n:] == plain else None


def leading_specials(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text (a BOS), [] where it puts none there."""
    return special_head(tokenizer) or []


def longest_token_chars(tokenizer: Any) -> int:
    """Characters one token can cover at most (its vocabulary string: byte-level tokens have
    a character a byte), cached on the tokenizer; 0 when the tokenizer cannot say."""
    cached = getattr(tokenizer, "_localheap_longest", None)
    if cached is None:
        try:
            vocab = tokenizer.get_vocab()
            cached = max((len(t) for t in vocab), default=0)
        except Exception:   # a tokenizer without get_vocab: no quick refusal, pieces still bound it
            cached = 0
        try:
            tokenizer._localheap_longest = cached
        except AttributeError:
            pass
    return cached


def check_chars(tokenizer: Any, chars: int, limit: Optional[int], param: str) -> None:
    """Refuse at once a text that cannot fit: it has more than `limit` tokens for sure."""
    longest = longest_token_chars(tokenizer)
    if limit is not None and longest > 0:
        at_least = chars // (longest * NORMALIZER_SLACK)
        if at_least > limit:
            raise PromptTooLong(limit, at_least, param)


def encode_bounded(tokenizer: Any, text: str, limit: Optional[int], param: str = "messages",
                   specials: bool = True) -> array:
    """The ids of `text` (no special tokens added; `specials`: encode_plain's) as int32s (4 bytes a
    token, where a list holds 40), raising PromptTooLong past `limit`."""
    check_chars(tokenizer, len(text), limit, param)
    ids = token_array()
    start = 0
    while start < len(text):
        end = _cut(tokenizer, text, start + PIECE_CHARS) if len(text) - start > PIECE_CHARS else len(text)
        ids.extend(encode_plain(tokenizer, text[start:end], param, specials))
        if limit is not None and len(ids) > limit:
            raise PromptTooLong(limit, len(ids), param)
        start = end
    return ids


def _cut(tokenizer: Any, text: str, at: int) -> int:
    """Where the piece starting before `at` ends: the first gap between two words at or after
    `at` (within a piece's length) across which the tokenizer gives the same ids in two calls
    as in one; failing that, `at` itself (a text with no such gap, e.g. 100K characters
    without a space, or a tokenizer that marks the start of every call: ids may differ
    there, memory stays bounded)."""
    pos, tries = at, 0
    while tries < CUT_TRIES:
        pos = _next_word_gap(text, pos, limit=at + PIECE_CHARS)
        if pos is None:
            break
        if _clean_cut(tokenizer, text, pos):
            return pos
        pos, tries = pos + 1, tries + 1
    return at


def _clean_cut(tokenizer: Any, text: str, pos: int) -> bool:
    lo, hi = max(0, pos - WINDOW_CHARS), min(len(text), pos + WINDOW_CHARS)
    return encode_plain(tokenizer, text[lo:hi]) == encode_plain(tokenizer, text[lo:pos]) + encode_plain(tokenizer, text[pos:hi])


def _next_word_gap(text: str, pos: int, limit: int) -> Optional[int]:
    """The first position in [pos, limit) holding a single space between two letters or digits."""
    while True:
        pos = text.find(" ", pos, limit)
        if pos < 0:
            return None
        if 0 < pos < len(text) - 1 and text[pos - 1].isalnum() and text[pos + 1].isalnum():
            return pos
        pos += 1
