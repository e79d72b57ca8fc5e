"""App wiring without a model: web UI hook, CORS, settings parsing, the serve command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from test_engine import FakeBackend

from localheap.server import ServerSettings, create_app, parse_bytes


def test_parse_bytes():
    assert parse_bytes("12G") == 12 << 30 and parse_bytes("512M") == 512 << 20
    assert parse_bytes("4096") == 4096 and parse_bytes("1.5g") == 3 << 29 and parse_bytes("64MiB") == 64 << 20
    with pytest.raises(ValueError):
        parse_bytes("12Q")


def test_web_dir_is_served_at_root(tmp_path):
    (tmp_path / "index.html").write_text("<h1>heap</h1>")
    with TestClient(create_app(FakeBackend(), ServerSettings(web_dir=tmp_path)), base_url="http://127.0.0.1:8000") as client:
        assert client.get("/").text == "<h1>heap</h1>"
        assert client.get("/health").json()["status"] == "ok"
        missing = client.get("/v1/unknown")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    with TestClient(create_app(FakeBackend(), ServerSettings(web_dir=None)), base_url="http://127.0.0.1:8000") as client:
        assert client.get("/").json()["api"] == "/v1"


LOCAL = "http://127.0.0.1:8000"   # the Host the server answers (others: 400, DNS rebinding)


def test_unknown_routes_answer_404_for_every_method(tmp_path):
    (tmp_path / "index.html").write_text("<h1>heap</h1>")
    (tmp_path / "app.js").write_text("1")
    for web_dir in (tmp_path, None):
        with TestClient(create_app(FakeBackend(), ServerSettings(web_dir=web_dir)), base_url=LOCAL) as client:
            for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
                r = client.request(method, "/v1/no-such-route")
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, web_dir)
            assert client.put("/v1/chat/completions").status_code == 405   # a known route, a wrong method
    with TestClient(create_app(FakeBackend(), ServerSettings(web_dir=tmp_path)), base_url=LOCAL) as client:
        assert client.post("/app.js").status_code == 405 and client.post("/").status_code == 405


def test_cors_allows_only_the_servers_own_origin_unless_configured():
    settings = ServerSettings(port=8000, web_dir=None, cors_origins=["http://tools.example"])
    with TestClient(create_app(FakeBackend(), settings), base_url="http://127.0.0.1:8000") as client:
        def preflight(origin):
            return client.options("/v1/models", headers={"Origin": origin, "Access-Control-Request-Method": "GET"})

        assert preflight("http://127.0.0.1:8000").headers.get("access-control-allow-origin") == "http://127.0.0.1:8000"
        assert preflight("http://tools.example").status_code == 200
        assert "access-control-allow-origin" not in preflight("http://evil.example").headers


def test_a_web_page_of_another_site_cannot_post_to_the_server_without_a_preflight():
    """A page elsewhere posts text/plain (no preflight, so CORS would not stop it running): 403 in
    each API's own error shape, logged once; the server's own page, a configured origin, an
    extension's, a reverse proxy's name and programs that send no Origin are served."""
    settings = ServerSettings(port=8000, web_dir=None, cors_origins=["http://tools.example"])
    body = '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    completion = '{"model": "fake-model", "prompt": "hi", "max_tokens": 2}'
    with TestClient(create_app(FakeBackend(), settings), base_url=LOCAL) as client:
        def post(path, origin=None, content=body, **headers):
            headers = {"Content-Type": "text/plain", **({"Origin": origin} if origin else {}), **headers}
            return client.post(path, content=content, headers=headers)

        for origin in ("http://evil.example", "https://127.0.0.1:8000.evil.example", "null", "http://localhost:3000"):
            r = post("/v1/chat/completions", origin)
            assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_refused", (origin, r.text)
            assert f"--cors-origin {origin}" in r.json()["error"]["message"]
        ollama = post("/api/generate", "http://evil.example", '{"model": "fake-model", "prompt": "x", "stream": false}')
        assert ollama.status_code == 403 and "another site" in ollama.json()["error"]   # Ollama's {"error": text}
        anthropic = post("/v1/messages", "http://evil.example")
        assert anthropic.status_code == 403 and anthropic.json()["error"]["type"] == "permission_error"
        assert post("/slots/0?action=erase", "http://evil.example").status_code == 403
        assert client.get("/v1/models", headers={"Origin": "http://evil.example"}).status_code == 200   # reads: CORS

        json = {"Content-Type": "application/json"}
        for origin, extra in (("http://127.0.0.1:8000", {}), ("http://tools.example/", {}), (None, {}),
                              ("chrome-extension://abcdefgh", {}), ("moz-extension://1234", {}),
                              ("https://chat.example.com", {"X-Forwarded-Host": "chat.example.com"})):
            r = post("/v1/completions", origin, completion, **json, **extra)
            assert r.status_code == 200, (origin, r.text)
    settings = ServerSettings(port=8000, web_dir=None, cors_origins=["*"])
    with TestClient(create_app(FakeBackend(), settings), base_url=LOCAL) as client:
        r = client.post("/v1/completions", content=completion, headers={"Origin": "http://evil.example", **json})
        assert r.status_code == 200


def test_api_bodies_are_read_as_json_whatever_their_content_type_says():
    """`curl -d '{...}'` labels its JSON a form: read as JSON (llama-server and Ollama do), and a body
    that is not JSON says so, in place of pydantic's "Input should be a valid dictionary"."""
    with TestClient(create_app(FakeBackend(), ServerSettings(port=8000, web_dir=None)), base_url=LOCAL) as client:
        for kind in ("application/x-www-form-urlencoded", "text/plain; charset=utf-8", None):
            headers = {"Content-Type": kind} if kind else {}
            r = client.post("/v1/completions", content='{"model": "fake-model", "prompt": "hi", "max_tokens": 2}',
                            headers=headers)
            assert r.status_code == 200, (kind, r.text)
            r = client.post("/tokenize", content='{"content": "hi"}', headers=headers)
            assert r.status_code == 200 and r.json()["tokens"], (kind, r.text)
            r = client.post("/v1/completions", content="prompt=hi&max_tokens=2", headers=headers)
            assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid", (kind, r.text)


