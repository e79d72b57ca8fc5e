"""`localheap bench needle`: pass-key retrieval under eviction.

A pass key (5 random digits) is planted at a random depth in filler text; the
question comes at the end and the answer is read back greedily. The episode format
here is also the one the shipped demo model was trained on (training/train_demo.py).
Knows nothing about tensors: it drives any Backend through new_cache/generate.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

import numpy as np

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
KEY_DIGITS = 5
_SLOT = "\x00HAYSTACK\x00"


def _hf(tokenizer):
    """The Hugging Face tokenizer under mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    return tokenizer._tokenizer if type(tokenizer).__name__ == "TokenizerWrapper" else tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return list(_hf(tokenizer).encode(text, add_special_tokens=False))


def make_key(rng: np.random.Generator) -> str:
    """KEY_DIGITS distinct digits (30,240 keys): no digit repeats, so copying never has to guess."""
    return "".join(str(d) for d in rng.permutation(10)[:KEY_DIGITS])


@dataclass(frozen=True)
class Frame:
    """Token ids around the haystack: head + haystack + tail, tail ends with the answer prefix."""

    head: tuple[int, ...]
    tail: tuple[int, ...]


def frame(tokenizer, question: str = QUESTION, answer_prefix: str = ANSWER_PREFIX) -> Frame:
    """Chat-formatted when the tokenizer has a chat template, else plain text after BOS."""
    hf = _hf(tokenizer)
    if getattr(hf, "chat_template", None):
        text = hf.apply_chat_template([{"role": "user", "content": f"{_SLOT}\n\n{question}"}],
                                      tokenize=False, add_generation_prompt=True)
        head, tail = text.split(_SLOT)
        return Frame(tuple(encode(hf, head)), tuple(encode(hf, tail + answer_prefix)))
    bos = [hf.bos_token_id] if hf.bos_token_id is not None else []
    return Frame(tuple(bos), tuple(encode(hf, f"\n\n{question}\n{answer_prefix}")))


@dataclass
class Filler:
    """A token stream of plain text and the positions after which a sentence ends."""

    tokens: np.ndarray      # [N] int
    boundaries: np.ndarray  # sorted indices i: a sentence ends with token i-1


def filler_from_texts(tokenizer, texts: Sequence[str], keep_digits: bool = False) -> Filler:
    """Digits are removed from the filler (unless keep_digits), so the pass key is the only number."""
    hf = _hf(tokenizer)
    texts = list(texts) if keep_digits else [re.sub(r"[0-9]", "", t) for t in texts]
    fast = getattr(hf, "backend_tokenizer", None)   # the Rust tokenizer: no max-length warnings
    ids, bounds = [], []
    for text in texts:
        if fast is not None:
            enc = fast.encode(text + "\n\n", add_special_tokens=False)
            pairs = zip(enc.ids, enc.offsets)
        else:
            enc = hf(text + "\n\n", add_special_tokens=False, return_offsets_mapping=True)
            pairs = zip(enc["input_ids"], enc["offset_mapping"])
        for tid, (_, end) in pairs:
            ids.append(tid)
            if text[end - 1:end] in (".", "\n") or end >= len(text):
                bounds.append(len(ids))
    return Filler(np.asarray(ids, dtype=np.int64), np.asarray(sorted(set(bounds)), dtype=np.int64))


@lru_cache(maxsize=4)
def pydoc_filler(tokenizer) -> Filler:
    """The bench's filler: the pydoc help topics, English text shipped with CPython (PSF licence)."""
    from pydoc_data import topics

    return filler_from_texts(tokenizer, [topics.topics[k] for k in sorted(topics.topics)])


@dataclass
class Episode:
    tokens: list[int]    # the whole prompt: head + filler with needle + tail (answer prefix)
    key: str
    depth: float         # needle start as a fraction of the haystack
    needle_start: int    # index of the needle's first token in `tokens`
    needle_len: int


