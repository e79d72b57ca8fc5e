"""Embeddings (embedding.Pooler, Backend.prefill_pooled, /v1/embeddings, Ollama's /api/embed):
an input's vector is pooled from the stock model's own last hidden states (a heap that never
evicts: bit for bit over the same chunks on both backends, and within float rounding of one
forward over the whole input), the engine reads it on its own beside the decode batch (the same
vector however many runs decode), and the routes speak the OpenAI and Ollama formats."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import torch

from engine_checks import TEXTS, decoding_rows, drain, ids, until_deltas
from localheap.embedding import Pooler, as_base64, batches, finish, take_group
from localheap.engine import Feed, Finished, Generate
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig
from localheap.sessions import Prompt

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CHUNK = 64


@pytest.fixture(scope="module")
def demo(demo_either):
    return demo_either   # (torch and MLX in turn)


def _document(backend, n: int) -> list[int]:
    return backend.tokenizer.encode(" ".join(TEXTS) * 40, add_special_tokens=False)[:n]


def _stock_hidden(backend, tokens: list[int], chunk: int) -> np.ndarray:
    """[len(tokens), hidden] float32: the stock model body's last hidden states, its own cache fed
    in `chunk`-token forwards (transformers' DynamicCache; mlx-lm's cache)."""
    rows = []
    if backend.name == "torch":
        from transformers import DynamicCache

        from localheap.backends.torch.attention import cache_kwarg

        cache = DynamicCache(config=backend.model.config)
        with torch.no_grad():
            for a in range(0, len(tokens), chunk):
                out = backend.model.base_model(torch.tensor([tokens[a:a + chunk]], device=backend.model.device),
                                               **cache_kwarg(backend.model.base_model, cache),
                                               use_cache=True)
                rows.append(out.last_hidden_state[0].float().cpu().numpy())
        return np.concatenate(rows)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(backend.model)
    for a in range(0, len(tokens), chunk):
        rows.append(np.array(backend.model.model(mx.array([tokens[a:a + chunk]]), cache=cache)[0].astype(mx.float32)))
    return np.concatenate(rows)


def _chunk_sum(backend, rows: np.ndarray) -> np.ndarray:
    """A chunk's float32 sum over its positions, as the backend's own library adds them."""
    if backend.name == "torch":
        return torch.from_numpy(np.ascontiguousarray(rows)).to(backend.model.device).sum(dim=0).cpu().numpy()
    import mlx.core as mx

    return np.array(mx.array(rows).sum(axis=0))


def _pooled(backend, tokens: list[int], mode: str = "mean", chunk: int = CHUNK) -> np.ndarray:
    cache = backend.new_cache(HeapConfig(budget=4096, prefill_chunk=chunk))
    pool = Pooler(mode)
    for a in range(0, len(tokens), chunk):
        backend.prefill_pooled(cache, tokens[a:a + chunk], pool)
    assert pool.count == len(tokens) and backend.tokens_in_cache(cache) == len(tokens)
    return pool.vector()


def test_pooled_hidden_states_are_the_stock_models_own(demo):
    """Over the same chunks, the heap's last hidden states are the stock cache's bit for bit: the
    last position's exactly, the mean as the per-chunk float32 sums make it; and one forward over
    the whole input gives the same mean within float rounding."""
    tokens = _document(demo, 300)
    rows = _stock_hidden(demo, tokens, CHUNK)
    assert np.array_equal(_pooled(demo, tokens, "last"), rows[-1])
    sums = [_chunk_sum(demo, rows[a:a + CHUNK]).astype(np.float64) for a in range(0, 300, CHUNK)]
    assert np.array_equal(_pooled(demo, tokens), (np.sum(sums, axis=0) / 300).astype(np.float32))
    whole = _stock_hidden(demo, tokens, len(tokens)).mean(axis=0)
    np.testing.assert_allclose(_pooled(demo, tokens), whole, rtol=1e-4, atol=1e-5)


def test_the_vector_a_client_gets():
    pool = Pooler("mean")
    pool.add(np.array([2.0, 0.0, 4.0]), 2, np.array([1.0, 0.0, 3.0]))
    pool.add(np.array([1.0, 3.0, 0.0]), 1, np.array([3.0, 4.0, 0.0]))
    assert pool.vector().tolist() == [1.0, 1.0, pytest.approx(4 / 3)]
    last = Pooler("last")
    last.add(np.array([0.0, 0.0, 0.0]), 1, np.array([3.0, 4.0, 0.0]))
    assert finish(last.vector()).tolist() == pytest.approx([0.6, 0.8, 0.0])
    assert finish(last.vector(), dimensions=1).tolist() == [1.0]   # shortened, then unit length again
    assert finish(last.vector(), normalize=False).tolist() == [3.0, 4.0, 0.0]
    with pytest.raises(ValueError, match="dimensions"):
        finish(last.vector(), dimensions=4)
    with pytest.raises(ValueError, match="nothing"):
        Pooler().vector()
    with pytest.raises(ValueError, match="pooling"):
        Pooler("cls")
    raw = np.frombuffer(__import__("base64").b64decode(as_base64(np.array([0.5, -2.0]))), dtype="<f4")
    assert raw.tolist() == [0.5, -2.0]


def test_short_inputs_are_grouped_into_padded_batches():
    """Inputs of at most half the batch's tokens, longest first, each group padded to its first
    one's length within the tokens; longer inputs alone."""
    groups, alone = batches([10, 40, 33, 5, 32, 3], 64)
    assert alone == [1, 2]                   # over 32 tokens
    assert groups == [[4, 0], [3, 5]]        # 10 padded to 32: 2 x 32 = 64; a third would pass 64
    assert batches([8] * 9, 64) == ([list(range(8)), [8]], [])
    from collections import deque

    pending = deque([2, 0, 1])   # (lengths 40, 10, 5: longest first)
    assert take_group(pending, [10, 5, 40], 32) == [2] and list(pending) == [0, 1]   # the first whatever its length
    assert take_group(pending, [10, 5, 40], 32) == [0, 1] and not pending
    assert batches([], 64) == ([], [])


