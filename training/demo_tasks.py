"""Training rows for the demo model: pass key (v1), named facts (v2), copy, repeat, text.

Every row is (ids [T], answer mask [T], position ids [T]); a batch depends only on (seed, step),
so a run is reproducible and resumable, and batches can be built in worker processes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from localheap.bench.facts import ANSWER_OF, QUESTION_OF, Frames, build_facts_episode, names  # noqa: E402
from localheap.bench.needle import Filler, build_episode, encode, frame, make_key  # noqa: E402
from localheap.randmodel import BOS, EOS, SPECIAL_TOKENS  # noqa: E402

KINDS = ("passkey", "facts", "copy", "repeat", "text")


def full_mix(mix) -> tuple:
    """v1's 4-way mix (passkey, copy, repeat, text) as the 5-way one (no facts rows). The same
    uniform draw picks the same kind either way, so v1's recipe keeps its random stream."""
    return (mix[0], 0.0, *mix[1:]) if len(mix) == 4 else tuple(mix)


class Tasks:
    """Builds training rows from the training filler (digit-free, and as written) and names."""

    def __init__(self, tok, filler: Filler, digit_filler: Filler | None = None, pool=None):
        self.tok, self.filler, self.digit_filler = tok, filler, digit_filler or filler
        self.frame, self.frames = frame(tok), Frames(tok)
        self.pool = tuple(pool or names(held_out=False))
        self.bos, self.eos = tok.convert_tokens_to_ids(BOS), tok.convert_tokens_to_ids(EOS)
        self.user, self.asst = encode(tok, "<|user|>\n"), encode(tok, "<|assistant|>\n")
        self.end = encode(tok, "<|end|>\n")
        self.repeat_prompt = encode(tok, "Repeat after me: ")
        self.vocab = len(tok)

    def _answer(self, tokens, key):
        answer = encode(self.tok, f" {key}.") + self.end
        return tokens + answer, [0] * len(tokens) + [1] * (len(answer) - 1) + [0]

    def passkey(self, rng, T, fill=None):
        key = make_key(rng)
        ep = build_episode(self.tok, fill or self.filler, self.frame, T - 8, float(rng.random()), key, rng)
        return self._answer(ep.tokens, key)

    def facts(self, rng, T, keys: int, fill=None, questions: int = 1):
        """K facts, then the question about one of them; with questions > 1, follow-up turns ask
        about other facts of the same context (more answers per row: the names must be told apart)."""
        questions = min(questions, keys)
        ep = build_facts_episode(self.tok, fill or self.filler, self.frames, T - 8 - 40 * (questions - 1), keys,
                                 float(rng.random()), rng, self.pool)
        ids, mask = self._answer(ep.tokens, ep.key)
        others = [ep.facts[i] for i in rng.permutation(len(ep.facts)) if ep.facts[i][0] != ep.name]
        for name, key, _ in others[:questions - 1]:
            turn = encode(self.tok, f"<|user|>\n{QUESTION_OF.format(name=name)}<|end|>\n<|assistant|>\n"
                                    f"{ANSWER_OF.format(name=name)}")
            more, more_mask = self._answer(turn, key)
            ids, mask = ids + more, mask + more_mask
        return ids, mask

    def window(self, rng, n):
        f = self.filler.tokens
        s = int(rng.integers(0, len(f) - n))
        return f[s:s + n].tolist()

    def span(self, rng):
        """What to repeat: natural text, random tokens (pure induction) or a 5-digit key."""
        kind = rng.integers(3)
        if kind == 0:
            return self.window(rng, int(rng.integers(8, 64)))
        if kind == 1:
            return rng.integers(len(SPECIAL_TOKENS), self.vocab, int(rng.integers(4, 32))).tolist()
        return encode(self.tok, make_key(rng))

    def copy(self, rng, T):
        ids, mask = [], []
        while len(ids) < T:
            span = self.span(rng)
            q = [self.bos, *self.user, *self.repeat_prompt, *span, *self.end, *self.asst]
            ids += q + span + self.end
            mask += [0] * len(q) + [1] * (len(span) + 1) + [0] * (len(self.end) - 1)
        return ids, mask

    def repeat(self, rng, T):
        """Random tokens, repeated to fill the row: every repeat is pure induction."""
        n = int(rng.integers(4, max(8, min(64, T // 3))))
        chunk = rng.integers(len(SPECIAL_TOKENS), self.vocab, n).tolist()
        ids = [self.bos] + chunk * (T // n + 1)
        return ids, [0] * (n + 1) + [1] * (len(ids) - n - 1)

    def text(self, rng, T):
        return [self.bos, *self.window(rng, T)], [0] * (T + 1)

    def row(self, rng, T, mix, gap_share, max_keys: int = 0, digit_share: float = 0.0, questions: int = 1):
        kind = KINDS[rng.choice(5, p=full_mix(mix))]
        if kind in ("passkey", "facts"):
            fill = self.digit_filler if digit_share and rng.random() < digit_share else None
            if kind == "passkey":
                ids, mask = self.passkey(rng, T, fill)
            else:   # K uniform in 1..max_keys (bounded by what fits: a fact is ~16 tokens)
                ids, mask = self.facts(rng, T, 1 + int(rng.integers(min(max_keys, T // 40))), fill, questions)
        else:
            ids, mask = getattr(self, kind)(rng, T)
        ids, mask = ids[:T], mask[:T]
        pad = T - len(ids)
        ids, mask = ids + [self.eos] * pad, mask + [0] * pad
        pos = np.arange(T)
        if kind in ("passkey", "facts") and rng.random() < gap_share:
            # PoSE-style jump: later tokens sit up to 60K positions further on
            pos = pos + (pos >= int(rng.integers(8, T - 16))) * int(math.exp(rng.uniform(0, math.log(60000))))
        return ids, mask, pos


def batch_arrays(tasks: Tasks, seed: int, step: int, phase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of one step: phase = (T, B, steps, mix, gap_share[, max_keys, digit_share[, questions]])."""
    T, B, _, mix, gap, *rest = phase
    max_keys, digit_share, questions = (list(rest) + [0, 0.0, 1][len(rest):])[:3]
    rng = np.random.default_rng([seed, step])
    rows = [tasks.row(rng, T, mix, gap, max_keys, digit_share, questions) for _ in range(B)]
    return (np.array([r[0] for r in rows]), np.array([r[1] for r in rows], dtype=bool),
            np.stack([r[2] for r in rows]))


_WORKER: dict = {}


def _init_worker(tasks):
    _WORKER["tasks"] = tasks


def _work(job):
    seed, step, phase = job
    return step, batch_arrays(_WORKER["tasks"], seed, step, phase)


def batches(tasks: Tasks, seed: int, jobs, workers: int):
    """Yield (step, arrays) for jobs [(step, phase)] in order; built ahead in `workers` processes."""
    if workers <= 1:
        for step, phase in jobs:
            yield step, batch_arrays(tasks, seed, step, phase)
        return
    import multiprocessing as mp

    with mp.get_context("fork").Pool(workers, _init_worker, (tasks,)) as pool:
        yield from pool.imap(_work, ((seed, step, phase) for step, phase in jobs), chunksize=2)
