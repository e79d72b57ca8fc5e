"""Security of `serve` (issue 12): Host header checked against the bound address (DNS
rebinding), sessions owned by the API key that created them, 500 bodies without internals,
only the UI's files served. Fake backend, real uvicorn on loopback."""

from __future__ import annotations

import logging

import httpx
import pytest
from test_engine import FakeBackend

from localheap.server import ServerSettings, create_app
from localheap.server.settings import package_web_dir
from localheap.server.testing import ServerThread

MODEL = FakeBackend.model_name
ALICE, BOB = "alice-key-0001", "bob-key-0002"


def serve(backend=None, **settings) -> ServerThread:
    settings.setdefault("web_dir", None)
    return ServerThread(create_app(backend or FakeBackend(), ServerSettings(**settings)))


def test_a_rebinding_host_header_is_refused():
    with serve() as srv:
        port = srv.port
        for host in (f"evil.example:{port}", "evil.example", f"localhost.evil.example:{port}", "localhost:abc",
                     f"evil.example:{port}:localhost"):
            r = httpx.get(srv.url + "/v1/models", headers={"Host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
            assert "evil" not in httpx.get(srv.url + "/health").text
        # this machine's names on another port: a forward of the server (ssh -L 9000:localhost:PORT)
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"LOCALHOST:{port}", "localhost",
                     "localhost:9000", "127.0.0.1:9000", "[::1]:9000"):
            assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    with serve(allowed_hosts=["box.lan"]) as srv:   # --allow-host: a proxy's name, any port
        assert httpx.get(srv.url + "/v1/models", headers={"Host": "box.lan:443"}).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"Host": "evil.example"}).status_code == 400
    with serve(host="0.0.0.0") as srv:               # --host 0.0.0.0: opened up on purpose, no check
        assert httpx.get(srv.url + "/v1/models", headers={"Host": "box.lan"}).status_code == 200


def completion(srv, key, prompt, session=None, max_tokens=1):
    headers = {"Authorization": f"Bearer {key}"}
    if session:
        headers["X-Session-Id"] = session
    return httpx.post(srv.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})


def test_a_key_sees_and_reuses_only_its_own_sessions():
    history = "a private history that only alice has typed"
    with serve(api_keys=[ALICE, BOB]) as srv:
        def get(key, path):
            return httpx.get(srv.url + path, headers={"Authorization": f"Bearer {key}"})

        r = completion(srv, ALICE, history)
        assert r.status_code == 200, r.text
        sid = r.headers["X-Session-Id"]
        assert [s["id"] for s in get(ALICE, "/v1/sessions").json()["data"]] == [sid]
        assert get(BOB, "/v1/sessions").json()["data"] == []
        assert get(BOB, f"/v1/sessions/{sid}").status_code == 404
        assert completion(srv, BOB, " and more", session=sid).status_code == 404
        bob = {"Authorization": f"Bearer {BOB}"}
        assert httpx.post(f"{srv.url}/v1/sessions/{sid}/documents", headers=bob, json={"text": "x"}).status_code == 404
        assert httpx.post(f"{srv.url}/v1/sessions/{sid}/spill", headers=bob).status_code == 404
        assert httpx.delete(f"{srv.url}/v1/sessions/{sid}", headers=bob).status_code == 404
        # a guessed history matches nothing of alice's: no cached tokens, a session of bob's own
        guess = completion(srv, BOB, history + " and more")
        assert guess.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert guess.headers["X-Session-Id"] != sid
        with httpx.stream("GET", srv.url + "/v1/heap/events", headers=bob, params={"interval": 0.1}) as s:
            data = next(line for line in s.iter_lines() if line.startswith("data:"))
        assert sid not in data
        # alice's own resent history still reuses her session
        mine = completion(srv, ALICE, history + " and more")
        assert mine.headers["X-Session-Id"] == sid
        assert mine.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history)
        assert get(ALICE, f"/v1/sessions/{sid}").status_code == 200
        assert httpx.get(srv.url + "/v1/sessions", headers={"Authorization": "Bearer nobody"}).status_code == 401


class LeakyBackend(FakeBackend):
    """Fails with an exception whose text names a path, as a failing disk write would."""

    def prefill(self, cache, tokens, progress=None, cancelled=None):
        raise OSError("[Errno 28] No space left on device: '/home/someone/secret/sess_1.safetensors'")


def test_500_bodies_carry_no_internals_and_the_log_has_them(caplog):
    with serve(LeakyBackend()) as srv, caplog.at_level(logging.ERROR, logger="localheap.server"):
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "internal_error" and "reference" in err["message"]
        for leak in ("secret", "/home", "OSError", "Errno", "safetensors"):
            assert leak not in r.text, leak
        ref = err["message"].split("reference ")[1].split(";")[0]
        assert any(ref in rec.getMessage() and rec.exc_info for rec in caplog.records)
        with httpx.stream("POST", srv.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}) as s:
            body = s.read().decode()
        assert "internal_error" in body and "secret" not in body and "OSError" not in body


@pytest.mark.skipif(package_web_dir() is None, reason="no web UI in this installation")
def test_only_the_ui_files_are_served():
    with serve(web_dir=package_web_dir()) as srv:
        assert (package_web_dir() / "__init__.py").exists()   # the file the issue found served
        for path in ("/", "/index.html", "/app.js", "/style.css"):
            assert httpx.get(srv.url + path).status_code == 200, path
        for path in ("/__init__.py", "/__pycache__/", "/.gitignore", "/app.js.bak", "/%2e%2e/pyproject.toml",
                     "/../localheap/server/app.py"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 404, (path, r.status_code)


def test_keys_come_from_the_environment_a_file_or_the_command_line_with_a_warning(tmp_path, monkeypatch, capsys):
    from localheap.cli import build_parser
    from localheap.commands.serve import settings_from_args

    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nfile-key-1\n\nfile-key-2\n")
    monkeypatch.setenv("LOCALHEAP_API_KEY", "env-key-0")
    args = build_parser().parse_args(["serve", "--api-keys-file", str(keys_file)])
    assert settings_from_args(args).keys == ["env-key-0", "file-key-1", "file-key-2"]
    assert "warning" not in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--api-key", "cli-key-1", "--api-key", "cli-key-2"])
    assert settings_from_args(args).keys == ["env-key-0", "cli-key-1", "cli-key-2"]
    err = capsys.readouterr().err
    assert "warning" in err and "LOCALHEAP_API_KEY" in err and "cli-key" not in err


def test_a_keys_file_without_a_key_refuses_to_start_rather_than_serve_open(tmp_path, monkeypatch):
    from localheap.cli import build_parser, main
    from localheap.commands.serve import settings_from_args

    monkeypatch.delenv("LOCALHEAP_API_KEY", raising=False)
    keys_file = tmp_path / "keys"
    for text in ("", "\n\n", "# the team's keys go here\n   \n  # none yet\n"):
        keys_file.write_text(text)
        args = build_parser().parse_args(["serve", "--api-keys-file", str(keys_file)])
        with pytest.raises(ValueError, match="holds no key"):
            settings_from_args(args)
    # the command says so and exits before loading a model
    assert main(["serve", "--api-keys-file", str(keys_file), "--port", "1"]) == 2
    monkeypatch.setenv("LOCALHEAP_API_KEY", "env-key-0")   # another key does not make an empty file right
    args = build_parser().parse_args(["serve", "--api-keys-file", str(keys_file)])
    with pytest.raises(ValueError, match="holds no key"):
        settings_from_args(args)