def test_a_padded_batch_is_each_inputs_own_forward(demo):
    """embed_rows: each row's sum, count and last hidden state are those of its own forward
    (a row alone: bit for bit; in a padded batch: within float rounding)."""
    rows = [_document(demo, n) for n in (5, 17, 30)]
    got = demo.embed_rows(rows)
    for row, (total, n, last) in zip(rows, got):
        hidden = _stock_hidden(demo, row, len(row))
        assert n == len(row)
        np.testing.assert_allclose(total, hidden.sum(axis=0), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(last, hidden[-1], rtol=1e-5, atol=1e-5)
    (total, n, last), = demo.embed_rows([rows[1]])
    hidden = _stock_hidden(demo, rows[1], len(rows[1]))
    assert np.array_equal(last, hidden[-1]) and np.array_equal(total, _chunk_sum(demo, hidden))


def _embed(eng, tokens: list[int], mode: str = "mean") -> tuple[queue.Queue, Pooler]:
    events, pool = queue.Queue(), Pooler(mode)
    eng.submit(Feed(Prompt(tokens), events.put, ephemeral=True, pool=pool))
    return events, pool


def test_the_engine_embeds_on_its_own_beside_the_batch(demo):
    """An embedding read alone and again while three chats decode: the same vector (that of the
    backend call; beside the chats, read in smaller chunks, within float rounding), its session
    gone once it ends (nothing kept, no checkpoint), the chats' replies in full."""
    from localheap.engine import Engine
    from localheap.grammar import ForcedTokens
    from localheap.sessions import SessionStore

    tokens = _document(demo, 200)
    want = _pooled(demo, tokens)
    eng = Engine(demo, SessionStore(demo, HeapConfig(budget=256, prefill_chunk=CHUNK)), max_active=8,
                 mixed_chunk=16).start()
    try:
        events, alone = _embed(eng, tokens)
        end = drain(events)[-1]
        assert isinstance(end, Finished) and end.finish_reason == "fed" and end.usage.prompt_tokens == 200
        assert eng.store.sessions() == [] and eng.store.checkpoints.all() == []
        replies = [ids(24, s) for s in (1, 2, 3)]
        queues = []
        for reply in replies:   # forced: no early end-of-sequence, they decode all along
            q = queue.Queue()
            params = SamplingParams(max_tokens=40, constraint=ForcedTokens(reply, demo.eos_token_ids))
            eng.submit(Generate(Prompt(ids(20, len(queues))), params, q.put, ephemeral=True))
            queues.append(q)
        with decoding_rows(eng, demo, "prefill_pooled") as decoding:   # per embedded chunk
            events, beside = _embed(eng, tokens)
            assert isinstance(drain(events)[-1], Finished)
        ends = [drain(q)[-1] for q in queues]
    finally:
        eng.stop()
    assert [e.usage.completion_tokens for e in ends] == [25] * 3   # each reply's 24 tokens and its EOS
    assert max(decoding) >= 2, decoding   # it was read while chats decoded
    assert np.array_equal(alone.vector(), want)   # alone: the prefill chunks of the backend call
    # beside decoding runs its chunks are a riding chunk's size (a chat waits one small forward)
    np.testing.assert_allclose(beside.vector(), want, rtol=1e-5, atol=1e-6)


# -- /v1/embeddings and Ollama's /api/embed, /api/embeddings --

HEAP = HeapConfig(budget=256, recent=32, slack=32, prefill_chunk=CHUNK, recall=True, recall_budget=128)
LIMIT = 4 + 256   # sinks + budget: what the heap holds without evicting


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("fastapi")
    from localheap.backends.torch import TorchBackend
    from localheap.models import demo_model_dir
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    backend = TorchBackend.load(demo_model_dir(), dtype=torch.float32)
    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path_factory.mktemp("sessions"))
    with ServerThread(create_app(backend, settings)) as srv:
        yield srv


