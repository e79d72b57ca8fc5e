"""Which session a prompt continues, and which of its tokens still need feeding.

OpenAI-style clients resend the whole history each turn. A session continues a prompt when
its fed tokens are a strict prefix of the prompt's tokens, or their text is a prefix of the
prompt text (a reply re-tokenized differently). Failing that, the longest common token prefix
is reused: the session is rolled back to it where that is exact (nothing evicted since), or a
new session starts from a checkpoint at or before it. A session a client addresses by id is
never rolled back for another request (that client relies on what it holds). A chat template that renders past
assistant turns differently from its generation prompt (dropped reasoning, an added marker)
still shares everything up to the last reply.

A client that trims old messages to fit its own context window resends the conversation without
them. With `min_chunk` (serve --cache-reuse N) such a prompt continues the session it trims: the
prompt is the session's shared prefix, then runs of at least `min_chunk` of the session's later
tokens, in order and reaching to its latest reply; the session is cut to those spans
(Match.cut, backends/slots.HeapRollback.cut) instead of reading them again. Where a kept reply
re-tokenizes as other tokens, the session's tail from the trim on may still match by text
(_trimmed_text), as a whole history does by _text_prefix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from .session import Session, token_array

Encode = Callable[[str], list[int]]   # text -> ids, no special tokens added
Decode = Callable[[list[int]], str]

# A text match re-tokenizes the same text, so the counts stay close; skip sessions far
# longer than the prompt rather than decode them.
TEXT_MATCH_SLACK = 64
# A session is rolled back only when the common prefix keeps at least this share of what it
# held before its latest reply, so conversations that share only a system prompt do not keep
# rolling each other back.
MIN_SHARED = 0.5


@dataclass
class Prompt:
    """tokens: the full prompt. text: its text (enables text matching). continuation: what
    to feed when it is sent to an explicit session it does not extend (e.g. new turns only).
    after_reply: the same after a reply the session holds as the model wrote it (its end of turn,
    which the model sampled and never read, first). Ids are a list or an int32 array (a long
    prompt's: 4 bytes a token)."""
    tokens: Sequence[int]
    text: Optional[str] = None
    continuation: Optional[Sequence[int]] = None
    after_reply: Optional[Sequence[int]] = None
    # tools a template cannot render, written as text into the system message: the two continuations
    # above take a session that holds `tools_ids` (its first turn's listing, as ids: a run of them, its
    # edges left out, which the listing's place in a message cannot tokenize otherwise); `tools_anew`
    # (continuation, after_reply) writes them into the new messages, for one that does not (tools sent
    # first now, or changed)
    tools_ids: Optional[Sequence[int]] = None
    tools_anew: Optional[tuple] = None


@dataclass
class Match:
    session: Optional[Session]   # None: a new session, from `checkpoint`
    new_tokens: list[int]        # tokens still to feed
    cached: int                  # tokens reused (the session holds them once rolled back / forked)
    rollback: Optional[int] = None   # roll the session back to this many tokens first
    checkpoint: object = None        # Checkpoint to start a new session from
    cut: Optional[list] = None       # keep only these [start, stop) spans of the session first (a trimmed history)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (array('i') or lists)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = _ids(a)[:n], _ids(b)[:n]
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def _ids(seq) -> np.ndarray:
    if hasattr(seq, "typecode"):   # array.array: read in place (a 1M-token history is not copied)
        return np.frombuffer(seq, dtype=np.dtype(seq.typecode)) if len(seq) else np.zeros(0, np.int32)
    return np.asarray(seq, dtype=np.int64)


def holds(fed: np.ndarray, run: Sequence[int]) -> bool:
    """Whether `run` occurs in `fed`, searched in ids (a long session's text is not decoded on the engine
    thread): the places its first id is at, narrowed an id at a time."""
    if not len(run) or len(run) > len(fed):
        return not len(run)
    at = np.flatnonzero(fed[:len(fed) - len(run) + 1] == run[0])
    for k in range(1, len(run)):
        if not at.size:
            return False
        at = at[fed[at + k] == run[k]]
    return bool(at.size)


def _text_prefix(s: Session, prompt: Prompt, decode: Decode) -> Optional[str]:
    """The rest of the prompt text when the session's text is a strict prefix of it."""
    if prompt.text is None or not s.fed or len(s.fed) > 2 * len(prompt.tokens) + TEXT_MATCH_SLACK:
        return None
    text = s.text(decode)
    if len(text) < len(prompt.text) and prompt.text.startswith(text):
        return prompt.text[len(text):]
    return None


def _rollback_point(s: Session, shared: int, prompt_len: int) -> Optional[int]:
    """Where `s` can be rolled back to so that it continues the prompt, or None: anywhere at or above
    its floor, or below that to its mark (a cache with sliding layers: where its reply began)."""
    keep = min(shared, prompt_len - 1)   # at least the prompt's last token is fed again
    before_reply = s.reply_start if s.reply_start is not None else len(s.fed)
    if s.addressed or s.rollback_floor is None:
        return None
    if keep < s.rollback_floor:
        if s.rollback_mark is None or s.rollback_mark > keep:
            return None
        keep = s.rollback_mark
    if keep < 1 or keep < MIN_SHARED * before_reply:
        return None
    return keep


PROBE = 16   # tokens of the prompt looked up in the session at once when finding a trimmed history's runs
RUN_CANDIDATES = 32   # places a run may start that are measured whole (a repetitive history has many)


def occurrences(hay: np.ndarray, want: np.ndarray) -> Iterator[int]:
    """Where `want` occurs in `hay`, in order: its first PROBE tokens compared at once at every place
    its first token is, then each place left checked over all of `want`."""
    n = len(want)
    if n == 0 or len(hay) < n:
        return
    starts = np.flatnonzero(hay[: len(hay) - n + 1] == want[0])
    k = min(PROBE, n)
    if k > 1 and starts.size:
        windows = np.lib.stride_tricks.sliding_window_view(hay, k)[starts]
        starts = starts[(windows == want[:k]).all(axis=1)]
    for j in starts:
        if np.array_equal(hay[j:j + n], want):
            yield int(j)


def trimmed_spans(fed: Sequence[int], ids: Sequence[int], shared: int, min_chunk: int,
                  reach: int, at_reply: bool = False) -> Optional[list[tuple[int, int]]]:
    """The spans of `fed` that, joined, begin `ids` (its first `shared` tokens, then runs of at
    least `min_chunk` tokens found later in `fed`, each after the last, the longest that fits),
    when the last run reaches `reach` (the session's latest reply: a trim keeps the newest
    messages); None otherwise. At least the prompt's last token is left to feed. `at_reply`: a
    last run that ends inside the reply ends at `reach` instead (a sliding layer can come back
    to where the reply began, not to a point inside it)."""
    f, p = _ids(fed), _ids(ids)
    if shared < 1 or min_chunk < 1 or len(p) - shared <= min_chunk:
        return None
    spans, at, frm = [(0, shared)], shared, shared
    while at < len(p) - 1 and frm < len(f):
        hay, want = f[frm:], p[at:at + min_chunk]
        if len(want) < min_chunk:
            break
        # the candidates whose next min_chunk tokens match (each checked over min_chunk tokens only: a
        # repetitive history has many), the first RUN_CANDIDATES of them measured whole: the longest
        # run wins (the earliest of those), not a shorter repeat of its first tokens further back
        found = list(itertools.islice(occurrences(hay, want), RUN_CANDIDATES))
        if not found:
            break
        n, j = max((common_prefix(hay[j:], p[at:]), -j) for j in found)
        start = frm - j
        spans.append((start, start + n))
        at, frm = at + n, start + n
    if at_reply and len(spans) > 1 and reach < spans[-1][1] < len(f):
        a = spans[-1][0]
        if a < reach:
            spans[-1] = (a, reach)
        else:   # a run inside the reply alone: the one before must reach it
            spans.pop()
    held = sum(b - a for a, b in spans)
    if held >= len(p):   # leave the last token to feed
        a, b = spans[-1]
        spans[-1] = (a, b - (held - len(p) + 1))
    if len(spans) < 2 or spans[-1][1] - spans[-1][0] < 1 or spans[-1][1] < reach:
        return None
    return spans


TEXT_CANDIDATES = 4   # places a trimmed history's text match is tried from (each decodes the session's rest)


def _trimmed_text(s: Session, prompt: Prompt, shared: int, min_chunk: int, encode: Encode,
                  decode: Decode) -> Optional[tuple[list[tuple[int, int]], list[int]]]:
    """A trimmed history whose kept replies re-tokenize as other tokens (a reply sampled as tokens
    the tokenizer would not choose for its text), as _text_prefix matches an untrimmed one: the
    session's tokens from some point b on (where at least `min_chunk` of the prompt's tokens after
    the shared prefix begin) decode to text that begins the rest of the prompt's text. Returns the
    spans [(0, shared), (b, end)] and the rest of the prompt's text encoded; None otherwise."""
    f, p = _ids(s.fed), _ids(prompt.tokens)
    if prompt.text is None or len(p) - shared <= min_chunk or len(f) > 2 * len(p) + TEXT_MATCH_SLACK:
        return None
    head = decode(f[:shared].tolist())
    if not prompt.text.startswith(head):
        return None
    rest, want = prompt.text[len(head):], p[shared:shared + min_chunk]
    hay = f[shared + 1:]
    if len(hay) < min_chunk:
        return None
    for tried, j in enumerate(occurrences(hay, want), 1):
        b = shared + 1 + j
        tail = decode(f[b:].tolist())
        if len(tail) < len(rest) and rest.startswith(tail):
            new = encode(rest[len(tail):])
            return ([(0, shared), (b, len(f))], new) if new else None
        if tried == TEXT_CANDIDATES:
            break
    return None


def match_session(sessions: Iterable[Session], prompt: Prompt, encode: Encode, decode: Decode,
                  checkpoints: Iterable = (), min_chunk: int = 0) -> Optional[Match]:
    """The idle session (or checkpoint) that continues `prompt` with the most reused tokens.

    Ties go to the cheapest: a session that needs nothing undone, then a rollback or a cut, then
    a checkpoint (loaded from disk into a new session). `min_chunk` > 0: a session may be cut to
    the prompt's trimmed history (trimmed_spans)."""
    ids = prompt.tokens   # a list or an int32 array: common_prefix takes both
    best: Optional[tuple[tuple[int, int], Match]] = None

    def offer(m: Match, rank: int) -> None:
        nonlocal best
        if m.new_tokens and (best is None or (m.cached, rank) > best[0]):
            best = ((m.cached, rank), m)

    for s in sessions:
        if s.busy or not s.fed:
            continue
        shared = common_prefix(s.fed, ids)
        if shared == len(s.fed) < len(ids):
            offer(Match(s, prompt.tokens[shared:], shared), 2)
            continue
        rest = _text_prefix(s, prompt, decode)
        if rest is not None:
            offer(Match(s, encode(rest), len(s.fed)), 2)
        keep = _rollback_point(s, shared, len(ids))
        if keep is not None:
            offer(Match(s, prompt.tokens[keep:], keep, rollback=keep), 1)
        if min_chunk and s.cuttable and not s.addressed and shared < len(s.fed):
            reach = min(len(s.fed), s.reply_start if s.reply_start is not None else len(s.fed))
            spans = trimmed_spans(s.fed, ids, shared, min_chunk, reach, s.cut_at_reply)
            if spans is not None:
                held = sum(b - a for a, b in spans)
                offer(Match(s, prompt.tokens[held:], held, cut=spans), 1)
            else:
                trimmed = _trimmed_text(s, prompt, shared, min_chunk, encode, decode)
                if trimmed is not None:
                    spans, rest = trimmed
                    offer(Match(s, rest, sum(b - a for a, b in spans), cut=spans), 1)
    for c in checkpoints:
        if c.n < len(ids) and common_prefix(c.tokens, ids) == c.n:
            offer(Match(None, prompt.tokens[c.n:], c.n, checkpoint=c), 0)
    return best[1] if best is not None else None


def continue_session(s: Session, prompt: Prompt, encode: Encode, decode: Decode) -> Match:
    """Feed `prompt` into an explicitly named session: the unseen rest of a resent history,
    else the prompt's continuation (new turns appended to whatever the session holds).
    Explicit sessions are never rolled back: fork them from a checkpoint instead."""
    if not s.fed:
        return Match(s, prompt.tokens[:], 0)
    if common_prefix(s.fed, prompt.tokens) == len(s.fed) < len(prompt.tokens):
        return Match(s, prompt.tokens[len(s.fed):], len(s.fed))
    rest = _text_prefix(s, prompt, decode)
    if rest is not None and (new := encode(rest)):
        return Match(s, new, len(s.fed))
    cont, after = prompt.continuation, prompt.after_reply
    if prompt.tools_ids is not None and not holds(_ids(s.fed), prompt.tools_ids):
        cont, after = prompt.tools_anew
    if after is not None and s.ends_in_reply:
        # it ends in a reply: that turn closed first (the web UI's, chat's next turn); where the reply's end of
        # turn is in the session already (sampled on a step run ahead, a reply decoding alone), not again
        cont = after
        if not s.unfed_reply and len(s.fed) and len(cont) and s.fed[-1] == cont[0]:
            cont = cont[1:]
    # after the reply's last tokens where max_tokens or a stop cut it once they were sampled (the client
    # has them, the cache not): a chat's end of turn, or a completion's text sent on from where it ended
    new = (cont if cont is not None else prompt.tokens)[:]
    return Match(s, token_array(s.unfed_reply) + token_array(new) if s.unfed_reply else new, len(s.fed))
