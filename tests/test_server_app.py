"""App wiring without a model: web UI hook, CORS, settings parsing, the serve command."""

from __future__ import annotations

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


def test_cors_allows_only_the_servers_own_origin_unless_configured():
    settings = ServerSettings(port=8000, web_dir=None, cors_origins=["http://tools.example"])
    with TestClient(create_app(FakeBackend(), settings), base_url="http://127.0.0.1:8000") as client:
        def preflight(origin):
            return client.options("/v1/models", headers={"Origin": origin, "Access-Control-Request-Method": "GET"})

        assert preflight("http://127.0.0.1:8000").headers.get("access-control-allow-origin") == "http://127.0.0.1:8000"
        assert preflight("http://tools.example").status_code == 200
        assert "access-control-allow-origin" not in preflight("http://evil.example").headers


def test_serve_without_a_model_or_demo_exits_2_with_a_message(monkeypatch, capsys):
    """An installation without the bundled demo model: `serve` says what to pass, no traceback."""
    import localheap.models
    from localheap.cli import main

    monkeypatch.setattr(localheap.models, "demo_model_dir", lambda: None)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "localheap: error:" in err and "--model" in err and "Traceback" not in err


def test_serve_with_no_model_serves_the_bundled_demo(tmp_path):
    """The README's serve command, after its install step: no --model -> the demo model answers."""
    import socket
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "localheap.cli", "serve", "--port", str(port), "--no-persist",
           "--sessions-dir", str(tmp_path), "--log-level", "warning"]
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
    finally:
        proc.terminate()
        proc.wait(timeout=60)