def _post(srv, path: str = "/v1/embeddings", **body):
    import httpx

    return httpx.post(srv.url + path, json={"model": srv.services.model_id, **body}, timeout=120)


def _stock_vector(srv, tokens: list[int], dimensions=None) -> np.ndarray:
    """The stock model's mean last hidden state over `tokens` (one forward), at unit length."""
    with torch.no_grad():
        model = srv.services.backend.model
        hidden = model.base_model(torch.tensor([tokens], device=model.device)).last_hidden_state[0].float().cpu()
    return finish(hidden.mean(dim=0).numpy(), dimensions)


def _text_ids(srv, text: str) -> list[int]:
    return list(srv.services.tokenizer.encode(text))   # with the BOS the tokenizer adds


def test_the_openai_sdk_gets_the_stock_models_vectors(server):
    """The SDK asks for base64 by default and decodes it: each text's vector is the stock
    model's mean hidden state over the text's ids (BOS included) at unit length; a batch is in
    order, read in one padded forward, and each vector is the same text's sent alone (within
    float rounding); usage counts every input's tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = ["The pass key of honey is 44444.", "A river runs through the old town.", "Tea, then bed."]
    one = client.embeddings.create(model=server.services.model_id, input=texts[0])
    got = np.array(one.data[0].embedding, dtype=np.float32)
    assert got.shape == (server.services.backend.model_shapes().hidden,)
    np.testing.assert_allclose(got, _stock_vector(server, _text_ids(server, texts[0])), rtol=1e-4, atol=1e-5)
    assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
    backend, sizes = server.services.backend, []
    real = backend.embed_rows
    backend.embed_rows = lambda rows: (sizes.append(len(rows)), real(rows))[1]
    try:
        batch = client.embeddings.create(model=server.services.model_id, input=texts, encoding_format="float")
    finally:
        del backend.embed_rows
    assert sizes == [3]   # short inputs: one padded forward
    assert [d.index for d in batch.data] == [0, 1, 2]
    np.testing.assert_allclose(batch.data[0].embedding, one.data[0].embedding, rtol=1e-5, atol=1e-6)
    for d, text in zip(batch.data, texts):
        np.testing.assert_allclose(d.embedding, _stock_vector(server, _text_ids(server, text)), rtol=1e-4, atol=1e-5)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(_text_ids(server, t)) for t in texts)
    assert server.services.store.sessions() == []   # nothing kept


def test_ids_dimensions_and_the_heaps_size(server):
    """Ids are read as sent (no BOS added); `dimensions` keeps the first N at unit length; an
    input of exactly the heap's size (recall on) is the stock model's, one token more is a 400."""
    ids = _document(server.services.backend, LIMIT + 1)
    r = _post(server, input=[ids[:40], ids[40:100]], encoding_format="float", dimensions=16)
    assert r.status_code == 200, r.text
    vectors = [np.array(d["embedding"], dtype=np.float32) for d in r.json()["data"]]
    np.testing.assert_allclose(vectors[0], _stock_vector(server, ids[:40], 16), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(vectors[1], _stock_vector(server, ids[40:100], 16), rtol=1e-4, atol=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == 100
    whole = _post(server, input=ids[:LIMIT], encoding_format="float")
    assert whole.status_code == 200, whole.text
    np.testing.assert_allclose(whole.json()["data"][0]["embedding"], _stock_vector(server, ids[:LIMIT]),
                               rtol=1e-4, atol=1e-5)
    over = _post(server, input=ids)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    assert f"at most {LIMIT}" in over.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": ["a"] * 2049}, "input"), ({"input": "a", "dimensions": 100000}, "dimensions"),
    ({"input": [[5, 10 ** 7]]}, "input"), ({"input": "a", "encoding_format": "int8"}, None),
    ({"input": [True]}, None), ({"input": [[1, False]]}, None),   # (a boolean was read as the id 1 or 0)
])
def test_bad_requests_are_400s(server, body, param):
    r = _post(server, **body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("body", [{"input": ["a"] * 2049}, {"input": ["a", ""]}, {"input": "a", "dimensions": 100000}])
def test_ollamas_bad_embed_requests_are_400s(server, body):
    r = _post(server, "/api/embed", **body)
    assert r.status_code == 400 and "error" in r.json(), r.text


def test_an_unknown_model_is_a_404(server):
    r = _post(server, model="gpt-nothing", input="hello")
    assert r.status_code == 404


def test_ollamas_embed_and_embeddings(server):
    """Ollama's client: /api/embed's vectors are the OpenAI route's (unit length), an input past
    the heap's size is cut to it (truncate, the default) or refused; /api/embeddings gives the
    raw mean (not normalized); empty inputs load the model and embed nothing."""
    import ollama

    client = ollama.Client(host=server.url)
    model = server.services.model_id
    texts = ["The pass key of honey is 44444.", "Tea, then bed."]
    got = client.embed(model=model, input=texts)
    want = _post(server, input=texts, encoding_format="float").json()["data"]
    assert got.embeddings == [d["embedding"] for d in want]
    assert got.prompt_eval_count == sum(len(_text_ids(server, t)) for t in texts)
    legacy = client.embeddings(model=model, prompt=texts[0])
    with torch.no_grad():
        lm = server.services.backend.model
        hidden = lm.base_model(torch.tensor([_text_ids(server, texts[0])], device=lm.device))
    np.testing.assert_allclose(legacy.embedding, hidden.last_hidden_state[0].mean(dim=0).cpu().numpy(), rtol=1e-4,
                               atol=1e-5)
    long_text = " ".join(TEXTS) * 20
    ids = _text_ids(server, long_text)
    assert len(ids) > LIMIT
    cut = client.embed(model=model, input=long_text)
    np.testing.assert_allclose(cut.embeddings[0], _stock_vector(server, ids[:LIMIT]), rtol=1e-4, atol=1e-5)
    assert cut.prompt_eval_count == LIMIT
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=model, input=long_text, truncate=False)
    assert refused.value.status_code == 400 and "at most" in refused.value.error
    assert client.embed(model=model, input="").embeddings == []
    assert client.embeddings(model=model, prompt="").embedding == []


def test_a_client_that_leaves_cancels_its_inputs(server, caplog):
    """Many inputs, the client gone after a moment: what is left is cancelled, nothing stays in
    flight and no session is kept, on both routes; and nothing is logged as an error (the
    cancelled inputs' CancelledError left the route: "Exception in ASGI application")."""
    import logging

    import httpx

    from localheap.engine.engine import wait_idle

    ids = _document(server.services.backend, LIMIT)
    with caplog.at_level(logging.WARNING):
        text = server.services.backend.tokenizer.decode(ids)   # (Ollama's route takes texts only)
        for path, one in (("/v1/embeddings", ids), ("/api/embed", text)):
            before = server.services.engine.counters.requests
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + path, json={"model": server.services.model_id, "input": [one] * 200},
                           timeout=0.5)
            assert wait_idle(server.services.engine, timeout=30)
            assert server.services.store.sessions() == []
            assert server.services.engine.counters.requests - before < 200   # (an input is a request: most never ran)
        time.sleep(0.3)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("localheap", "uvicorn"))]
    assert not errors, [r.getMessage() for r in errors]