def build_episode(tokenizer, filler: Filler, fr: Frame, context: int, depth: float, key: str,
                  rng: np.random.Generator) -> Episode:
    """`context` tokens in all. The filler window starts at a random offset; the needle goes
    to the sentence boundary nearest to `depth` (fraction of the haystack)."""
    needle = encode(tokenizer, NEEDLE.format(key=key))
    n_fill = context - len(fr.head) - len(fr.tail) - len(needle)
    if n_fill < 1:
        raise ValueError(f"context {context} too short for the needle frame")
    n = len(filler.tokens)
    start = int(rng.integers(0, n))
    idx = (start + np.arange(n_fill)) % n
    window = filler.tokens[idx]
    # sentence boundaries inside the window, as offsets into it
    rel = (filler.boundaries - start) % n
    rel = rel[(rel > 0) & (rel < n_fill)]
    target = depth * n_fill
    nearest = rel[np.argmin(np.abs(rel - target))] if len(rel) else None
    cut = int(nearest) if nearest is not None and abs(nearest - target) < 64 else int(round(target))
    cut = min(max(cut, 0), n_fill)
    tokens = [*fr.head, *window[:cut].tolist(), *needle, *window[cut:].tolist(), *fr.tail]
    assert len(tokens) == context
    return Episode(tokens, key, cut / n_fill, len(fr.head) + cut, len(needle))


def read_key(text: str) -> str:
    m = re.search(r"\d+", text)
    return m.group(0)[:KEY_DIGITS] if m else ""


# ---------------------------------------------------------------- the bench

PRUNE = (0.1, 0.3, 0.5, 0.7, 0.9)
LONG_CONTEXTS = (16384, 65536)
DEPTH_BINS = 5
MAX_ANSWER_TOKENS = 8
EPISODE_LOG_CONTEXT = 16384   # beyond this context every episode is logged as it finishes


def depths(trials: int, rng: np.random.Generator) -> np.ndarray:
    """Stratified: one random depth in each of `trials` equal slices of [0, 1)."""
    return (np.arange(trials) + rng.random(trials)) / trials


def episodes(tokenizer, context: int, trials: int, seed: int) -> list[Episode]:
    rng = np.random.default_rng([seed, context])
    fill, fr = pydoc_filler(tokenizer), frame(tokenizer)
    return [build_episode(tokenizer, fill, fr, context, float(d), make_key(rng), rng)
            for d in depths(trials, rng)]


def _ask(backend, cache, new_tokens: Sequence[int]) -> list[int]:
    """Greedy answer tokens (up to MAX_ANSWER_TOKENS, an end-of-turn token last if sampled)."""
    from ..generation import SamplingParams

    out = []
    for tok in backend.generate(cache, new_tokens, SamplingParams(max_tokens=MAX_ANSWER_TOKENS)):
        out.append(tok)
        if tok in backend.eos_token_ids:
            break
    return out


def questions(ep: Episode) -> list[tuple[str, int]]:
    """(key, start of its fact in ep.tokens) of every question an episode asks, in order."""
    return [(ep.key, ep.needle_start)] + [(key, at) for _, key, at in getattr(ep, "follow_ups", [])]


def answers(backend, cfg, ep: Episode, pages: Optional[list] = None) -> list[str]:
    """Greedy answers of one episode through a fresh heap, one per question (its page stats
    appended to `pages`). A multi-turn episode (follow_ups) asks its questions in one session as
    serve runs a conversation: each later turn feeds only what the client adds (the answer's
    unfed token, the end of the turn, the next question), so it recalls for its own question
    and releases the previous recall, on the cache that holds the document."""
    from .facts import follow_up

    cache = backend.new_cache(cfg)
    eos, texts, new = set(backend.eos_token_ids), [], list(ep.tokens)
    for i, (name, _, _) in enumerate([(getattr(ep, "name", ""), 0, 0), *getattr(ep, "follow_ups", [])]):
        if i:
            new = unfed + follow_up(backend.tokenizer, name)
        before = backend.tokens_in_cache(cache)
        out = _ask(backend, cache, new)
        fed = backend.tokens_in_cache(cache) - before - len(new)   # the last token sampled is not fed
        unfed = [t for t in out[fed:] if t not in eos]
        texts.append(_hf(backend.tokenizer).decode([t for t in out if t not in eos]))
    if pages is not None and cfg.recall:
        cache.writer.drain()
        pages.append(backend.stats(cache).pages)
    return texts


def answer(backend, cfg, ep: Episode, pages: Optional[list] = None) -> str:
    """The first question's answer (the drivers in docs/recall_runs call this)."""
    return answers(backend, cfg, ep, pages)[0]


