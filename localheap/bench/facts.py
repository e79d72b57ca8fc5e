"""Named multi-key episodes: K facts " The pass key of <name> is <key>." in filler, one asked about.

The episode generator shared by the demo model's training (training/train_demo.py) and
`localheap bench needle --keys K`, so the bench asks exactly what the model was taught.
Names come from a fixed list split into a training set and a held-out set (crc32 of the name);
filler comes from text shipped with CPython, split the same way by document (crc32), so an
evaluation can use names and text that training never saw. Numpy only: knows no tensors.
"""

from __future__ import annotations

import ast
import sysconfig
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .needle import Episode, Filler, Frame, _hf, encode, filler_from_texts, frame, make_key

FACT = " The pass key of {name} is {key}."
QUESTION_OF = "What is the pass key of {name}?"
ANSWER_OF = "The pass key of {name} is"

# Plain lowercase words (2-5 tokens each with the demo tokenizer): names share sub-word tokens,
# as real names do, so the model has to match the whole name, not one token.
NAMES = tuple("""
river amber falcon cedar maple willow harbor meadow canyon ember frost glacier hazel indigo jasper
juniper lotus marble nectar onyx orchid pebble quartz raven sable sierra tundra velvet walnut zephyr
aspen birch clover coral dune fern garnet heron iris ivy lark lilac lynx mango mesa mint moss oak
olive opal otter pine plum poppy reef robin rose ruby sage slate sparrow spruce stone storm sunset
thistle tiger topaz tulip violet wren yarrow badger beacon comet delta echo flint grove hollow island
lagoon lantern marsh nova orbit prairie ridge summit thunder valley wolf acorn basil cobalt copper
crimson dahlia ebony fable granite honey ink jade kestrel lemon lumen magnet nimbus ocean panda
pepper quill rain saffron tango umber vapor winter yellow zinc apple berry candle dragon eagle forest
garden hammer ice jungle kite lemur mirror north pearl silver bramble cricket dolphin ferret gecko
hornet jackal koala llama marten newt osprey puffin quail salmon trout urchin viper walrus yak zebra
anchor bridge castle cellar chapel harp kettle ladder needle paddle saddle tower wagon whistle
""".split())


def held_out_name(name: str) -> bool:
    """About a fifth of the names (crc32 % 5 == 0) never appear in training."""
    return zlib.crc32(name.encode()) % 5 == 0


def names(held_out: bool) -> tuple[str, ...]:
    return tuple(n for n in NAMES if held_out_name(n) == held_out)


# ---------------------------------------------------------------- text

@lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """pydoc help topics + stdlib docstrings of >= 300 chars: English prose shipped with CPython (PSF)."""
    from pydoc_data import topics

    texts = [topics.topics[k] for k in sorted(topics.topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip"}
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 300:
                    texts.append(doc)
    return tuple(texts)


def split(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(train, held-out): held out = documents whose crc32 is 0 mod 10 (stable across runs and
    Python versions: a document is held out wherever it appears)."""
    held = [t for t in texts if zlib.crc32(t.encode()) % 10 == 0]
    train = [t for t in texts if zlib.crc32(t.encode()) % 10 != 0]
    return train, held


FILLERS = ("pydoc", "heldout", "digits", "licenses", "man", "comments",
           "licenses+digits", "man+digits", "comments+digits")


@lru_cache(maxsize=8)
def filler(tokenizer, kind: str = "heldout") -> Filler:
    """The bench's filler. pydoc: all pydoc help topics, digits removed (the v1 table's filler);
    heldout: the held-out documents, digits removed (the key is the only number);
    digits: the held-out documents as written, numbers included (a key is not the only number);
    licenses, man, comments: text training never saw (bench/sources.py), digits removed, or kept
    with "+digits"."""
    from .needle import pydoc_filler
    from .sources import texts

    if kind not in FILLERS:
        raise ValueError(f"unknown filler {kind!r}; one of {', '.join(FILLERS)}")
    if kind == "pydoc":
        return pydoc_filler(tokenizer)
    if kind in ("heldout", "digits"):
        return filler_from_texts(tokenizer, split(corpus())[1], keep_digits=kind == "digits")
    source, _, digits = kind.partition("+")
    return filler_from_texts(tokenizer, texts(source), keep_digits=bool(digits))


# ---------------------------------------------------------------- episodes

@dataclass
class FactsEpisode(Episode):
    """An Episode (key = the asked fact's key, depth/needle_* = the asked fact) plus every fact."""

    name: str = ""
    facts: list = field(default_factory=list)   # [(name, key, start index in tokens)], in context order
    follow_ups: list = field(default_factory=list)   # later questions of a multi-turn episode: facts entries


class Frames:
    """Chat frames per asked name (the question and answer prefix name it), built once each."""

    def __init__(self, tokenizer):
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, name: str) -> Frame:
        if name not in self._cache:
            self._cache[name] = frame(self.tokenizer, QUESTION_OF.format(name=name), ANSWER_OF.format(name=name))
        return self._cache[name]


def _boundaries(fill: Filler, start: int, n_fill: int) -> np.ndarray:
    n = len(fill.tokens)
    rel = (fill.boundaries - start) % n
    return np.unique(rel[(rel > 0) & (rel < n_fill)])


PLACEMENTS = ("uniform", "cluster", "start", "end")
CLUSTER = 0.05   # placement "cluster": every fact inside one region of this fraction of the filler


def _cuts(placement: str, bounds: np.ndarray, n_fill: int, keys: int, depth: float,
          rng: np.random.Generator) -> list[int]:
    """Where the facts go (offsets into the filler window; the asked fact first).
    uniform: the asked fact at the sentence end nearest `depth`, the others at random sentence ends;
    cluster: all at sentence ends inside one CLUSTER-wide region starting at depth * (1 - CLUSTER);
    start: all right after the frame's head (the sinks), back to back; end: all right before the
    question (inside the recent window), back to back."""
    if placement == "start":
        return [0] * keys
    if placement == "end":
        return [n_fill] * keys
    if placement == "cluster":
        lo = int(depth * (1 - CLUSTER) * n_fill)
        hi = lo + max(1, int(CLUSTER * n_fill))
        inside = bounds[(bounds >= lo) & (bounds < hi)]
        if len(inside) >= keys:
            return rng.choice(inside, keys, replace=False).tolist()
        return rng.integers(lo, min(hi, n_fill) + 1, keys).tolist()
    if placement != "uniform":
        raise ValueError(f"unknown placement {placement!r}; one of {', '.join(PLACEMENTS)}")
    target = depth * n_fill
    if len(bounds) and abs(bounds[np.argmin(np.abs(bounds - target))] - target) < 64:
        asked = int(bounds[np.argmin(np.abs(bounds - target))])
    else:
        asked = int(round(target))
    others = bounds[bounds != asked]
    if len(others) >= keys - 1:
        rest = rng.choice(others, keys - 1, replace=False).tolist()
    else:   # too few sentence ends (tiny contexts): anywhere
        rest = rng.integers(0, n_fill + 1, keys - 1).tolist()
    return [min(max(asked, 0), n_fill), *map(int, rest)]


def build_facts_episode(tokenizer, fill: Filler, frames: Frames, context: int, keys: int, depth: float,
                        rng: np.random.Generator, pool: Sequence[str], placement: str = "uniform") -> FactsEpisode:
    """`context` tokens: `keys` facts with distinct names (from `pool`) and distinct keys in a
    filler window (random offset), placed as `placement` says (_cuts; uniform: the asked fact,
    the first name drawn, at the sentence end nearest `depth`, the others at random sentence
    ends); the question names the asked fact. Facts at one cut are in random order."""
    if keys < 1 or keys > len(pool):
        raise ValueError(f"keys must be in 1..{len(pool)}")
    chosen = [pool[i] for i in rng.choice(len(pool), keys, replace=False)]
    codes: list[str] = []
    while len(codes) < keys:
        k = make_key(rng)
        if k not in codes:
            codes.append(k)
    fr = frames(chosen[0])
    facts = [encode(tokenizer, FACT.format(name=n, key=k)) for n, k in zip(chosen, codes)]
    n_fill = context - len(fr.head) - len(fr.tail) - sum(map(len, facts))
    if n_fill < keys:
        raise ValueError(f"context {context} too short for {keys} facts")
    n = len(fill.tokens)
    start = int(rng.integers(0, n))
    window = fill.tokens[(start + np.arange(n_fill)) % n].tolist()
    cuts = [int(c) for c in _cuts(placement, _boundaries(fill, start, n_fill), n_fill, keys, depth, rng)]
    tie = list(range(keys)) if placement == "uniform" else rng.permutation(keys).tolist()
    order = sorted(range(keys), key=lambda i: (cuts[i], tie[i]))
    tokens, placed, prev = list(fr.head), [], 0
    for i in order:
        tokens += window[prev:cuts[i]]
        placed.append((chosen[i], codes[i], len(tokens)))
        tokens += facts[i]
        prev = cuts[i]
    tokens += window[prev:] + list(fr.tail)
    assert len(tokens) == context
    at = next(p for p in placed if p[0] == chosen[0])[2]
    return FactsEpisode(tokens, codes[0], cuts[0] / n_fill, at, len(facts[0]), name=chosen[0], facts=placed)


def follow_up(tokenizer, name: str) -> list[int]:
    """The tokens that close an answer's turn and ask about `name` in the next one, ending with
    the answer prefix: what a chat client's next request adds to the conversation (the trained
    format: "<|end|>\\n<|user|>\\n<question><|end|>\\n<|assistant|>\\n<prefix>")."""
    hf = _hf(tokenizer)
    question, prefix = QUESTION_OF.format(name=name), ANSWER_OF.format(name=name)
    if getattr(hf, "chat_template", None):
        mark = "\x00ANSWER\x00"
        text = hf.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": mark},
                                       {"role": "user", "content": question}], tokenize=False,
                                      add_generation_prompt=True)
        return encode(hf, text.split(mark, 1)[1] + prefix)
    return encode(hf, f"\n\n{question}\n{prefix}")


