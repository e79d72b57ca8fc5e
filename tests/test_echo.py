"""Prompt logprobs (SamplingParams.prompt_logprobs, Backend.prefill_scored) and the completions'
`echo`: each prompt token's logprob is the stock model's own over the same chunks (a budget that
never evicts: bit for bit on both backends), a scored prompt is read on its own in the batched
engine (the same entries, however many runs decode beside it, evicting or not), and
/v1/completions returns the prompt with its logprobs as lm-eval-harness reads them."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from engine_checks import TEXTS, decoding_rows, drain, engine, ids
from localheap.engine import Delta, Finished, Generate
from localheap.generation import LogprobRecorder, SamplingParams, scored_rows
from localheap.heap import HeapConfig
from localheap.models import demo_model_dir
from localheap.sessions import Prompt

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TOP = 3
CHUNK = 64


@pytest.fixture(scope="module")
def demo(demo_either):
    return demo_either


def _stock_rows(backend, tokens: list[int], chunk: int) -> np.ndarray:
    """[len(tokens), vocab] float32 log-softmax of the stock model's logits at each position, its
    own cache fed in `chunk`-token forwards (torch: transformers' DynamicCache, fp32 logits; MLX:
    mlx-lm's cache, the logprobs in the model's dtype as mlx-lm's generate_step takes them)."""
    rows = []
    if backend.name == "torch":
        from transformers import DynamicCache

        from localheap.backends.torch.attention import cache_kwarg

        cache = DynamicCache(config=backend.model.config)
        with torch.no_grad():
            for a in range(0, len(tokens), chunk):
                out = backend.model(torch.tensor([tokens[a:a + chunk]], device=backend.model.device),
                                    **cache_kwarg(backend.model, cache), use_cache=True,
                                    logits_to_keep=0)
                rows.append(torch.log_softmax(out.logits[0].float(), dim=-1).cpu().numpy())
        return np.concatenate(rows)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(backend.model)
    for a in range(0, len(tokens), chunk):
        logits = backend.model(mx.array([tokens[a:a + chunk]]), cache=cache)[0]
        rows.append(np.array((logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32)))
    return np.concatenate(rows)


def _document(backend, n: int) -> list[int]:
    text = " ".join(TEXTS) * 40
    return backend.tokenizer.encode(text, add_special_tokens=False)[:n]


def test_scored_prefill_is_the_stock_models_own(demo):
    """Every position's entry: the next token, its logprob and the top ids (likeliest first) are
    the stock model's, bit for bit, over the same chunks; the last one scores `following`."""
    tokens = _document(demo, 300)
    cache = demo.new_cache(HeapConfig(budget=4096, prefill_chunk=CHUNK))
    recorder = LogprobRecorder(TOP)
    body = tokens[:-1]
    for a in range(0, len(body), CHUNK):
        end = min(a + CHUNK, len(body))
        demo.prefill_scored(cache, body[a:end], tokens[end], recorder)
    assert len(recorder) == len(tokens) - 1 and demo.tokens_in_cache(cache) == len(body)
    rows = _stock_rows(demo, body, CHUNK)
    for i in range(len(recorder)):
        entry, row = recorder.get(i), rows[i]
        assert entry.token == tokens[i + 1]
        assert entry.logprob == row[tokens[i + 1]], i
        top = np.argsort(-row, kind="stable")[:TOP]
        assert [v for _, v in entry.top] == [row[j] for j in top], i
        assert {j for j, _ in entry.top} == set(top.tolist()) or len(set(row[top].tolist())) < TOP


def test_a_big_vocabulary_scores_in_smaller_forwards():
    assert scored_rows(512, 32000) == 512
    assert scored_rows(512, 128256) == 261 and scored_rows(2048, 151936) == 220
    assert scored_rows(8, 10 ** 9) == 1


def _scored(eng, tokens: list[int], **params) -> tuple[queue.Queue, LogprobRecorder]:
    events, recorder = queue.Queue(), LogprobRecorder(TOP)
    eng.submit(Generate(Prompt(tokens), SamplingParams(prompt_logprobs=recorder, **{"max_tokens": 12, **params}),
                        events.put, ephemeral=True))
    return events, recorder


def _reply(events) -> tuple[str, Finished]:
    evs = drain(events)
    assert isinstance(evs[-1], Finished), evs[-1]
    return "".join(e.text for e in evs if isinstance(e, Delta)), evs[-1]


def test_the_engine_scores_a_prompt_on_its_own_beside_the_batch(demo):
    """A 300-token prompt through a heap of 48 (it evicts from its second chunk on), scored alone
    and again while three chats decode and a document is read beside it: the same entries and the
    same reply, and its reply is the one the same request gets unscored; the others' replies are
    theirs alone."""
    tokens = _document(demo, 300)
    chats = [(ids(20, s), 16) for s in (1, 2, 3)]
    eng = engine(demo, max_active=8, mixed_chunk=16)
    try:
        events, alone = _scored(eng, tokens)
        text_alone, end = _reply(events)
        assert end.usage.prompt_tokens == 300 and len(alone) == 299
        plain_events = queue.Queue()
        eng.submit(Generate(Prompt(tokens), SamplingParams(max_tokens=12), plain_events.put, ephemeral=True))
        assert _reply(plain_events)[0] == text_alone
        solo = []
        for chat, n in chats:
            q = queue.Queue()
            eng.submit(Generate(Prompt(chat), SamplingParams(max_tokens=n), q.put, ephemeral=True))
            solo.append(_reply(q)[0])
        doc_q = queue.Queue()
        queues = []
        for chat, n in chats:
            q = queue.Queue()
            eng.submit(Generate(Prompt(chat), SamplingParams(max_tokens=n), q.put, ephemeral=True))
            queues.append(q)
        from localheap.engine import Feed

        eng.submit(Feed(Prompt(ids(200, 9)), doc_q.put))
        with decoding_rows(eng, demo, "prefill_scored") as decoding:   # per scored chunk
            events, beside = _scored(eng, tokens)
            text_beside, _ = _reply(events)
        assert max(decoding) >= 2, decoding   # it was read while chats decoded
        assert [_reply(q)[0] for q in queues] == solo
        assert isinstance(drain(doc_q)[-1], Finished)
    finally:
        eng.stop()
    assert text_beside == text_alone
    got = [(e.token, e.logprob, e.top) for e in (beside.get(i) for i in range(len(beside)))]
    assert got == [(e.token, e.logprob, e.top) for e in (alone.get(i) for i in range(len(alone)))]
    assert [t for t, _, _ in got] == tokens[1:]


def test_a_scored_prompt_with_no_reply(demo):
    """max_tokens 0: the prompt read and scored, nothing sampled into the reply."""
    eng = engine(demo, max_active=2)
    try:
        events, recorder = _scored(eng, ids(40, 5), max_tokens=0)
        text, end = _reply(events)
    finally:
        eng.stop()
    assert text == "" and end.usage.completion_tokens == 0 and len(recorder) == 39


# -- /v1/completions with echo --

@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from localheap.models import load_backend
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    with ServerThread(create_app(load_backend(str(demo_model_dir()), "torch"), ServerSettings(web_dir=None))) as srv:
        yield srv


def _post(srv, **body):
    import httpx

    return httpx.post(srv.url + "/v1/completions", json={"model": srv.services.model_id, **body}, timeout=60)


def _stock_logprobs(srv, tokens: list[int]) -> list[float]:
    """Each token's (but the first's) log-softmax under the served model, one forward, float32."""
    model = srv.services.backend.model
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=model.device)).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    return [float(rows[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]


def test_lm_eval_loglikelihood_request(server):
    """lm-eval-harness's local-completions payload for a loglikelihood request (token ids in a
    batch of one, echo, logprobs 1, max_tokens 1) and its parse: token_logprobs[ctxlen:-1] summed,
    greedy where each equals its position's best."""
    tokenizer = server.services.backend.tokenizer
    context = tokenizer.encode("The pass key is", add_special_tokens=False)
    continuation = tokenizer.encode(" 7 2 1 9", add_special_tokens=False)
    tokens = context + continuation
    r = _post(server, prompt=[tokens], temperature=0, max_tokens=1, logprobs=1, echo=True, seed=1234)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(tokens) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(tokenizer.decode(tokens))
    assert r.json()["usage"] == {"prompt_tokens": len(tokens), "completion_tokens": 1, "total_tokens": len(tokens) + 1,
                                 **{k: v for k, v in r.json()["usage"].items() if k not in
                                    ("prompt_tokens", "completion_tokens", "total_tokens")}}
    stock = _stock_logprobs(server, tokens)
    assert lp["token_logprobs"][1:len(tokens)] == pytest.approx(stock, abs=1e-4)
    ctxlen = len(context)
    loglikelihood = sum(lp["token_logprobs"][ctxlen:-1])
    assert loglikelihood == pytest.approx(sum(stock[ctxlen - 1:]), abs=1e-3)
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert 1 <= len(top) <= 2 and value in top.values() and max(top.values()) >= value


def test_echo_streams_the_prompt_first_and_takes_max_tokens_zero(server):
    import httpx
    import json

    body = {"prompt": "The pass key", "temperature": 0, "max_tokens": 6, "logprobs": 2, "echo": True}
    whole = _post(server, **body).json()["choices"][0]
    assert whole["text"].startswith("The pass key") and len(whole["text"]) > len("The pass key")
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": server.services.model_id, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == "The pass key" and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
    streamed = [t for c in chunks if c["choices"] for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert streamed == whole["logprobs"]["tokens"]
    offsets = [o for c in chunks if c["choices"] for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert offsets == whole["logprobs"]["text_offset"] == sorted(offsets)
    tokens = whole["logprobs"]["tokens"]
    assert tokens[0] == server.services.backend.tokenizer.bos_token and offsets[:2] == [0, 0]   # not in the text
    for token, at in zip(tokens[1:], offsets[1:]):   # each token's text where its offset says
        assert whole["text"][at:at + len(token)] == token

    zero = _post(server, **{**body, "max_tokens": 0}).json()
    assert zero["usage"]["completion_tokens"] == 0 and zero["choices"][0]["text"] == "The pass key"
    n = zero["usage"]["prompt_tokens"]
    assert len(zero["choices"][0]["logprobs"]["tokens"]) == n
    assert zero["choices"][0]["logprobs"]["token_logprobs"][1:] == \
        pytest.approx(whole["logprobs"]["token_logprobs"][1:n], abs=1e-5)


def test_echo_without_logprobs_and_the_refusals(server):
    plain = _post(server, prompt="The pass key", temperature=0, max_tokens=4).json()["choices"][0]
    echoed = _post(server, prompt="The pass key", temperature=0, max_tokens=4, echo=True).json()["choices"][0]
    assert echoed["text"] == "The pass key" + plain["text"] and echoed["logprobs"] is None
    r = _post(server, prompt="The pass key", max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    import httpx

    r = httpx.post(server.url + "/v1/completions", headers={"X-Session-Id": "sess_1"}, timeout=60,
                   json={"model": server.services.model_id, "prompt": "x", "echo": True, "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = httpx.post(server.url + "/v1/completions", headers={"X-Session-Id": "sess_1"}, timeout=60,
                   json={"model": server.services.model_id, "prompt": ["x", "y"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_batch_of_prompts(server):
    """Several prompts in one request (lm-eval's batch_size > 1): choice k * n + j is prompt k's
    j-th, each what that prompt gets alone; usage counts every prompt once; all in sessions that
    are not kept."""
    tokenizer = server.services.backend.tokenizer
    texts = ["The pass key is", "Once upon a time", "Paris is"]
    batch = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    before = len(server.services.store.sessions())
    alone = [_post(server, prompt=[ids], temperature=0, max_tokens=3, logprobs=1, echo=True).json() for ids in batch]
    r = _post(server, prompt=batch, temperature=0, max_tokens=3, logprobs=1, echo=True, n=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for k, single in enumerate(alone):
        for j in range(2):
            got = body["choices"][2 * k + j]
            assert got["text"] == single["choices"][0]["text"]
            assert got["logprobs"]["token_logprobs"][1:] == \
                pytest.approx(single["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert body["usage"]["completion_tokens"] == 6 * 3
    texts_out = _post(server, prompt=texts, temperature=0, max_tokens=3).json()["choices"]
    plain = [_post(server, prompt=t, temperature=0, max_tokens=3, store=False).json()["choices"][0]["text"]
             for t in texts]
    assert [c["text"] for c in texts_out] == plain
    from localheap.engine import wait_idle

    assert wait_idle(server.services.engine) and len(server.services.store.sessions()) == before
    r = _post(server, prompt=["x"] * 33)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = _post(server, prompt=["x"] * 5, n=8)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