def recall_costs(pages: list[dict]) -> dict:
    """What recall cost over a cell's episodes: ms per 1K recalled tokens (all layers' recalls of a
    question together), RAM for the summaries and disk bytes per token (all layers) at the end."""
    ms = sum(p["last_recall"]["ms"] for p in pages if p["last_recall"])
    tokens = sum(p["last_recall"]["tokens"] for p in pages if p["last_recall"])
    disk = sum(p["disk_bytes"] for p in pages)
    on_disk = sum(p["tokens_on_disk"] for p in pages)
    return {"recall_ms_per_1k": round(1000 * ms / tokens, 1) if tokens else None,
            "recall_ms": round(ms / max(1, len(pages)), 1),
            "summary_bytes": int(np.mean([p["summary_bytes"] for p in pages])),
            "disk_bytes_per_token": round(disk / on_disk, 1) if on_disk else None,
            "pages_dropped": sum(p["pages_dropped"] for p in pages)}


def budget_for(context: int, prune: float, sinks: int) -> int:
    """Heap budget (scored slots beyond the sinks) that keeps (1 - prune) of the context."""
    return max(1, int(round(context * (1.0 - prune))) - sinks)


def cell(backend, base, eps: list[Episode], context: int, budget: int, policy: str, positions: str,
         prune: Optional[float], log: Optional[Callable[[str], None]] = None) -> dict:
    recall = policy.endswith("+recall")
    policy = policy.removesuffix("+recall")
    recent = min(base.recent, budget // 2)
    # the recall region: whole pages, beside the recent window inside the budget
    recall_budget = min(base.recall_budget, (budget - recent) // base.page_size * base.page_size)
    cfg = base.with_(budget=budget, policy=policy, positions=positions, recent=recent, recall=recall,
                     recall_budget=recall_budget if recall else base.recall_budget)
    t0 = time.perf_counter()
    pages: list[dict] = []
    hits = []
    depth = []   # per question: where its fact sits, as a fraction of the context
    for i, ep in enumerate(eps):
        t = time.perf_counter()
        asked = questions(ep)
        got = answers(backend, cfg, ep, pages)
        hits += [read_key(a) == key for a, (key, _) in zip(got, asked)]
        depth += [ep.depth] + [at / len(ep.tokens) for _, at in asked[1:]]
        if log and context > EPISODE_LOG_CONTEXT:   # long episodes take minutes: show each one
            marks = " ".join("hit" if h else f"miss ({read_key(a) or '-'} for {k})"
                             for h, a, (k, _) in zip(hits[-len(asked):], got, asked))
            log(f"  ctx {context} {policy}{'+recall' if recall else ''} {positions}: episode {i + 1}/{len(eps)} "
                f"depth {ep.depth:.3f} {marks} ({time.perf_counter() - t:.0f}s)")
    by_bin = []
    for b in range(DEPTH_BINS):
        sel = [h for h, d in zip(hits, depth) if int(min(d, 0.999) * DEPTH_BINS) == b]
        by_bin.append(round(float(np.mean(sel)), 4) if sel else None)
    row = {"context": context, "budget": budget, "prune": prune, "policy": policy, "positions": positions,
           "trials": len(hits), "accuracy": round(float(np.mean(hits)), 4), "by_depth": by_bin,
           "hits": "".join("1" if h else "0" for h in hits), "seconds": round(time.perf_counter() - t0, 1)}
    if recall:
        row = {**row, "policy": policy + "+recall", "recall_budget": cfg.recall_budget, **recall_costs(pages),
               "recalls": sum(p.get("recalls", 0) for p in pages)}
    if log:
        unused = recall and not row["recalls"]   # (its accuracy is the heap's alone, its region left empty)
        log(f"ctx {context:>6} budget {budget:>5} {row['policy']:>9} {positions:>8}: {row['accuracy']:.0%} "
            f"({row['seconds']:.0f}s)" + (" - no question recalled: the document and its question were read in one "
                                          "prompt that fitted the heap; a larger --context tries the recall tier"
                                          if unused else ""))
    return row


def run_needle(backend, base=None, context: int = 4096, prune: Sequence[float] = PRUNE,
               policies: Optional[Sequence[str]] = None, positions: Sequence[str] = ("compact", "absolute"),
               trials: int = 100, long_contexts: Sequence[int] = LONG_CONTEXTS, long_budget: Optional[int] = None,
               long_trials: int = 20, long_full: Sequence[int] = (), seed: int = 0, keys: int = 1,
               filler="pydoc", placements: Sequence[str] = ("uniform",), turns: int = 1,
               log: Optional[Callable[[str], None]] = None) -> dict:
    """The needle table. Returns {"rows": [...], "settings": {...}}; one row per cell:
    full cache at `context`, every (prune, policy, positions) at `context`, then every
    (long context, filler, placement, policy, positions) at `long_budget` (default: base.budget),
    with a full-cache cell first at the long contexts listed in `long_full`.
    keys=1: the single pass key; keys=K>1: K named facts, one asked (bench/facts.py), held-out
    names. filler: one kind or several (bench/facts.py: FILLERS; the CLI's default is heldout);
    placements (facts.PLACEMENTS) and turns (questions per episode, one session) need keys > 1.
    The short context's table uses the first filler, placed uniformly, one question.
    Episodes are seeded and shared by every cell of one context and variant (paired comparison)."""
    from ..heap import POLICIES, HeapConfig
    from .facts import ANSWER_OF, FACT, QUESTION_OF, bench_episodes

    fillers = [filler] if isinstance(filler, str) else list(filler)
    # said before the short context's table runs (it can take hours), not after it
    if keys == 1 and (list(placements) != ["uniform"] or turns != 1):
        raise ValueError("--placement and --turns need named facts (--keys 2 or more)")
    if not long_contexts and (list(placements) != ["uniform"] or turns != 1 or list(long_full)):
        raise ValueError("--placement, --turns and --long-full apply to the long contexts, and --long-contexts is empty")
    base = base or HeapConfig()
    policies = list(policies or POLICIES)
    recall_settings = None
    if base.recall:   # the recall column: every policy also with the page store and recall
        policies = [p for pol in policies for p in (pol, pol + "+recall")]
        recall_settings = {k: getattr(base, k) for k in ("recall_budget", "page_size", "page_format",
                                                            "recall_summary", "recall_score", "recall_select", "disk_budget")}
        base = base.with_(recall=False)
    long_budget = long_budget or base.budget
    rows = []

    eps = bench_episodes(backend.tokenizer, context, trials, seed, keys, fillers[0])
    full = base.budget if base.budget >= context else context
    rows.append(cell(backend, base, eps, context, full, "streaming", "compact", None, log) | {"policy": "full"})
    for p in prune:
        for pol in policies:
            for pos in positions:
                rows.append(cell(backend, base, eps, context, budget_for(context, p, base.sinks), pol, pos, p, log))
    for ctx in long_contexts:
        for fill in fillers:
            for place in placements:
                eps = bench_episodes(backend.tokenizer, ctx, long_trials, seed, keys, fill, place, turns)
                variant = {"filler": fill, "placement": place, "turns": turns}
                if log:
                    log(f"ctx {ctx}: filler {fill}, placement {place}, {turns} question(s) per episode")
                if ctx in long_full:
                    rows.append(cell(backend, base, eps, ctx, ctx, "streaming", "compact", None, log)
                                | {"policy": "full"} | variant)
                for pol in policies:
                    for pos in positions:
                        rows.append(cell(backend, base, eps, ctx, long_budget, pol, pos, None, log) | variant)
    settings = {"context": context, "prune": list(prune), "policies": policies, "positions": list(positions),
                "trials": trials, "long_contexts": list(long_contexts), "long_budget": long_budget,
                "long_trials": long_trials, "long_full": list(long_full), "seed": seed, "heap": base.to_dict(),
                "keys": keys, "filler": fillers[0], "fillers": fillers, "placements": list(placements),
                "turns": turns, "needle": NEEDLE if keys == 1 else FACT,
                "question": QUESTION if keys == 1 else QUESTION_OF,
                "answer_prefix": ANSWER_PREFIX if keys == 1 else ANSWER_OF, "recall": recall_settings}
    return {"rows": rows, "settings": settings}


def merge(parts: Sequence[dict]) -> dict:
    """One result from several `run_needle` results (parts measured in parallel processes):
    rows in order, the first of any repeated cell kept; settings joined (policies, long contexts)."""
    settings = dict(parts[0]["settings"], policies=[], long_contexts=[], long_full=[], long_trials=0)
    rows, seen = [], set()
    for part in parts:
        for r in part["rows"]:
            key = (r["context"], r["budget"], r["policy"], r["positions"], r["prune"], variant(r))
            if key not in seen:
                seen.add(key)
                rows.append(r)
        s = part["settings"]
        settings["policies"] += [x for x in s["policies"] if x not in settings["policies"]]
        if s["prune"] and not settings["prune"]:
            settings.update(prune=s["prune"], trials=s["trials"], context=s["context"])
        if s["long_contexts"]:
            settings.update(long_contexts=sorted(set(settings["long_contexts"]) | set(s["long_contexts"])),
                            long_full=sorted(set(settings["long_full"]) | set(s.get("long_full", []))),
                            long_trials=max(settings["long_trials"], s["long_trials"]),
                            long_budget=s["long_budget"])
    return {"rows": rows, "settings": settings}


def variant(row: dict) -> str:
    """A long-context row's episode kind: filler / placement / questions per episode."""
    return f"{row.get('filler', '-')} / {row.get('placement', 'uniform')} / {row.get('turns', 1)}"


def lost_to_ceiling(full_hits: str, hits: str) -> Optional[int]:
    """Questions the full cache answered and a cell missed, paired question by question (both
    cells ran the same episodes in the same order: their `hits` strings line up); None if the two
    did not ask the same number of questions. The full cache is the model's ceiling: what it
    misses no heap can be blamed for, what it answers a heap should."""
    if len(full_hits) != len(hits):
        return None
    return sum(f == "1" and h == "0" for f, h in zip(full_hits, hits))


def tables(result: dict) -> str:
    """Accuracy per (policy, positions) x prune at the short context; then per long context."""
    from .report import table

    s, rows = result["settings"], result["rows"]
    full = next(r for r in rows if r["policy"] == "full" and r["context"] == s["context"])
    short = [r for r in rows if r["prune"] is not None]
    out_rows = []
    for pol in s["policies"]:
        for pos in s["positions"]:
            r = {"policy": pol, "positions": pos, "full": full["accuracy"]}
            for x in short:
                if x["policy"] == pol and x["positions"] == pos:
                    r[f"p{x['prune']}"] = x["accuracy"]
            out_rows.append(r)
    cols = [("policy", "policy", ""), ("positions", "positions", ""), ("full", "full cache", ".0%")]
    cols += [(f"p{p}", f"prune {p:.0%}", ".0%") for p in s["prune"]]
    what = f"{s.get('keys', 1)} named facts, one asked" if s.get("keys", 1) > 1 else "one pass key"
    text = (f"{what}, filler {s.get('filler', 'pydoc')}; context {s['context']:,}, {s['trials']} trials per cell\n"
            + table(out_rows, cols))
    long = [r for r in rows if r["context"] != s["context"]]
    if long:
        lrows = []
        for v in dict.fromkeys(map(variant, long)):
            cells = [x for x in long if variant(x) == v]
            fulls = [x for x in cells if x["policy"] == "full"]
            ceiling = {x["context"]: x["hits"] for x in fulls}
            if fulls:
                lrows.append({"variant": v, "policy": "full cache", "positions": "",
                              **{f"c{x['context']}": x["accuracy"] for x in fulls},
                              **{f"n{x['context']}": x["trials"] for x in fulls}})
            for pol in s["policies"]:
                for pos in s["positions"]:
                    r = {"variant": v, "policy": pol, "positions": pos}
                    for x in cells:
                        if x["policy"] == pol and x["positions"] == pos:
                            r[f"c{x['context']}"] = x["accuracy"]
                            r[f"n{x['context']}"] = x["trials"]
                            if x["context"] in ceiling:
                                r[f"l{x['context']}"] = lost_to_ceiling(ceiling[x["context"]], x["hits"])
                    lrows.append(r)
        lcols = [("variant", "filler / placement / questions", ""), ("policy", "policy", ""),
                 ("positions", "positions", "")]
        for c in s["long_contexts"]:
            lcols += [(f"c{c}", f"{c // 1024}K" if c % 1024 == 0 else f"{c:,}", ".0%"), (f"n{c}", "n", "d")]
            if c in s.get("long_full", ()):
                lcols.append((f"l{c}", "lost", "d"))
        text += (f"\n\nbudget {s['long_budget']:,} + {s['heap']['sinks']} sinks; n: questions per cell"
                 + ("; lost: questions the full cache answered and the cell missed (same episodes)"
                    if s.get("long_full") else "") + "\n" + table(lrows, lcols))
    costs = [r for r in rows if r.get("recall_ms") is not None]
    if costs:
        text += "\n\nrecall costs (per question; disk and summaries at the end of an episode)\n" + table(costs, [
            ("context", "context", ","), ("filler", "filler", ""), ("placement", "placement", ""),
            ("turns", "questions", "d"), ("budget", "budget", ","), ("positions", "positions", ""),
            ("recall_budget", "recall slots", ","), ("accuracy", "accuracy", ".0%"), ("recalls", "recalls", ","),
            ("recall_ms", "recall ms", ".1f"), ("recall_ms_per_1k", "ms / 1K recalled", ".1f"),
            ("summary_bytes", "summary RAM B", ","), ("disk_bytes_per_token", "disk B / token", ".0f")])
        if any(r.get("recalls") == 0 for r in costs):
            text += ("\nrecalls 0: no question recalled (the document and its question were read in one prompt "
                     "that fitted the heap): that row's accuracy is the heap's alone; a larger --context tries recall")
    return text


def plot(result: dict, out_dir) -> list[str]:
    """needle_pruning.png (accuracy vs pruning per policy) and needle_depth.png (accuracy by
    needle depth and context length). Returns the paths; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s, rows = result["settings"], result["rows"]
    full = next(r for r in rows if r["policy"] == "full" and r["context"] == s["context"])
    fig, axes = plt.subplots(1, len(s["positions"]), figsize=(5.5 * len(s["positions"]), 4), squeeze=False)
    for ax, pos in zip(axes[0], s["positions"]):
        for pol in s["policies"]:
            pts = sorted((r["prune"], r["accuracy"]) for r in rows
                         if r["prune"] is not None and r["policy"] == pol and r["positions"] == pos)
            ax.plot([100 * p for p, _ in pts], [100 * a for _, a in pts], marker="o", label=pol)
        ax.axhline(100 * full["accuracy"], color="gray", ls="--", label="full cache")
        ax.set(title=f"{pos} positions, context {s['context']:,}", xlabel="pruned (%)",
               ylabel="pass-key accuracy (%)", ylim=(-3, 103))
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    paths = [str(out / "needle_pruning.png")]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    # depth x context heatmaps, one per policy: the short context pruned (first position mode),
    # then each long context in every position mode, each full-cache cell as a reference row
    def find(**kw):
        return next((r for r in rows if all(r[k] == v for k, v in kw.items())), None)

    pos = s["positions"][0]
    fig, axes = plt.subplots(1, len(s["policies"]), figsize=(3.4 * len(s["policies"]), 4.2), squeeze=False)
    for ax, pol in zip(axes[0], s["policies"]):
        grid, labels = [full["by_depth"]], [f"{s['context'] // 1024}K full cache"]
        for p in s["prune"]:
            r = find(prune=p, policy=pol, positions=pos, context=s["context"])
            if r and p in (0.5, 0.9):
                grid.append(r["by_depth"]), labels.append(f"{s['context'] // 1024}K -{p:.0%} {pos}")
        for c in s["long_contexts"]:
            r = find(context=c, policy="full")
            if r:
                grid.append(r["by_depth"]), labels.append(f"{c // 1024}K full cache")
            for mode in s["positions"]:
                r = find(prune=None, context=c, policy=pol, positions=mode)
                if r:
                    grid.append(r["by_depth"]), labels.append(f"{c // 1024}K {mode}")
        data = np.array([[np.nan if v is None else 100 * v for v in g] for g in grid])
        ax.imshow(data, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_xticks(range(DEPTH_BINS), [f"{100 * i // DEPTH_BINS}" for i in range(DEPTH_BINS)])
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set(title=pol, xlabel="needle depth (%)")
        for (i, j), v in np.ndenumerate(data):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6, color="w" if v < 60 else "k")
    fig.tight_layout()
    paths.append(str(out / "needle_depth.png"))
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def report(result: dict, backend, plots: Sequence[str] = (), out=None) -> None:
    """Print the tables and the JSON line (report.emit)."""
    import sys

    from .report import emit

    emit("needle", f"model {backend.model_name} | backend {backend.name}\n" + tables(result),
         {"model": backend.model_name, "backend": backend.name, **result, "plots": list(plots)},
         out=out or sys.stdout)
