"""The named multi-key episode generator (localheap/bench/facts.py): names and their held-out
split, fact placement, seeding, held-out filler; and `bench needle --keys K` end to end."""

import json
import re
import zlib

import numpy as np
import pytest

from localheap.bench import facts, needle
from localheap.models import demo_model_dir

DEMO = demo_model_dir()
pytestmark = pytest.mark.skipif(DEMO is None, reason="no demo model in this checkout")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def test_names_split():
    train, held = facts.names(held_out=False), facts.names(held_out=True)
    assert set(train) | set(held) == set(facts.NAMES) and not set(train) & set(held)
    assert len(set(facts.NAMES)) == len(facts.NAMES)          # no name twice
    assert 25 <= len(held) <= 60 and len(train) >= 100         # ~1/5 held out, enough for 32 keys
    assert all(zlib.crc32(n.encode()) % 5 == 0 for n in held)  # stable: crc32, not the run's seed


def test_corpus_split_is_by_document():
    texts = facts.corpus()
    train, held = facts.split(texts)
    assert len(train) + len(held) == len(texts) and not set(train) & set(held)
    assert 0.05 < len(held) / len(texts) < 0.15


def test_fillers(tok):
    plain, digits = facts.filler(tok, "heldout"), facts.filler(tok, "digits")
    dec = lambda f: tok.decode(f.tokens[:20000].tolist())  # noqa: E731
    assert not re.search(r"[0-9]", dec(plain))
    assert len(re.findall(r"[0-9]", dec(digits))) > 50   # the digits mode keeps the text's numbers
    with pytest.raises(ValueError):
        facts.filler(tok, "nope")


def test_facts_episode(tok):
    eps = facts.facts_episodes(tok, 2048, 6, seed=3, keys=16)
    assert [e.tokens for e in eps] == [e.tokens for e in facts.facts_episodes(tok, 2048, 6, seed=3, keys=16)]
    assert [e.tokens for e in eps] != [e.tokens for e in facts.facts_episodes(tok, 2048, 6, seed=4, keys=16)]
    held = set(facts.names(held_out=True))
    for ep in eps:
        assert len(ep.tokens) == 2048 and len(ep.facts) == 16
        names = [n for n, _, _ in ep.facts]
        keys = [k for _, k, _ in ep.facts]
        assert len(set(names)) == 16 and len(set(keys)) == 16 and set(names) <= held
        assert all(len(k) == 5 and len(set(k)) == 5 for k in keys)
        starts = [s for _, _, s in ep.facts]
        assert starts == sorted(starts)
        for name, key, start in ep.facts:    # each fact verbatim at its recorded place
            fact = needle.encode(tok, facts.FACT.format(name=name, key=key))
            assert ep.tokens[start:start + len(fact)] == fact
        assert ep.name in names and dict(zip(names, keys))[ep.name] == ep.key
        assert ep.needle_start == starts[names.index(ep.name)]
        text = tok.decode(ep.tokens)
        assert text.endswith(facts.ANSWER_OF.format(name=ep.name))
        assert facts.QUESTION_OF.format(name=ep.name) in text
    # the asked fact's depth is stratified over the trials, like the single key's
    d = sorted(ep.depth for ep in eps)
    assert d[0] < 0.3 and d[-1] > 0.7


def test_training_names_and_errors(tok):
    rng = np.random.default_rng(0)
    fill, frames = facts.filler(tok, "heldout"), facts.Frames(tok)
    pool = facts.names(held_out=False)
    ep = facts.build_facts_episode(tok, fill, frames, 1024, 8, 0.5, rng, pool)
    assert {n for n, _, _ in ep.facts} <= set(pool)
    with pytest.raises(ValueError):
        facts.build_facts_episode(tok, fill, frames, 64, 8, 0.5, rng, pool)   # 8 facts do not fit
    with pytest.raises(ValueError):
        facts.build_facts_episode(tok, fill, frames, 1024, 0, 0.5, rng, pool)


def test_single_key_is_v1_episode(tok):
    """--keys 1 with the pydoc filler is exactly the v1 table's episode."""
    a = facts.bench_episodes(tok, 512, 4, seed=2, keys=1, filler_kind="pydoc")
    b = needle.episodes(tok, 512, 4, seed=2)
    assert [e.tokens for e in a] == [e.tokens for e in b]