def facts_episodes(tokenizer, context: int, trials: int, seed: int, keys: int, filler_kind: str = "heldout",
                   held_out: bool = True, depths: Optional[np.ndarray] = None, placement: str = "uniform",
                   turns: int = 1) -> list[FactsEpisode]:
    """Seeded bench episodes: the asked fact's depth stratified over the trials. turns > 1: each
    episode also lists turns - 1 follow-up questions about other facts of it (`follow_ups`)."""
    if not 1 <= turns <= keys:
        raise ValueError(f"turns must be in 1..keys ({keys})")
    rng = np.random.default_rng([seed, context, keys])
    fill, frames, pool = filler(tokenizer, filler_kind), Frames(tokenizer), names(held_out)
    d = (np.arange(trials) + rng.random(trials)) / trials if depths is None else depths
    ask = np.random.default_rng([seed, context, keys, turns])   # its own stream: the documents stay the same
    eps = []
    for x in d:
        ep = build_facts_episode(tokenizer, fill, frames, context, keys, float(x), rng, pool, placement)
        if turns > 1:
            others = [f for f in ep.facts if f[0] != ep.name]
            ep.follow_ups = [others[i] for i in ask.permutation(len(others))[:turns - 1]]
        eps.append(ep)
    return eps


def bench_episodes(tokenizer, context: int, trials: int, seed: int, keys: int = 1, filler_kind: str = "pydoc",
                   placement: str = "uniform", turns: int = 1) -> list:
    """The needle bench's episodes: keys=1 is v1's single pass key (needle.episodes' format, the
    chosen filler); keys>1 are named facts with held-out names, placed and asked as told."""
    if keys == 1:
        if placement != "uniform" or turns != 1:
            raise ValueError("placements and turns need named facts (keys >= 2)")
        from .needle import build_episode, depths, frame

        rng = np.random.default_rng([seed, context])
        fill, fr = filler(tokenizer, filler_kind), frame(tokenizer)
        return [build_episode(tokenizer, fill, fr, context, float(d), make_key(rng), rng)
                for d in depths(trials, rng)]
    return facts_episodes(tokenizer, context, trials, seed, keys, filler_kind, placement=placement, turns=turns)
