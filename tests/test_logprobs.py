"""Logprobs and logit_bias (generation.LogprobRecorder, SamplingParams.logit_bias) on both backends:
each sampled token's logprob and top alternatives are the stock model's own log-softmax (a full
forward of prompt and reply, with a budget that never evicts), logit_bias moves the sample but
not the logprobs, the batched engine gives each request the entries it gets alone, and the
OpenAI routes return them (chat's logprobs.content, completions' legacy object) whole or streamed;
n choices decode together, each sampled on its own."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import torch

from engine_checks import TEXTS, drain, engine
from localheap.engine import Delta, Finished, Generate, wait_idle
from localheap.generation import LogprobRecorder, SamplingParams, TokenLogprob
from localheap.heap import HeapConfig
from localheap.models import demo_model_dir
from localheap.sessions import Prompt

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TOP = 4


@pytest.fixture(scope="module")
def demo(demo_either):
    return demo_either


def _encode(backend, text: str) -> list[int]:
    return backend.tokenizer.encode(text, add_special_tokens=False)


def _stock_logprobs(backend, prompt: list[int], reply: list[int]) -> np.ndarray:
    """[len(reply), vocab]: the log-softmax the stock model gives each reply token's position, with
    no heap (torch: one forward of prompt + reply, float32)."""
    ids = prompt + reply
    if backend.name == "torch":
        with torch.no_grad():
            logits = backend.model(torch.tensor([ids], device=backend.model.device)).logits[0].float()
        out = torch.log_softmax(logits, dim=-1).cpu().numpy()
        return out[len(prompt) - 1: len(ids) - 1]
    # mlx-lm's way: its own cache, the prompt but its last token, then one token a step, the
    # logprobs in the model's dtype (float16 here)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(backend.model)
    backend.model(mx.array([prompt[:-1]]), cache=cache)
    rows = []
    for token in [prompt[-1]] + reply[:-1]:
        logits = backend.model(mx.array([[token]]), cache=cache)[0, -1]
        rows.append(np.array((logits - mx.logsumexp(logits, keepdims=True)).astype(mx.float32)))
    return np.stack(rows)


def _generate(backend, prompt: list[int], **params) -> tuple[list[int], LogprobRecorder]:
    recorder = LogprobRecorder(TOP)
    cache = backend.new_cache(HeapConfig(budget=4096))
    tokens = list(backend.generate(cache, prompt, SamplingParams(logprobs=recorder, **params)))
    return tokens, recorder


# torch: a full forward against the heap's step by step, float32 (another summation order);
# MLX: mlx-lm's own decode, which the heap at full budget matches bit for bit
ATOL = {"torch": 1e-4, "mlx": 0.0}


def _check_against_stock(backend, entry: TokenLogprob, row: np.ndarray, token: int) -> None:
    close = dict(abs=ATOL[backend.name], rel=0)
    assert entry.token == token
    assert entry.logprob == pytest.approx(float(row[token]), **close)
    assert len(entry.top) == TOP
    want = np.sort(row)[::-1][:TOP]
    assert [lp for _, lp in entry.top] == pytest.approx(want.tolist(), **close), "the likeliest first"
    assert [lp for _, lp in entry.top] == pytest.approx([float(row[i]) for i, _ in entry.top], **close)


def test_logprobs_are_the_stock_models_own(demo):
    prompt = _encode(demo, TEXTS[0])
    tokens, recorder = _generate(demo, prompt, max_tokens=12)
    assert len(tokens) == 12 and len(recorder) >= 12   # (pipelined: the next one may be sampled too)
    stock = _stock_logprobs(demo, prompt, tokens)
    for i, token in enumerate(tokens):
        entry = recorder.get(i)
        _check_against_stock(demo, entry, stock[i], token)
        assert entry.top[0][0] == token, "greedy: the sampled token is the likeliest"


def test_sampled_tokens_get_their_logprobs_too(demo):
    prompt = _encode(demo, TEXTS[2])
    tokens, recorder = _generate(demo, prompt, max_tokens=10, temperature=1.5, seed=7)
    stock = _stock_logprobs(demo, prompt, tokens)
    for i, token in enumerate(tokens):
        _check_against_stock(demo, recorder.get(i), stock[i], token)
    assert any(recorder.get(i).top[0][0] != t for i, t in enumerate(tokens)), "some draws were not the argmax"


def test_logit_bias_moves_the_sample_not_the_logprobs(demo):
    prompt = _encode(demo, TEXTS[0])
    plain, _ = _generate(demo, prompt, max_tokens=6)
    forced_id = 65
    assert forced_id not in plain
    tokens, recorder = _generate(demo, prompt, max_tokens=6, logit_bias={forced_id: 100.0})
    assert tokens == [forced_id] * 6
    stock = _stock_logprobs(demo, prompt, tokens)
    for i, token in enumerate(tokens):
        _check_against_stock(demo, recorder.get(i), stock[i], token)   # the model's, before the bias
    assert recorder.get(0).logprob < -1.0
    banned, _ = _generate(demo, prompt, max_tokens=6, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    # a penalty (and the bias) leave the recorded distribution alone as well
    tokens, recorder = _generate(demo, prompt, max_tokens=8, presence_penalty=2.0, logit_bias={plain[1]: 3.0})
    stock = _stock_logprobs(demo, prompt, tokens)
    for i, token in enumerate(tokens):
        _check_against_stock(demo, recorder.get(i), stock[i], token)


def test_a_bias_past_the_vocabulary_is_refused(demo):
    with pytest.raises(ValueError, match="logit_bias names token id"):
        _generate(demo, _encode(demo, TEXTS[3]), max_tokens=2, logit_bias={10**7: 1.0})


def test_the_params_check_and_carry_the_bias():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="top logprobs"):
        LogprobRecorder(21)
    params = SamplingParams(logit_bias={7: -2.5}, logprobs=LogprobRecorder(2), presence_penalty=0.5)
    assert not params.plain_greedy and not SamplingParams(logprobs=LogprobRecorder()).plain_greedy
    assert SamplingParams().plain_greedy
    # to another rank (--distributed) as JSON: the bias keeps its ids, the recorder stays here
    sent = SamplingParams(**json.loads(json.dumps(params.portable())))
    assert sent.logit_bias == {7: -2.5} and sent.logprobs is None and sent.presence_penalty == 0.5


def test_a_batch_samples_biased_and_recorded_rows_on_their_own():
    from localheap.backends.torch.batch import sample_rows
    from localheap.backends.torch.generate import Sampler

    cpu = torch.device("cpu")
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    recorder = LogprobRecorder(2)
    samplers = [Sampler(SamplingParams(), cpu), Sampler(SamplingParams(logit_bias={11: 100.0}), cpu),
                Sampler(SamplingParams(logprobs=recorder), cpu)]
    tokens = sample_rows(samplers, logits).tolist()
    assert tokens == [int(logits[0].argmax()), 11, int(logits[2].argmax())]
    entry = recorder.get(0)
    assert entry.token == tokens[2]
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits[2], -1).max()), abs=1e-6)


def _engine_entries(backend, requests, batched: bool):
    """Each request's (reply text, its logprob entries in Delta order, the Delta count with entries
    and no text, Finished), on an engine that batches or not. The batch reads every prompt in
    the chunks it has alone (a prompt split otherwise is scored otherwise: once the heap evicts,
    other slots are kept, and the logprobs differ by more than a summation order)."""
    kw = {"max_active": len(requests), "mixed_chunk": 4096} if batched else {"max_active": 1}
    eng = engine(backend, batched=batched, **kw)
    try:
        queues = []
        for tokens, params in requests:   # each in a session of its own (none continues another's)
            events = queue.Queue()
            eng.submit(Generate(Prompt(tokens), SamplingParams(logprobs=LogprobRecorder(TOP), **params), events.put,
                                ephemeral=True))
            queues.append(events)
        out = []
        for events in queues:
            evs = drain(events)
            deltas = [e for e in evs if isinstance(e, Delta)]
            entries = [x for d in deltas for x in d.logprobs or []]
            out.append(("".join(d.text for d in deltas), entries, sum(not d.text for d in deltas), evs[-1]))
        return out
    finally:
        eng.stop()


def test_the_batch_gives_each_request_its_logprobs_alone(demo):
    """Four chats with logprobs (one with a stop string): the same replies and entries batched as
    alone; one entry per reply token but an EOS, a stop string's
    tokens included (their entries come in a Delta with no text)."""
    requests = [(_encode(demo, t), {"max_tokens": m}) for t, m in zip(TEXTS, (30, 18, 40, 25))]
    alone = _engine_entries(demo, requests, batched=False)
    text, entries = alone[0][0], alone[0][1]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    requests[1] = (requests[0][0], {"max_tokens": 30, "stop": [stop]})
    alone = _engine_entries(demo, requests, batched=False)
    together = _engine_entries(demo, requests, batched=True)
    for (text_a, entries_a, _, end_a), (text_b, entries_b, _, end_b) in zip(alone, together):
        assert text_a == text_b
        assert [e.token for e in entries_a] == [e.token for e in entries_b]
        assert [e.logprob for e in entries_a] == pytest.approx([e.logprob for e in entries_b], abs=1e-4)
        assert end_a.usage.completion_tokens == end_b.usage.completion_tokens
    for (tokens, params), (text, entries, bare, end) in zip(requests, together):
        assert isinstance(end, Finished)
        eos = end.finish_reason == "stop" and not params.get("stop") and entries[-1:] != []
        n = end.usage.completion_tokens
        assert len(entries) in ((n - 1, n) if eos else (n,)), (len(entries), n, end.finish_reason)
        assert all(len(e.top) == TOP for e in entries)
    stopped = together[1]
    assert stopped[3].finish_reason == "stop" and stop not in stopped[0]
    assert len(stopped[1]) == stopped[3].usage.completion_tokens
    pieces = "".join(demo.tokenizer.decode([e.token]) for e in stopped[1])
    assert stopped[0] + stop in pieces, "the entries run through the stop string"


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from localheap.models import load_backend
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    with ServerThread(create_app(load_backend(str(demo_model_dir()), "torch"), ServerSettings(web_dir=None))) as srv:
        yield srv


def _post(srv, path: str, **body):
    import httpx

    return httpx.post(srv.url + path, json={"model": srv.services.model_id, **body}, timeout=60)


def _chat(srv, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": "The pass key"}], "max_tokens": 16, "temperature": 0,
            "store": False, **kw}
    r = _post(srv, "/v1/chat/completions", **body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(srv, path: str, **body) -> list[dict]:
    import httpx

    chunks = []
    with httpx.stream("POST", srv.url + path, json={"model": srv.services.model_id, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_chat_returns_logprobs_whole_and_streamed(server):
    plain = _chat(server)
    assert plain["choices"][0]["logprobs"] is None
    body = _chat(server, logprobs=True, top_logprobs=3)
    choice = body["choices"][0]
    assert choice["message"]["content"] == plain["choices"][0]["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 16
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert bytes(e["bytes"]).decode() == e["token"]
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"] <= 0
        lps = [t["logprob"] for t in e["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)
    assert _chat(server, logprobs=True)["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    chunks = _stream(server, "/v1/chat/completions", messages=[{"role": "user", "content": "The pass key"}],
                     max_tokens=16, temperature=0, store=False, logprobs=True, top_logprobs=3)
    streamed = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    for c in chunks:   # each chunk's entries are its own text's
        lp = (c["choices"][0].get("logprobs") or {}).get("content")
        if lp:
            assert "".join(e["token"] for e in lp) == c["choices"][0]["delta"].get("content")


def test_completions_return_the_legacy_logprobs(server):
    r = _post(server, "/v1/completions", prompt="The pass key", max_tokens=8, temperature=0, logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and 2 <= len(top) <= 3   # the sampled token always among them
    chunks = _stream(server, "/v1/completions", prompt="The pass key", max_tokens=8, temperature=0, logprobs=2)
    legacy = [(c["choices"][0]["logprobs"] or {}) for c in chunks if c["choices"]]
    tokens = [t for lp in legacy for t in lp.get("tokens") or []]
    offsets = [o for lp in legacy for o in lp.get("text_offset") or []]
    assert tokens == lp["tokens"] and offsets == lp["text_offset"]
    # a stop string that holds text back (never matching): the streamed offsets still point at the tokens
    held = next(t for t in lp["tokens"][2:] if len(t) >= 2)[-2:] + "\x01"
    chunks = _stream(server, "/v1/completions", prompt="The pass key", max_tokens=8, temperature=0, logprobs=2,
                     stop=[held])
    offsets = [o for c in chunks if c["choices"] for o in (c["choices"][0]["logprobs"] or {}).get("text_offset") or []]
    assert offsets == lp["text_offset"]


def test_legacy_logprobs_name_a_token_that_is_part_of_a_character_by_its_bytes():
    """Two tokens that are each part of a character both read as U+FFFD: keyed by text, one's logprob
    stood for the other's in top_logprobs; as OpenAI's, such a token is "bytes:\\xNN"."""
    from localheap.server.logprobs import completion_logprobs

    texts = {1: ("\ufffd", [0xe2, 0x80]), 2: ("\ufffd", [0x89]), 3: ("a", [97])}
    entry = TokenLogprob(1, -2.0, [(2, -1.0), (1, -2.0), (3, -3.0)])
    lp = completion_logprobs(texts.get, [entry])
    assert lp["tokens"] == ["bytes:\\xe2\\x80"] and lp["token_logprobs"] == [-2.0]
    assert lp["top_logprobs"] == [{"bytes:\\x89": -1.0, "bytes:\\xe2\\x80": -2.0, "a": -3.0}]


def test_logit_bias_through_the_api(server):
    token = server.services.tokenizer.decode([65])
    assert _chat(server, logit_bias={"65": 100})["choices"][0]["message"]["content"] == token * 16
    first = _chat(server, logprobs=True)["choices"][0]["logprobs"]["content"][0]["token"]
    text_of = server.services.token_text
    ids = [i for i in range(server.services.backend.vocab_size) if text_of(i)[0] == first]
    banned = _chat(server, logprobs=True, logit_bias={str(i): -100 for i in ids})["choices"][0]["logprobs"]["content"]
    # (the next likeliest may end the reply: no entry then)
    assert banned == [] or banned[0]["token"] != first


@pytest.mark.parametrize("fields,param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_logprobs_and_bias_fields_are_400(server, fields, param):
    r = _post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_completions_logprobs_over_five_is_400(server):
    r = _post(server, "/v1/completions", prompt="hi", max_tokens=2, logprobs=6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_the_openai_sdk_reads_them(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=server.services.model_id, messages=[{"role": "user", "content": "The pass key"}], max_tokens=8,
              temperature=0, logprobs=True, top_logprobs=2, logit_bias={"65": -5})
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)
    streamed = [t for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    legacy = client.completions.create(model=server.services.model_id, prompt="The pass key", max_tokens=4,
                                       temperature=0, logprobs=1)
    assert len(legacy.choices[0].logprobs.tokens) == 4


def test_n_choices_decode_together(server, monkeypatch):
    """n: the choices decode in one batch, each with its own sampling (seed + index) and logprobs;
    greedy choices are the one reply; whole and streamed give the same choices; the usage counts
    the prompt once."""
    one = _chat(server, temperature=1.0, seed=5, logprobs=True)
    backend, rows = server.services.backend, []
    real = backend.step_rows
    monkeypatch.setattr(backend, "step_rows", lambda batch, chunks=(): rows.append(len(batch)) or real(batch, chunks))
    three = _chat(server, temperature=1.0, seed=5, logprobs=True, n=3)
    monkeypatch.undo()
    assert max(rows) == 3, rows
    texts = [c["message"]["content"] for c in sorted(three["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert texts[0] == one["choices"][0]["message"]["content"], "choice 0 samples with the request's seed"
    assert len(set(texts)) == 3, texts
    assert texts[1] == _chat(server, temperature=1.0, seed=6)["choices"][0]["message"]["content"]
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * 16
    for c in three["choices"]:
        assert "".join(e["token"] for e in c["logprobs"]["content"]) == c["message"]["content"]
    greedy = _chat(server, n=2)
    assert greedy["choices"][0]["message"] == greedy["choices"][1]["message"]
    chunks = _stream(server, "/v1/chat/completions", messages=[{"role": "user", "content": "The pass key"}],
                     max_tokens=16, temperature=1.0, seed=5, store=False, n=3, stream_options={"include_usage": True})
    streamed = {i: "" for i in range(3)}
    finished = set()
    for c in chunks:
        for ch in c["choices"]:
            streamed[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finished.add(ch["index"])
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * 16 and chunks[-1]["choices"] == []
    text = _post(server, "/v1/completions", prompt="The pass key", max_tokens=6, temperature=1.0, seed=2, n=2).json()
    assert [c["index"] for c in text["choices"]] == [0, 1] and text["usage"]["completion_tokens"] == 12
    # (a reply goes out before its run's last bookkeeping: in_flight may read 1 for a moment)
    assert wait_idle(server.services.engine, timeout=2.0) and server.services.engine.in_flight == 0


def test_n_choices_all_stop_when_the_client_leaves(server, force):
    """A stream of 3 choices closed early, and a whole reply of 3 the client gave up on: every
    choice's job is cancelled (none runs on to max_tokens), and their sessions are gone. Each is
    forced to write 5,000 tokens: a random model's EOS could end one before its client left."""
    import httpx

    svc = server.services
    force(" a" * 6000)
    cancelled, sessions = svc.engine.counters.cancelled, len(svc.store)
    body = {"model": svc.model_id, "messages": [{"role": "user", "content": "Never stop."}], "max_tokens": 5000,
            "temperature": 1.0, "n": 3, "store": False}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 12:
                break
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
    assert wait_idle(svc.engine) and svc.engine.counters.cancelled == cancelled + 6
    assert len(svc.store) == sessions, "the choices' sessions (store: false) are not kept"