def test_cli_needle_keys(tmp_path, capsys):
    """`localheap bench needle --keys 4` end to end on a short context with the shipped model."""
    from localheap.cli import main

    rc = main(["bench", "needle", "--backend", "torch", "--keys", "4", "--filler", "digits", "--context", "384",
               "--trials", "2", "--prune", "50%", "--policies", "snapkv", "--long-contexts", "512",
               "--long-trials", "1", "--budget", "192", "--plots", str(tmp_path)])
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    assert rc == 0 and "4 named facts" in "\n".join(out)
    payload = json.loads(out[-1])
    s = payload["settings"]
    assert s["keys"] == 4 and s["filler"] == "digits" and "{name}" in s["needle"]
    assert {r["context"] for r in payload["rows"]} == {384, 512}
    assert all(len(r["hits"]) == r["trials"] for r in payload["rows"])
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["needle_depth.png", "needle_pruning.png"]
    with pytest.raises(SystemExit):
        main(["bench", "needle", "--keys", "0"])


def test_training_rows_answer_their_facts(tok):
    """training/demo_tasks.py: every answer in a fact row (the first question and the follow-ups)
    is the key of the fact named in its question, and only answers are in the loss mask."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "training"))
    from demo_tasks import Tasks

    tasks = Tasks(tok, facts.filler(tok, "heldout"))
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids, mask, pos = tasks.row(rng, 768, (0, 1, 0, 0, 0), 0.0, max_keys=8, questions=4)
        assert len(ids) == len(mask) == len(pos) == 768
        text = tok.decode(ids)
        stated = dict(re.findall(r" The pass key of (\w+) is (\d{5})\.", text.split("<|assistant|>")[0]))
        asked = re.findall(r"What is the pass key of (\w+)\?<\|end\|>\n<\|assistant\|>\nThe pass key of \1 is (\d{5})\.",
                           text)
        assert len(asked) == 4 and len({n for n, _ in asked}) == 4
        assert all(stated[n] == k for n, k in asked)
        answers = tok.decode([i for i, m in zip(ids, mask) if m])
        assert re.findall(r"\d{5}", answers) == [k for _, k in asked]
        assert set(stated) <= set(facts.names(held_out=False))


# ---------------------------------------------------------------- issue 27: wider episodes

def _source_or_skip(kind):
    from localheap.bench import sources

    try:
        return sources.texts(kind)
    except sources.SourceUnavailable as e:   # a machine without man pages, say
        pytest.skip(str(e))


@pytest.mark.parametrize("kind", ["licenses", "man", "comments"])
def test_system_fillers(tok, kind):
    """Each source gives English text of its own kind, digit-free unless +digits, the same every call."""
    docs = _source_or_skip(kind)
    assert len(docs) > 20 and sum(map(len, docs)) > 100_000
    plain, digits = facts.filler(tok, kind), facts.filler(tok, kind + "+digits")
    assert len(plain.tokens) > 65536 and len(plain.boundaries) > 1000
    text = tok.decode(plain.tokens[:40000].tolist())
    assert not re.search(r"[0-9]", text)
    assert len(re.findall(r"[0-9]", tok.decode(digits.tokens[:40000].tolist()))) > 50
    assert len(re.findall(r"\b(the|of|and|to|is)\b", text)) > 1000          # prose, not markup
    if kind == "man":
        assert not re.search(r"^\.[A-Z]{1,2}\b|\\f[BIR]", text, re.M)      # troff stripped
    assert "pass key" not in text.lower()


def test_placements(tok):
    """Facts go where the placement says: one 5% region, right after the head, right before the tail."""
    ctx, keys = 4096, 16
    for placement in ("cluster", "start", "end"):
        eps = facts.facts_episodes(tok, ctx, 4, seed=1, keys=keys, filler_kind="heldout", placement=placement)
        again = facts.facts_episodes(tok, ctx, 4, seed=1, keys=keys, filler_kind="heldout", placement=placement)
        assert [e.tokens for e in eps] == [e.tokens for e in again]
        for ep in eps:
            fr = facts.Frames(tok)(ep.name)
            starts = [s for _, _, s in ep.facts]
            fact_len = [len(needle.encode(tok, facts.FACT.format(name=n, key=k))) for n, k, _ in ep.facts]
            for (name, key, s), n in zip(ep.facts, fact_len):   # verbatim where recorded
                assert ep.tokens[s:s + n] == needle.encode(tok, facts.FACT.format(name=name, key=key))
            span = starts[-1] + fact_len[-1] - starts[0]
            if placement == "cluster":
                assert span - sum(fact_len[:-1]) <= 0.05 * ctx + 1
            elif placement == "start":   # back to back after the head
                assert starts[0] == len(fr.head) and span == sum(fact_len)
            else:                        # back to back before the tail
                assert starts[-1] + fact_len[-1] == ctx - len(fr.tail) and span == sum(fact_len)
    # cluster regions follow the stratified depths
    eps = facts.facts_episodes(tok, ctx, 4, seed=1, keys=keys, filler_kind="heldout", placement="cluster")
    firsts = [ep.facts[0][2] / ctx for ep in eps]
    assert firsts == sorted(firsts) and firsts[0] < 0.3 and firsts[-1] > 0.6
    with pytest.raises(ValueError):
        facts.facts_episodes(tok, ctx, 1, seed=1, keys=keys, placement="nowhere")


def test_uniform_placement_unchanged(tok):
    """Follow-up questions do not change the documents: the same episodes with one question or four."""
    a = facts.facts_episodes(tok, 2048, 3, seed=5, keys=8)
    b = facts.facts_episodes(tok, 2048, 3, seed=5, keys=8, turns=4)
    assert [e.tokens for e in a] == [e.tokens for e in b]
    for ep in b:   # follow-ups: other facts of the same episode, distinct
        asked = [ep.name] + [n for n, _, _ in ep.follow_ups]
        assert len(asked) == 4 == len(set(asked)) and set(asked) <= {n for n, _, _ in ep.facts}
        assert all(f in ep.facts for f in ep.follow_ups)
    with pytest.raises(ValueError):
        facts.facts_episodes(tok, 2048, 1, seed=5, keys=4, turns=5)
    with pytest.raises(ValueError):
        facts.bench_episodes(tok, 2048, 1, seed=5, keys=1, placement="cluster")


def test_follow_up_is_the_trained_turn(tok):
    """A follow-up turn is what training's follow-up questions look like (training/demo_tasks.py)."""
    ids = facts.follow_up(tok, "amber")
    assert tok.decode(ids) == ("<|end|>\n<|user|>\nWhat is the pass key of amber?<|end|>\n<|assistant|>\n"
                               "The pass key of amber is")


