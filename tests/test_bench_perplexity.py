"""`localheap bench perplexity`: a text read through heaps of each policy and budget, against the
full cache. The full cache's logprobs are the stock model's (tests/test_echo.py); here: every
row's figures are what its logprobs give, a heap that never evicts costs nothing (1.000x), a
budget that holds the text is refused, and the command runs end to end (table and JSON line)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from localheap.bench.perplexity import perplexity, run_perplexity, scored, text_tokens
from localheap.heap import HeapConfig
from localheap.models import demo_model_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")
BASE = HeapConfig(budget=4096, recent=32, slack=64, prefill_chunk=64)


@pytest.fixture(scope="module")
def demo():
    from localheap.backends.torch import TorchBackend

    return TorchBackend.load(demo_model_dir(), dtype=torch.float32)


def test_rows_are_what_their_logprobs_give(demo):
    result = run_perplexity(demo, BASE, context=512, budgets=[128], policies=["snapkv", "streaming"],
                            sources=["corpus"])
    full, *rows = result["rows"]
    assert full["policy"] == "full" and [r["policy"] for r in rows] == ["snapkv", "streaming"]
    tokens = text_tokens(demo.tokenizer, "corpus", 512)
    reference = scored(demo, BASE.with_(budget=512), tokens)
    assert full["ppl_all"] == perplexity(reference)
    start = 128 + BASE.sinks + BASE.append_room - 1   # past the heap's capacity: each token read after an eviction
    for r in rows:
        got = scored(demo, BASE.with_(policy=r["policy"], budget=128, recent=32), tokens)
        assert r["ppl_evicted"] == perplexity(got[start:]) and r["full_evicted"] == perplexity(reference[start:])
        assert r["ratio"] == pytest.approx(r["ppl_evicted"] / r["full_evicted"])
        assert 1 < r["ppl_evicted"] < demo.vocab_size and math.isfinite(r["ppl_all"])
        assert not np.array_equal(got, reference)   # it evicted: other predictions past the budget
        assert np.array_equal(got[:start - 2 * BASE.chunk], reference[:start - 2 * BASE.chunk])   # not before it


def test_a_heap_that_never_evicts_costs_nothing(demo):
    tokens = text_tokens(demo.tokenizer, "corpus", 300)
    assert np.array_equal(scored(demo, BASE.with_(budget=300), tokens), scored(demo, BASE.with_(budget=1000), tokens))


def test_a_file_and_the_refusals(demo, tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("The pass key of honey is 44444. Remember it. " * 60)
    result = run_perplexity(demo, BASE, context=256, budgets=[64], policies=["h2o"], sources=[str(path)])
    assert result["rows"][1]["source"] == str(path) and result["rows"][1]["ratio"] > 0
    for budget in (300, 200):   # 200: sinks + budget + a chunk hold the 256 tokens, nothing is read after an eviction
        with pytest.raises(ValueError, match="the whole 256-token text"):
            run_perplexity(demo, BASE, context=256, budgets=[budget], policies=["h2o"], sources=["corpus"])
    with pytest.raises(ValueError, match="fewer than"):
        text_tokens(demo.tokenizer, str(path), 10 ** 6)


def test_the_command(capsys):
    from localheap.cli import main

    assert main(["bench", "perplexity", "--backend", "torch", "--context", "400", "--budgets", "96",
                 "--policies", "snapkv", "--texts", "corpus", "--prefill-chunk", "64"]) == 0
    out = capsys.readouterr().out
    assert "ppl past heap" in out
    line = json.loads(out.strip().splitlines()[-1])
    assert line["bench"] == "perplexity" and [r["policy"] for r in line["rows"]] == ["full", "snapkv"]
    with pytest.raises(SystemExit, match="recall"):
        main(["bench", "perplexity", "--recall", "on"])
