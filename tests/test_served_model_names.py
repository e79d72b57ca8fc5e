"""--served-model-name (vLLM's flag): the model answers to each name given, replies and /v1/models
carry them (the first in replies), its own name and any other is a 404, on the OpenAI, Anthropic,
Ollama (name and name:latest) and llama.cpp routes; the flag's parsing."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from localheap.models import demo_model_dir, load_backend
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    backend = load_backend(str(demo_model_dir()), "torch")
    settings = ServerSettings(web_dir=None, served_model_names=["gpt-4o", "local"], default_max_tokens=4)
    with ServerThread(create_app(backend, settings)) as srv:
        yield srv


def _chat(srv, model, path="/v1/chat/completions"):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    body.update({"options": {"num_predict": 2}} if path.startswith("/api") else {"max_tokens": 2})
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_each_name_answers_and_replies_carry_the_first(server):
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["gpt-4o", "local"]
    assert httpx.get(server.url + "/v1/models/local", timeout=10).json()["id"] == "local"
    for name in ("gpt-4o", "local", None):
        r = _chat(server, name)
        assert r.status_code == 200 and r.json()["model"] == "gpt-4o", r.text
    own = server.services.backend.model_name
    for name in (own, "gpt-5"):
        r = _chat(server, name)
        assert r.status_code == 404 and "'gpt-4o' or 'local'" in r.json()["error"]["message"]
    assert _chat(server, "local", "/v1/messages").json()["model"] == "gpt-4o"
    assert _chat(server, own, "/v1/messages").status_code == 404


def test_ollama_routes_take_each_name_and_its_tag(server):
    tags = httpx.get(server.url + "/api/tags", timeout=10).json()["models"]
    assert [t["name"] for t in tags] == ["gpt-4o:latest", "local:latest"]
    for name in ("local", "local:latest", "gpt-4o:latest"):
        r = _chat(server, name, "/api/chat")
        assert r.status_code == 200, r.text
    assert _chat(server, server.services.backend.model_name, "/api/chat").status_code == 404


def test_a_name_with_a_wildcard_matches_names_and_is_not_listed(tmp_path):
    """`claude-*` (Claude Code asks for its small model by Claude's name): any matching name is
    answered, on the Anthropic, OpenAI and Ollama routes; /v1/models lists the plain names only;
    a name it does not match is still a 404 naming the pattern too."""
    from localheap.models import demo_model_dir, load_backend
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    backend = load_backend(str(demo_model_dir()), "torch")
    settings = ServerSettings(web_dir=None, served_model_names=["local", "claude-*"], default_max_tokens=4)
    with ServerThread(create_app(backend, settings)) as srv:
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]] == ["local"]
        for path in ("/v1/messages", "/v1/chat/completions", "/api/chat"):
            r = _chat(srv, "claude-haiku-4-5-20251001", path)
            assert r.status_code == 200, r.text
        assert _chat(srv, "claude-haiku-4-5", "/v1/messages").json()["model"] == "local"
        r = _chat(srv, "gpt-4o")
        assert r.status_code == 404 and "'local' or 'claude-*'" in r.json()["error"]["message"]
    only = ServerSettings(web_dir=None, served_model_names=["claude-*"], default_max_tokens=4)
    with ServerThread(create_app(backend, only)) as srv:   # patterns alone: the model's own name is listed
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]] == [backend.model_name]


def test_the_flag():
    from localheap.cli import build_parser
    from localheap.commands.serve import settings_from_args

    parse = lambda *flags: settings_from_args(build_parser().parse_args(["serve", *flags]))   # noqa: E731
    assert parse().served_model_names == []
    assert parse("--served-model-name", "a", "b", "a").served_model_names == ["a", "b"]
    with pytest.raises(ValueError, match="non-empty"):
        parse("--served-model-name", " ")
