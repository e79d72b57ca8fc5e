"""Fill in the middle (server/fim.py): a completion's `suffix` on a model with FIM tokens is read
as <prefix> PROMPT <suffix> SUFFIX <middle> and the reply is the stock model's greedy middle
(OpenAI's /v1/completions and Ollama's /api/generate); a FIM end token ends it; a model without
FIM tokens answers 400. Also vLLM's stop_token_ids."""

from __future__ import annotations

import httpx
import pytest
import torch

from localheap.server.fim import FIM_TOKENS, fim_format, fim_prompt

pytestmark = pytest.mark.usefixtures("torch_one_thread")

QWEN_FIM = FIM_TOKENS[0] + ("<|fim_pad|>", "<|file_sep|>")
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("fastapi")
    from localheap.backends.torch import TorchBackend
    from localheap.randmodel import build_random_model
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    path = build_random_model("qwen2", tmp_path_factory.mktemp("coder"), special=QWEN_FIM)
    backend = TorchBackend.load(path, dtype=torch.float32)
    with ServerThread(create_app(backend, ServerSettings(web_dir=None))) as srv:
        yield srv


def _ids(srv, name: str) -> int:
    return srv.services.tokenizer.get_vocab()[name]


def _expected(srv) -> list[int]:
    tok = srv.services.tokenizer
    plain = lambda text: list(tok.encode(text, add_special_tokens=False))   # noqa: E731
    bos = list(tok.encode("a"))[:-len(plain("a"))]
    return bos + [_ids(srv, "<|fim_prefix|>")] + plain(PREFIX) + [_ids(srv, "<|fim_suffix|>")] + plain(SUFFIX) + \
        [_ids(srv, "<|fim_middle|>")]


def _stock_middle(srv, ids: list[int], n: int) -> str:
    """transformers' greedy continuation of `ids` (its own cache), up to an end token."""
    backend = srv.services.backend
    with torch.no_grad():
        out = backend.model.generate(torch.tensor([ids], device=backend.model.device), max_new_tokens=n,
                                     do_sample=False)[0, len(ids):].tolist()
    ends = set(backend.eos_token_ids) | set(fim_format(srv.services.tokenizer).ends)
    cut = next((i for i, t in enumerate(out) if t in ends), len(out))
    return srv.services.tokenizer.decode(out[:cut])


def test_the_fim_tokens_of_a_vocabulary(server):
    fmt = fim_format(server.services.tokenizer)
    assert (fmt.prefix, fmt.suffix, fmt.middle) == tuple(_ids(server, n) for n in FIM_TOKENS[0])
    assert set(fmt.ends) == {_ids(server, "<|fim_pad|>"), _ids(server, "<|file_sep|>")}
    assert list(fim_prompt(server.services.tokenizer, PREFIX, SUFFIX, None).tokens) == _expected(server)


def test_completions_with_a_suffix_write_the_stock_models_middle(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": server.services.model_id, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 12,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    ids = _expected(server)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["text"] == _stock_middle(server, ids, 12) != ""


def test_ollama_generate_with_a_suffix(server, force):
    """The same middle through Ollama's client; a FIM end token the model writes ends the reply
    (forced here: two tokens, <|fim_pad|>, then more that never come)."""
    import ollama

    client = ollama.Client(host=server.url)
    got = client.generate(model=server.services.model_id, prompt=PREFIX, suffix=SUFFIX,
                          options={"temperature": 0, "num_predict": 12})
    assert got.response == _stock_middle(server, _expected(server), 12)
    force("x = 1<|fim_pad|> and more")
    cut = client.generate(model=server.services.model_id, prompt=PREFIX, suffix=SUFFIX, options={"num_predict": 30})
    assert cut.response == "x = 1" and cut.done_reason == "stop"


def test_a_model_without_fim_tokens_refuses_a_suffix():
    """The demo model has none: a 400 that says so, on both routes; echo with a suffix and a
    suffix with ids are 400s too."""
    from localheap.models import demo_model_dir, load_backend
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    with ServerThread(create_app(load_backend(str(demo_model_dir()), "torch"), ServerSettings(web_dir=None))) as srv:
        model = srv.services.model_id
        for path, body in (("/v1/completions", {"prompt": "a", "suffix": "b"}),
                           ("/api/generate", {"prompt": "a", "suffix": "b", "stream": False})):
            r = httpx.post(srv.url + path, json={"model": model, **body}, timeout=60)
            assert r.status_code == 400 and "fill-in-the-middle" in r.text, r.text
        for body in ({"prompt": "a", "suffix": "b", "echo": True}, {"prompt": [1, 2], "suffix": "b"}):
            r = httpx.post(srv.url + "/v1/completions", json={"model": model, **body}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
        r = httpx.post(srv.url + "/api/generate", json={"model": model, "prompt": "a", "suffix": "b", "system": "s"})
        assert r.status_code == 400, r.text


def test_stop_token_ids_end_the_reply(server):
    """vLLM's stop_token_ids: the greedy reply up to the first listed id, finish_reason stop; an
    id past the vocabulary is a 400."""
    body = {"model": server.services.model_id, "prompt": PREFIX, "max_tokens": 10, "temperature": 0,
            "logprobs": 0}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens = server.services.tokenizer.encode(whole["text"], add_special_tokens=False)
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    cut = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [tokens[k]]}, timeout=60)
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == server.services.tokenizer.decode(tokens[:k])
    assert len(choice["logprobs"]["tokens"]) == k   # the stop token has no entry, as EOS has none
    bad = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [10 ** 7]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"
