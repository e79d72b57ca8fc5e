"""Needle bench plumbing on a tiny random model: episode format, table/JSON structure, plots.
Accuracy is not checked here (random weights); tests/test_demo_model.py checks retrieval."""

import io
import json

import numpy as np
import pytest

from localheap.bench import attention_mass, needle
from localheap.heap import POLICIES, HeapConfig

BACKENDS = ["mlx", "torch"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, model_dirs):
    path = model_dirs("llama")
    if request.param == "mlx":
        from localheap.backends.mlx import MLXBackend
        return MLXBackend.load(path, model_name="llama-tiny")
    try:
        from localheap.backends.torch import TorchBackend
    except ImportError as e:
        pytest.skip(f"torch backend unavailable: {e}")
    return TorchBackend.load(path, model_name="llama-tiny")


def test_episode_format(backend):
    tok = backend.tokenizer
    fr = needle.frame(tok)
    rng = np.random.default_rng(0)
    eps = needle.episodes(tok, 200, 5, seed=1)
    assert eps == needle.episodes(tok, 200, 5, seed=1)  # seeded
    for ep in eps:
        assert len(ep.tokens) == 200
        assert list(ep.tokens[-len(fr.tail):]) == list(fr.tail)
        needle_ids = ep.tokens[ep.needle_start:ep.needle_start + ep.needle_len]
        assert needle._hf(tok).decode(needle_ids) == needle.NEEDLE.format(key=ep.key)
        assert len(ep.key) == needle.KEY_DIGITS and ep.key.isdigit()
    depths = [ep.depth for ep in eps]  # stratified, then snapped to a sentence end
    assert all(0.0 <= d <= 1.0 for d in depths) and max(depths) - min(depths) > 0.4
    with pytest.raises(ValueError):
        needle.build_episode(tok, needle.pydoc_filler(tok), fr, 20, 0.5, "12345", rng)
    assert needle.read_key(" 12345.") == "12345" and needle.read_key(" none") == ""