def test_cli_needle_variants(tmp_path, capsys):
    """`bench needle` with several fillers, placements and follow-up questions: one long-context cell
    per (filler, placement), every question of a multi-turn episode counted, each cell in the table."""
    from localheap.cli import main

    rc = main(["bench", "needle", "--backend", "torch", "--keys", "4", "--filler", "heldout,licenses+digits",
               "--placement", "uniform,end", "--turns", "2", "--context", "384", "--trials", "1", "--prune", "50%",
               "--policies", "snapkv", "--long-contexts", "640", "--long-trials", "2",
               "--long-full", "640", "--budget", "256", "--recent", "64", "--recall", "on", "--recall-budget", "64",
               "--page-size", "16", "--plots", str(tmp_path)])
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    payload = json.loads(out[-1])
    long = [r for r in payload["rows"] if r["context"] == 640]
    per = {(r["filler"], r["placement"]): [x["policy"] for x in long if (x["filler"], x["placement"]) ==
                                             (r["filler"], r["placement"])] for r in long}
    assert rc == 0 and all(p.count("full") == 1 and "snapkv+recall" in p and "snapkv" in p for p in per.values())
    assert {(r["filler"], r["placement"], r["turns"]) for r in long} == {
        (f, p, 2) for f in ("heldout", "licenses+digits") for p in ("uniform", "end")}
    assert all(r["trials"] == 4 and len(r["hits"]) == 4 for r in long)
    assert all(r["recall_ms"] is not None for r in long if r["policy"].endswith("+recall"))   # 2 episodes x 2 questions
    text = "\n".join(out)
    assert "licenses+digits / end / 2" in text and "heldout / uniform / 2" in text