def test_last_token_pooling_from_the_command_line():
    """serve --embed-pooling last: each vector is the input's last hidden state at unit length."""
    import httpx

    from localheap.backends.torch import TorchBackend
    from localheap.cli import build_parser
    from localheap.commands.serve import settings_from_args
    from localheap.models import demo_model_dir
    from localheap.server import create_app
    from localheap.server.testing import ServerThread

    settings = settings_from_args(build_parser().parse_args(["serve", "--embed-pooling", "last"]))
    assert settings.embed_pooling == "last"
    settings.web_dir = None
    backend = TorchBackend.load(demo_model_dir(), dtype=torch.float32)
    with ServerThread(create_app(backend, settings)) as srv:
        ids = _document(backend, 50)
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": backend.model_name, "input": ids}, timeout=60)
    assert r.status_code == 200, r.text
    with torch.no_grad():
        last = backend.model.base_model(torch.tensor([ids], device=backend.model.device)).last_hidden_state[0, -1]
    last = last.cpu().numpy()
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], finish(last), rtol=1e-4, atol=1e-5)


def test_a_backend_without_pooling_refuses_embeddings():
    """(--distributed: a rank holds some layers' hidden states only) a 400 naming the backend."""
    import httpx
    from test_engine import FakeBackend

    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    with ServerThread(create_app(FakeBackend(), ServerSettings(web_dir=None))) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": FakeBackend.model_name, "input": "hello"})
        assert r.status_code == 400 and "not supported" in r.json()["error"]["message"], r.text
        r = httpx.post(srv.url + "/api/embed", json={"model": FakeBackend.model_name, "input": "hello"})
        assert r.status_code == 400 and "not supported" in r.json()["error"], r.text

    class Rank0(FakeBackend):   # a Leader: rank 0 of --distributed (a single MLX process does embed)
        backend = type("Shard", (), {"mode": "tensor"})()

    with ServerThread(create_app(Rank0(), ServerSettings(web_dir=None))) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": FakeBackend.model_name, "input": "hello"})
        assert r.status_code == 400 and "not supported by --distributed tensor" in r.json()["error"]["message"], r.text