def test_needle_table_structure(backend, tmp_path):
    base = HeapConfig(slack=64, recent=16)
    prune, long_contexts = (0.5, 0.9), (512,)
    result = needle.run_needle(backend, base, context=256, prune=prune, trials=2,
                               long_contexts=long_contexts, long_budget=128, long_trials=1, long_full=(512,))
    rows = result["rows"]
    n_pol, n_pos = len(POLICIES), 2
    assert len(rows) == 1 + len(prune) * n_pol * n_pos + len(long_contexts) * (1 + n_pol * n_pos)
    assert rows[0]["policy"] == "full" and rows[0]["budget"] >= 256
    long_full = [r for r in rows if r["policy"] == "full" and r["context"] == 512]
    assert len(long_full) == 1 and long_full[0]["budget"] == 512  # nothing evicted at 512
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and len(r["hits"]) == r["trials"]
        assert len(r["by_depth"]) == needle.DEPTH_BINS
    budgets = {r["prune"]: r["budget"] for r in rows if r["prune"] is not None}
    assert budgets == {0.5: 128 - base.sinks, 0.9: 26 - base.sinks}
    assert {r["context"] for r in rows} == {256, 512}

    paths = needle.plot(result, tmp_path)  # matplotlib is in the test extra
    assert [p.split("/")[-1] for p in paths] == ["needle_pruning.png", "needle_depth.png"]
    assert all((tmp_path / p.split("/")[-1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    buf = io.StringIO()
    needle.report(result, backend, paths, out=buf)
    text, line = buf.getvalue().rstrip("\n").rsplit("\n", 1)
    assert "full cache" in text and "prune 90%" in text and "geometry" in text
    payload = json.loads(line)
    assert payload["bench"] == "needle" and len(payload["rows"]) == len(rows)
    assert payload["settings"]["trials"] == 2
    assert "full cache" in text.split("budget 128")[1]  # the long table has its full-cache row


def test_merge_parts(backend):
    """Parts measured in parallel merge into the table one process would have made."""
    base = HeapConfig(slack=64, recent=16)
    kw = dict(context=256, trials=2, long_budget=128, long_trials=1)
    short = needle.run_needle(backend, base, prune=(0.5,), policies=["h2o", "snapkv"], long_contexts=(), **kw)
    long_a = needle.run_needle(backend, base, prune=(), policies=["h2o"], long_contexts=(512,),
                               long_full=(512,), **kw)
    long_b = needle.run_needle(backend, base, prune=(), policies=["snapkv"], long_contexts=(384,), **kw)
    merged = needle.merge([short, long_a, long_b])
    whole = needle.run_needle(backend, base, prune=(0.5,), policies=["h2o", "snapkv"], long_contexts=(384, 512),
                              long_full=(512,), **kw)
    key = lambda r: (r["context"], r["policy"], r["positions"], r["prune"])  # noqa: E731
    assert sorted(map(key, merged["rows"])) == sorted(
        map(key, [r for r in whole["rows"] if (r["context"], r["policy"]) not in {(384, "h2o"), (512, "snapkv")}]))
    assert {key(r): r["hits"] for r in merged["rows"]}.items() <= {key(r): r["hits"] for r in whole["rows"]}.items()
    s = merged["settings"]
    assert s["policies"] == ["h2o", "snapkv"] and s["prune"] == [0.5] and s["trials"] == 2
    assert s["long_contexts"] == [384, 512] and s["long_full"] == [512]


def test_attention_mass_structure(backend):
    base = HeapConfig(slack=64, recent=16)
    result = attention_mass.run_attention_mass(backend, base, context=192, prune=(0.0, 0.5), trials=1)
    by = {(r["policy"], r["prune"]): r for r in result["rows"]}
    assert set(p for p, _ in by) == set(POLICIES) | {"oracle"}
    for (pol, p), r in by.items():
        assert len(r["per_layer"]) == 2 and all(0.0 <= v <= 1.0 + 1e-6 for v in r["per_layer"])
        if p == 0.0:
            assert r["mean"] == pytest.approx(1.0, abs=1e-4)  # nothing evicted: all mass kept
        else:  # the oracle keeps the top-mass tokens: nothing does better
            assert r["mean"] <= by[("oracle", p)]["mean"] + 1e-6
    assert "oracle" in attention_mass.tables(result)


def test_cli_needle_and_attention_mass(model_dirs, tmp_path, capsys):
    """`localheap bench needle` and `bench attention-mass` end to end: tables, JSON line, plots."""
    from localheap.cli import main

    path = str(model_dirs("llama"))
    rc = main(["bench", "needle", "--model", path, "--backend", "mlx", "--context", "192", "--trials", "1",
               "--prune", "50%", "--long-contexts", "256", "--long-trials", "1", "--slack", "64", "--recent", "16",
               "--budget", "96", "--plots", str(tmp_path)])
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    assert rc == 0 and "prune 50%" in "\n".join(out)
    payload = json.loads(out[-1])
    assert payload["bench"] == "needle" and payload["settings"]["prune"] == [0.5]
    assert {r["context"] for r in payload["rows"]} == {192, 256}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["needle_depth.png", "needle_pruning.png"]

    rc = main(["bench", "attention-mass", "--model", path, "--backend", "mlx", "--context", "160", "--trials", "1",
               "--prune", "0.5", "--slack", "64", "--recent", "16"])
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    payload = json.loads(out[-1])
    assert rc == 0 and payload["bench"] == "attention_mass"
    assert {r["policy"] for r in payload["rows"]} == set(POLICIES) | {"oracle"}

    with pytest.raises(SystemExit):
        main(["bench", "needle", "--prune", "1.5"])


def test_long_table_counts_what_the_ceiling_answered_and_a_cell_missed():
    """The full cache is the ceiling: the long table pairs each cell with it question by question."""
    assert needle.lost_to_ceiling("1101", "1011") == 1 and needle.lost_to_ceiling("0000", "1111") == 0
    assert needle.lost_to_ceiling("11", "111") is None

    def row(policy, hits, ctx=512):
        return {"context": ctx, "budget": 96 if policy != "full" else ctx, "prune": None, "policy": policy,
                "positions": "compact", "trials": len(hits), "accuracy": hits.count("1") / len(hits),
                "hits": hits, "filler": "man", "placement": "end", "turns": 1}

    short = {"context": 256, "budget": 256, "prune": None, "policy": "full", "positions": "compact",
             "trials": 1, "accuracy": 1.0, "hits": "1"}
    settings = {"context": 256, "policies": ["snapkv", "snapkv+recall"], "positions": ["compact"], "prune": [],
                "trials": 1, "long_contexts": [512], "long_full": [512], "long_budget": 96, "heap": {"sinks": 4}}
    rows = [short, row("full", "11101"), row("snapkv", "10001"), row("snapkv+recall", "01111")]
    text = needle.tables({"settings": settings, "rows": rows})
    lost = {ln.split()[5]: ln.split()[-1] for ln in text.splitlines() if ln.lstrip().startswith("man / end / 1")}
    assert "lost" in text and lost == {"full": "-", "snapkv": "2", "snapkv+recall": "1"}


def test_a_recall_cell_where_no_question_recalled_says_so(backend):
    """At a context whose document and question fit the heap in one prompt nothing is paged out before the
    question: the +recall cell's accuracy is the heap's alone (its region reserved, empty), and its row and
    the recall-costs table say no question recalled (it printed a lower accuracy as recall's, silently)."""
    from localheap.heap import HeapConfig

    base = HeapConfig(budget=508, recent=64, page_size=32, recall_budget=224)
    eps = needle.episodes(backend.tokenizer, 1024, trials=1, seed=0)
    row = needle.cell(backend, base, eps, 1024, 508, "snapkv+recall", "compact", 0.5)
    assert row["policy"] == "snapkv+recall" and isinstance(row["recalls"], int)
    settings = {"context": 1024, "policies": ["snapkv+recall"], "positions": ["compact"], "prune": [0.5],
                "trials": 1, "long_contexts": [], "heap": {"sinks": 4}}
    full = {**row, "policy": "full", "budget": 1024, "recalls": None, "recall_ms": None}
    said = {n: "no question recalled" in needle.tables({"settings": settings, "rows": [full, {**row, "recalls": n}]})
            for n in (0, 1)}
    assert said == {0: True, 1: False}
