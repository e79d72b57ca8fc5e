"""Hard limits of `serve` (issue 12): prompt tokens per request (from the RAM budget),
the default body limit, the heap-event interval floor and observer cap, and tokenization
in bounded pieces that gives exactly the ids of one call. Fake backend, loopback only."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from test_engine import FakeBackend

from localheap.commands.serve import settings_from_args
from localheap.governor.budget import MemoryPlan, request_room
from localheap.server import ServerSettings, create_app
from localheap.server.errors import PromptTooLong
from localheap.server.testing import ServerThread
from localheap.server.tokens import PIECE_CHARS, encode_bounded

MODEL = FakeBackend.model_name


def serve(**settings) -> ServerThread:
    settings.setdefault("web_dir", None)
    return ServerThread(create_app(FakeBackend(), ServerSettings(**settings)))


def test_prompt_token_limit_comes_from_the_budget_and_still_takes_a_1m_token_document():
    for budget in (512 << 20, 4 << 30, 64 << 30):
        plan = MemoryPlan(budget, 0, 1, 0, request_room(budget))
        assert plan.max_prompt_tokens >= 1_000_000, budget
    assert MemoryPlan(64 << 30, 0, 1, 0, request_room(64 << 30)).max_prompt_tokens <= 8_500_000


def test_defaults_fit_a_1m_token_document_but_not_a_30mb_message():
    import argparse

    from localheap.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert isinstance(args, argparse.Namespace)
    limit = settings_from_args(args).max_body_bytes
    assert ServerSettings().max_body_bytes == limit == 16 << 20
    assert 6 << 20 < limit < 30_000_000   # ~4 chars a token, JSON-escaped: a 1M-token document fits
    with serve() as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 30_000_000}]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_prompts_over_the_token_limit_answer_400_on_every_route():
    with serve(max_prompt_tokens=100) as srv:
        ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y" * 100, "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "y" * 101, "max_tokens": 1}),
                           ("/v1/completions", {"model": MODEL, "prompt": list(range(1, 102)), "max_tokens": 1})):
            r = httpx.post(srv.url + path, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        sid = httpx.post(srv.url + "/v1/sessions").json()["id"]
        r = httpx.post(f"{srv.url}/v1/sessions/{sid}/documents", json={"text": "z" * 500, "raw": True, "stream": False})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}").json()["tokens"] == 0   # nothing half-fed


def test_heap_events_interval_floor_and_observer_cap():
    with serve(max_observers=2) as srv:
        for interval in (1e-6, 0.05):
            r = httpx.get(srv.url + "/v1/heap/events", params={"interval": interval})
            assert r.status_code == 400 and r.json()["error"]["param"] == "query.interval", r.text
        clients = [httpx.Client(timeout=10) for _ in range(3)]
        try:
            streams = [c.send(c.build_request("GET", srv.url + "/v1/heap/events", params={"interval": 0.1}),
                              stream=True) for c in clients[:2]]
            assert all(s.status_code == 200 for s in streams)
            stamps, lines = [], streams[0].iter_lines()   # kept referenced: a collected iterator closes the stream
            while len(stamps) < 3:                        # when the server made each event
                line = next(lines)
                if line.startswith("data:"):
                    stamps.append(json.loads(line[5:])["time"])
            assert stamps[2] - stamps[0] >= 0.198, stamps  # two intervals of >= 0.1 s
            third = httpx.get(srv.url + "/v1/heap/events")
            assert third.status_code == 503 and third.json()["error"]["code"] == "too_many_observers"
            assert "retry-after" in third.headers
            streams[1].close()
            deadline = time.monotonic() + 5
            while True:                                   # the closed stream's slot comes back
                r = clients[2].send(clients[2].build_request("GET", srv.url + "/v1/heap/events"), stream=True)
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                r.close()
                time.sleep(0.05)
            assert r.status_code == 200
            r.close()
        finally:
            for c in clients:
                c.close()


class RawTokenizer:
    """The demo model's byte-level BPE through `tokenizers` alone (transformers is slow to import)."""

    def __init__(self, path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))

    def encode(self, text, add_special_tokens=True):
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def get_vocab(self):
        return self.tok.get_vocab()


@pytest.fixture(scope="module")
def demo_tokenizer():
    pytest.importorskip("tokenizers")
    from localheap.models import demo_model_dir

    path = demo_model_dir()
    if path is None:
        pytest.skip("no bundled demo model")
    return RawTokenizer(path)


