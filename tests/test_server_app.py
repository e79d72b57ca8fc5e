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
    with TestClient(create_app(FakeBackend(), ServerSettings(web_dir=tmp_path))) as client:
        assert client.get("/").text == "<h1>heap</h1>"
        assert client.get("/health").json()["status"] == "ok"
        missing = client.get("/v1/unknown")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    with TestClient(create_app(FakeBackend(), ServerSettings(web_dir=None))) as client:
        assert client.get("/").json()["api"] == "/v1"


def test_cors_allows_only_the_servers_own_origin_unless_configured():
    settings = ServerSettings(port=8000, web_dir=None, cors_origins=["http://tools.example"])
    with TestClient(create_app(FakeBackend(), settings)) as client:
        def preflight(origin):
            return client.options("/v1/models", headers={"Origin": origin, "Access-Control-Request-Method": "GET"})

        assert preflight("http://127.0.0.1:8000").headers.get("access-control-allow-origin") == "http://127.0.0.1:8000"
        assert preflight("http://tools.example").status_code == 200
        assert "access-control-allow-origin" not in preflight("http://evil.example").headers


def test_serve_without_a_model_exits_2_with_a_message():
    from localheap.models import demo_model_dir

    if demo_model_dir() is not None:
        pytest.skip("a demo model ships with this installation: serve would start")
    r = subprocess.run([sys.executable, "-m", "localheap.cli", "serve"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "localheap: error:" in r.stderr and "--model" in r.stderr