def test_serve_without_a_model_or_demo_exits_2_with_a_message(monkeypatch, capsys):
    """An installation without the bundled demo model: `serve` says what to pass, no traceback."""
    import localheap.models
    from localheap.cli import main

    monkeypatch.setattr(localheap.models, "demo_model_dir", lambda: None)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "localheap: error:" in err and "--model" in err and "Traceback" not in err


def test_serve_with_no_model_serves_the_bundled_demo(tmp_path):
    """The README's serve command, after its install step: no --model -> the demo model answers.
    With --no-persist, --sessions-dir holds the sessions' temporary directory, removed at exit,
    and what it held before is left alone."""
    import time

    import httpx

    from server_process import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "localheap.cli", "serve", "--port", str(port), "--no-persist",
           "--sessions-dir", str(tmp_path), "--log-level", "warning"]
    (tmp_path / "index.json").write_text("a persisting server's")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["demo"]
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "demo", "max_tokens": 8, "temperature": 0,
                             "messages": [{"role": "user", "content": "The pass key is 40213. What is the pass key?"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 1
        scratch = [p for p in tmp_path.iterdir() if p.name.startswith("localheap-sessions-")]
        assert len(scratch) == 1 and scratch[0].is_dir(), list(tmp_path.iterdir())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]   # its own removed, nothing else
    assert (tmp_path / "index.json").read_text() == "a persisting server's"


def test_a_port_that_is_taken_or_no_port_fails_before_the_model_loads(monkeypatch, capsys):
    import socket

    import localheap.models
    from localheap.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(localheap.models, "load_backend", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--no-persist"]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "--port N" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "99999"])
    assert e.value.code == 2 and "'99999' is not a TCP port (0-65535)" in capsys.readouterr().err


def test_a_server_open_to_the_network_without_an_api_key_says_so_at_start(monkeypatch, capsys):
    import localheap.models
    from localheap.cli import main

    def stop(*a, **k):
        raise localheap.models.ModelNotFound("stopped before loading")

    monkeypatch.setattr(localheap.models, "load_backend", stop)
    monkeypatch.delenv("LOCALHEAP_API_KEY", raising=False)
    said = {}
    for host, key in (("0.0.0.0", None), ("0.0.0.0", "k1"), ("127.0.0.1", None), ("192.168.1.5", None),
                      ("127.0.0.2", None), ("::1", None), ("localhost", None), ("box.lan", None)):
        if key:
            monkeypatch.setenv("LOCALHEAP_API_KEY", key)
        else:
            monkeypatch.delenv("LOCALHEAP_API_KEY", raising=False)
        assert main(["serve", "--host", host, "--port", "0", "--no-persist"]) == 2
        said[(host, key)] = "no API key is set" in capsys.readouterr().err
    assert said == {("0.0.0.0", None): True, ("0.0.0.0", "k1"): False, ("127.0.0.1", None): False,
                    ("192.168.1.5", None): True, ("127.0.0.2", None): False, ("::1", None): False,
                    ("localhost", None): False, ("box.lan", None): True}


def test_a_second_server_on_a_sessions_directory_in_use_is_refused_until_the_first_is_gone(tmp_path, monkeypatch, capsys):
    """Two servers on one sessions directory would restore the same sessions and write over each
    other's index: the second is refused, naming the first, before its model loads (an in-memory
    real shape's too; a rank of --distributed, whose launcher names its rank: its own lock); once
    the first is gone (kill -9 included) the directory is free."""
    def hold(path, name="serve.lock"):
        """A process that holds `path`'s lock `name` as a server on port 8123 would."""
        return subprocess.Popen([sys.executable, "-c", (
            "import sys, time; from pathlib import Path; from types import SimpleNamespace\n"
            "from localheap.commands.serve import lock_sessions_dir\n"
            "held = lock_sessions_dir(Path(sys.argv[1]), sys.argv[2], SimpleNamespace(host='127.0.0.1', port=8123))\n"
            "print('held', flush=True); time.sleep(600)"), str(path), name], stdout=subprocess.PIPE, text=True)

    holder = hold(tmp_path)
    import localheap.models
    from localheap.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the sessions directory was found in use")

    monkeypatch.setattr(localheap.models, "load_backend", no_load)
    monkeypatch.setenv("LOCALHEAP_CACHE", str(tmp_path / "cache"))
    default = tmp_path / "cache" / "sessions" / "demo"   # the demo model's default directory
    default.mkdir(parents=True)
    from localheap import randbig
    from localheap.commands.serve import default_sessions_dir
    real = default_sessions_dir(randbig.model_name("llama:8b"))   # (an 8B shape built in memory: not twice)
    real.mkdir(parents=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for flags, where in ((["--sessions-dir", str(tmp_path)], tmp_path), ([], default),
                             (["--model", "random:llama:8b"], real)):
            if where != tmp_path:
                holder.kill()
                holder.wait()
                holder = hold(where)
                assert holder.stdout.readline().strip() == "held"
            assert main(["serve", *flags, "--port", "0"]) == 2   # refused before the model loads (no_load)
            err = capsys.readouterr().err
            assert (f"the sessions directory {where} is in use by another localheap serve (pid {holder.pid}, "
                    f"http://127.0.0.1:8123): stop that one") in err, err
            assert not (where / "index.json").exists()   # nothing restored, nothing written
        holder.kill()
        holder.wait()
        holder = hold(tmp_path, "serve.rank1.lock")
        assert holder.stdout.readline().strip() == "held"
        from localheap.commands import ranks
        monkeypatch.setattr(ranks, "load_rank", no_load)   # (its shard: no mlx needed to be refused before it)
        monkeypatch.setenv("MLX_RANK", "1")
        assert main(["serve", "--distributed", "tensor", "--sessions-dir", str(tmp_path), "--port", "0"]) == 2
        assert f"the sessions directory {tmp_path} is in use by another localheap serve (pid {holder.pid}" \
            in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    from types import SimpleNamespace

    from localheap.commands import serve

    lock = serve.lock_sessions_dir(tmp_path, "serve.lock", SimpleNamespace(host="127.0.0.1", port=8124))   # free
    try:
        assert (tmp_path / "serve.lock").read_text() == f"pid {os.getpid()}, http://127.0.0.1:8124\n"
        assert (tmp_path / "serve.lock").stat().st_mode & 0o777 == 0o600
    finally:
        lock.close()
    serve.lock_sessions_dir(tmp_path, "serve.lock", SimpleNamespace(host="127.0.0.1", port=8125)).close()


def test_a_page_of_another_site_cannot_hold_the_heap_stream_nor_send_compressed_bodies():
    """A GET needs no preflight: a page elsewhere opening /v1/heap/events (its browser's no-cors GET sends
    Sec-Fetch-Site, no Origin) held one of the few observer slots until the web UI's own was refused; it
    is a 403 now, as one with a foreign Origin. A gzip body is a 415 that says so (it was "not UTF-8").
    With an API key, FastAPI's /docs and /openapi.json want the key as the API does."""
    import asyncio

    from localheap.server.middleware import CheckOrigin

    def opened(headers: dict) -> int:   # (the middleware alone: the stream itself never ends)
        sent = []

        async def stream(scope, receive, send):
            sent.append(200)

        async def send(message):
            if message["type"] == "http.response.start":
                sent.append(message["status"])

        scope = {"type": "http", "method": "GET", "path": "/v1/heap/events",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in {"Host": "127.0.0.1:8000", **headers}.items()]}
        asyncio.run(CheckOrigin(stream, [])(scope, None, send))
        return sent[0]

    assert opened({"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}) == 403
    assert opened({"Origin": "http://evil.example"}) == 403
    assert opened({"Sec-Fetch-Site": "same-origin", "Origin": "http://127.0.0.1:8000"}) == 200 == opened({})
    settings = ServerSettings(port=8000, web_dir=None)
    with TestClient(create_app(FakeBackend(), settings), base_url=LOCAL) as client:
        r = client.post("/v1/chat/completions", content=b"\x1f\x8b\x08\x00", headers={"Content-Encoding": "gzip"})
        assert r.status_code == 415 and "Content-Encoding 'gzip'" in r.json()["error"]["message"], r.text
    settings = ServerSettings(port=8000, web_dir=None, api_keys=["k"])
    with TestClient(create_app(FakeBackend(), settings), base_url=LOCAL) as client:
        assert client.get("/openapi.json").status_code == 401 and client.get("/docs").status_code == 401
        assert client.get("/openapi.json", headers={"Authorization": "Bearer k"}).status_code == 200


def test_choices_that_wait_for_a_slot_do_not_stop_the_first_as_a_client_not_reading():
    """n: 2 on one slot: choice 1 waits for choice 0's slot, and choice 0's events wait unread until then;
    they are not a client that stopped reading (choice 0 came back cut, "stop", at 1,024 characters)."""
    settings = ServerSettings(web_dir=None, max_active=1)
    with TestClient(create_app(FakeBackend(), settings), base_url=LOCAL) as client:
        r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "n": 2, "max_tokens": 1500})
        assert [(c["finish_reason"], len(c["text"])) for c in r.json()["choices"]] == [("length", 1500)] * 2, r.text


def test_a_chat_template_that_does_not_compile_is_refused_at_start(model_dirs, caplog):
    """Every chat was a 400 blaming the client ("the model's chat template refused these messages"), nothing
    said at start: a template that does not compile stops the start, naming it; one that fails on a plain
    user message is warned of."""
    import logging

    from transformers import AutoTokenizer

    backend = FakeBackend()
    backend.tokenizer = AutoTokenizer.from_pretrained(str(model_dirs("llama")))
    backend.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }{% endfor %}"
    with pytest.raises(ValueError, match="chat template does not compile"):
        create_app(backend, ServerSettings(web_dir=None))
    backend.tokenizer.chat_template = "{{ raise_exception('only system messages') }}"
    with caplog.at_level(logging.WARNING, "localheap.server"):
        create_app(backend, ServerSettings(web_dir=None))
    assert "fails on a plain user message" in caplog.text