def test_tokenizing_in_pieces_gives_the_ids_of_one_call(demo_tokenizer):
    rng = random.Random(0)
    words = ["the", "value", "of", "key7", "is", "seven,", "and", "reads\n\n", "Ünïcode", "日本語", "  spaced", "(x)", "'s"]
    text = " ".join(rng.choice(words) for _ in range(4 * PIECE_CHARS // 6))
    assert len(text) > 3 * PIECE_CHARS
    whole = list(demo_tokenizer.encode(text, add_special_tokens=False))
    assert encode_bounded(demo_tokenizer, text, None).tolist() == whole
    assert encode_bounded(demo_tokenizer, text, len(whole)).tolist() == whole
    with pytest.raises(PromptTooLong):
        encode_bounded(demo_tokenizer, text, len(whole) - 1)
    with pytest.raises(PromptTooLong):                   # refused from its length alone, before any piece
        encode_bounded(demo_tokenizer, "a" * 10_000_000, 1000)


def test_max_batch_and_max_active_default_by_device():
    """--max-batch: 16 on CUDA (measured on an H200), 8 elsewhere; --max-active follows it, at least 8;
    either flag given wins, and 0 is refused."""
    from types import SimpleNamespace

    from localheap.cli import build_parser
    from localheap.commands.serve import batch_limits, default_max_batch

    parse = lambda *flags: settings_from_args(build_parser().parse_args(["serve", *flags]))   # noqa: E731
    assert (parse().max_batch, parse().max_active) == (8, 8)
    assert (parse("--max-batch", "12").max_batch, parse("--max-batch", "12").max_active) == (12, 12)
    assert parse("--max-batch", "4").max_active == 8 and parse("--max-active", "3").max_active == 3
    assert default_max_batch(SimpleNamespace(device=SimpleNamespace(type="cuda"))) == 16
    assert default_max_batch(SimpleNamespace(device=SimpleNamespace(type="cpu"))) == 8
    assert default_max_batch(SimpleNamespace()) == 8   # mlx: no torch device
    args = lambda *flags: build_parser().parse_args(["serve", *flags])   # noqa: E731
    assert batch_limits(args(), 16) == (16, 16)   # run(): the CUDA default, and room for it
    assert batch_limits(args("--max-active", "3"), 16) == (16, 3)
    assert batch_limits(args("--max-batch", "4"), 16) == (4, 8)
    with pytest.raises(ValueError, match="max-batch"):
        parse("--max-batch", "0")


def test_a_body_too_large_or_a_foreign_host_answers_in_the_routes_own_error_shape():
    """The middleware's refusals (413, an unknown Host) come as the route family's errors do:
    Anthropic's on /v1/messages, Ollama's on /api/*, OpenAI's elsewhere."""
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 1}
    with serve(max_body_bytes=2000) as srv:
        def chunks():   # no Content-Length: the limit is found while reading
            yield json.dumps(big).encode()

        for send in (lambda path: httpx.post(srv.url + path, json=big),
                     lambda path: httpx.post(srv.url + path, content=chunks(),
                                             headers={"Content-Type": "application/json"})):
            r = send("/v1/messages")
            assert r.status_code == 413 and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == "request_too_large"
            r = send("/v1/messages/count_tokens")
            assert r.status_code == 413 and r.json()["type"] == "error", r.text
            r = send("/api/chat")
            assert r.status_code == 413 and "request body too large" in r.json()["error"], r.text
            r = send("/v1/chat/completions")
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        r = httpx.post(srv.url + "/v1/messages", json=big, headers={"Host": "evil.example"})
        assert r.status_code == 400 and r.json()["type"] == "error" and "unknown Host" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/api/chat", json=big, headers={"Host": "evil.example"})
        assert r.status_code == 400 and "unknown Host" in r.json()["error"]


def test_an_empty_or_broken_body_says_so():
    with serve() as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", content=b"", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is empty: send a JSON object"
        r = httpx.post(srv.url + "/api/chat", content=b'{"model": "x", "messages": [', headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"].startswith("the request body is not valid JSON (")


@pytest.mark.parametrize("loc, body, path", [
    (["messages", 0, "content", 0, "text", "text"], {"messages": [{"content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),                       # a tagged union's tag before the field it names
    (["messages", 0, "content", 0, "text", "text"], {"messages": [{"content": [{"type": "text", "txt": "x"}]}]},
     "messages.0.content.0.text"),                       # ... before a missing field
    (["tools", 0, "function", "name"], {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),                           # a field named as the type is a field
    (["tools", 0, "function", "name"], {"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name"),
    (["input", 0, "MessageItem", "role"], {"input": [{"role": "x"}]}, "input.0.role"),
    (["messages", 0, "content", "str"], {"messages": [{"content": 5}]}, "messages.0.content"),
    (["messages"], {}, "messages"),
    ([], None, ""),
])
def test_an_error_location_is_the_request_s_own_field_path(loc, body, path):
    from localheap.server.errors import _field_path

    assert ".".join(_field_path(loc, body)) == path
