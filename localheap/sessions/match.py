"""Which session a prompt continues, and which of its tokens still need feeding.

OpenAI-style clients resend the whole history each turn. A session continues a prompt when
its fed tokens are a strict prefix of the prompt's tokens; failing that, when the fed tokens'
text is a prefix of the prompt text (a reply re-tokenized differently still matches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from .session import Session, token_array

Encode = Callable[[str], list[int]]   # text -> ids, no special tokens added
Decode = Callable[[list[int]], str]

# A text match re-tokenizes the same text, so the counts stay close; skip sessions far
# longer than the prompt rather than decode them.
TEXT_MATCH_SLACK = 64


@dataclass
class Prompt:
    """tokens: the full prompt. text: its text (enables text matching). continuation: what
    to feed when it is sent to an explicit session it does not extend (e.g. new turns only).
    Ids are a list or an int32 array (a long prompt's: 4 bytes a token)."""
    tokens: Sequence[int]
    text: Optional[str] = None
    continuation: Optional[Sequence[int]] = None


@dataclass
class Match:
    session: Session
    new_tokens: list[int]   # tokens still to feed
    cached: int             # tokens reused from the session


def _token_prefix(s: Session, prompt_ids) -> bool:
    n = len(s.fed)
    return 0 < n < len(prompt_ids) and prompt_ids[:n] == s.fed


def _text_prefix(s: Session, prompt: Prompt, decode: Decode) -> Optional[str]:
    """The rest of the prompt text when the session's text is a strict prefix of it."""
    if prompt.text is None or not s.fed or len(s.fed) > 2 * len(prompt.tokens) + TEXT_MATCH_SLACK:
        return None
    text = s.text(decode)
    if len(text) < len(prompt.text) and prompt.text.startswith(text):
        return prompt.text[len(text):]
    return None


def match_session(sessions: Iterable[Session], prompt: Prompt, encode: Encode, decode: Decode) -> Optional[Match]:
    """The idle session that continues `prompt` with the most reused tokens, or None."""
    candidates = [s for s in sessions if not s.busy and s.fed]
    ids = token_array(prompt.tokens)
    by_tokens = [s for s in candidates if _token_prefix(s, ids)]
    if by_tokens:
        best = max(by_tokens, key=lambda s: len(s.fed))
        return Match(best, prompt.tokens[len(best.fed):], len(best.fed))
    best_rest: Optional[tuple[Session, str]] = None
    for s in candidates:
        rest = _text_prefix(s, prompt, decode)
        if rest is not None and (best_rest is None or len(s.fed) > len(best_rest[0].fed)):
            best_rest = (s, rest)
    if best_rest is None:
        return None
    s, rest = best_rest
    new = encode(rest)
    return Match(s, new, len(s.fed)) if new else None


def continue_session(s: Session, prompt: Prompt, encode: Encode, decode: Decode) -> Match:
    """Feed `prompt` into an explicitly named session: the unseen rest of a resent history,
    else the prompt's continuation (new turns appended to whatever the session holds)."""
    if not s.fed:
        return Match(s, prompt.tokens[:], 0)
    if _token_prefix(s, token_array(prompt.tokens)):
        return Match(s, prompt.tokens[len(s.fed):], len(s.fed))
    rest = _text_prefix(s, prompt, decode)
    if rest is not None and (new := encode(rest)):
        return Match(s, new, len(s.fed))
    return Match(s, (prompt.continuation if prompt.continuation is not None else prompt.tokens)[:], len(s.fed))