def test_calls_in_turn_take_one_engine_step_each(demo):
    """Engine.call_in_turn (a batch of short embeddings): however many wait, one runs per engine
    step, beside a chat that keeps decoding, and no sooner than the engine has spent as long again
    on the chat (SIDE_SHARE 0.5); with nothing decoding they run at once, nothing deferred; a
    stopping engine fails those left."""
    from localheap.engine import Engine, EngineStopped
    from localheap.engine.engine import SIDE_SHARE
    from localheap.grammar import ForcedTokens
    from localheap.sessions import SessionStore

    eng = Engine(demo, SessionStore(demo, HeapConfig(budget=256, prefill_chunk=CHUNK)), max_active=4).start()
    try:
        assert [eng.call_in_turn(lambda: time.sleep(0.02)).result(timeout=30) for _ in range(3)] == [None] * 3
        assert eng._side_free_at == 0.0   # nothing decoded: nothing was deferred
        q = queue.Queue()
        # (cancelled below, once the calls ran: long enough to outlast them on a far faster machine)
        params = SamplingParams(max_tokens=20000, constraint=ForcedTokens(ids(19990, 4), demo.eos_token_ids))
        job = eng.submit(Generate(Prompt(ids(20, 3)), params, q.put, ephemeral=True))
        until_deltas(q, 1)   # it decodes
        seen = []   # (engine step, reply tokens so far, start, end) of each call

        def call():
            began = time.monotonic()
            time.sleep(0.05)
            seen.append((eng._steps, sum(len(r.completion) for r in eng._active), began, time.monotonic()))

        futures = [eng.call_in_turn(call) for _ in range(5)]
        for f in futures:
            f.result(timeout=60)
        job.cancel()
        assert [s[0] for s in seen] == sorted({s[0] for s in seen}) and len(seen) == 5, seen   # one a step
        assert [s[1] for s in seen] == sorted({s[1] for s in seen}), seen   # the chat advanced between them
        assert SIDE_SHARE == 0.5
        for a, b in zip(seen, seen[1:]):   # the chat had as long again in between
            assert b[2] - a[3] >= 0.9 * (a[3] - a[2]), seen
        assert isinstance(drain(q)[-1], Finished)
        blocker = eng.call_in_turn(lambda: time.sleep(0.5))
        skipped = eng.call_in_turn(lambda: seen.append("skipped ran"))
        assert skipped.cancel()   # cancelled by its caller before its turn: never run
        left = eng.call_in_turn(lambda: seen.append("left ran"))
    finally:
        eng.stop()
    assert blocker.done() and "skipped ran" not in seen and "left ran" not in seen
    with pytest.raises(EngineStopped):
        left.result(timeout=1)
