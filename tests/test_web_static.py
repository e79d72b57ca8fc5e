"""The web UI's files without a browser: every asset ships with the package, every reference
is local (the page works offline: no CDN), and the server hands each one out with a type the
browser accepts (module scripts need a JavaScript MIME type)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "web"
TYPES = {".html": "text/html", ".css": "text/css", ".js": "javascript", ".svg": "image/svg+xml"}


def assets() -> list[Path]:
    return sorted(p for p in WEB.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.name != "__init__.py")


def local_references() -> dict[Path, set[str]]:
    """file -> the paths it loads (src/href in HTML, url() in CSS, imports in JS)."""
    patterns = {
        ".html": r'(?:src|href)="([^"#]+)"',
        ".css": r'url\(\s*["\']?([^"\')]+)',
        ".js": r'(?:^|\s)(?:import|export)\s[^;]*?from\s+"([^"]+)"|import\(\s*"([^"]+)"\s*\)',
    }
    refs = {}
    for path in assets():
        if path.suffix in patterns:
            found = re.findall(patterns[path.suffix], path.read_text(), flags=re.M)
            refs[path] = {r if isinstance(r, str) else next(x for x in r if x) for r in found}
    return refs


def test_every_asset_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["localheap.web"]
    missing = [p.relative_to(WEB).as_posix() for p in assets()
               if not any(fnmatch.fnmatch(p.relative_to(WEB).as_posix(), g) for g in globs)]
    assert missing == [], f"not shipped by package-data {globs}: {missing}"
    assert (WEB / "index.html").exists() and (WEB / "__init__.py").exists()


def test_references_are_local_and_exist():
    refs = local_references()
    assert refs[WEB / "index.html"] >= {"style.css", "app.js", "favicon.svg"}
    for path, targets in refs.items():
        for target in targets:
            assert not re.match(r"^([a-z]+:)?//", target, re.I), f"{path.name} loads {target} from the network"
            assert (path.parent / target).resolve().is_file(), f"{path.name} loads {target}, which is missing"


def test_no_script_reaches_for_another_origin():
    for path in assets():
        if path.suffix == ".js":
            text = path.read_text()
            assert not re.search(r'fetch\(\s*["\'`]https?:', text), path.name
            assert "new WebSocket(" not in text and "new EventSource(\"http" not in text, path.name


def test_the_server_serves_every_asset_with_its_type():
    from test_engine import FakeBackend

    from localheap.server import ServerSettings, create_app

    with TestClient(create_app(FakeBackend(), ServerSettings(web_dir=WEB)), base_url="http://127.0.0.1:8000") as client:
        index = client.get("/")
        assert index.status_code == 200 and "<title>localheap</title>" in index.text
        for path in assets():
            if path.suffix in TYPES:
                r = client.get("/" + path.relative_to(WEB).as_posix())
                assert r.status_code == 200, path.name
                assert TYPES[path.suffix] in r.headers["content-type"], (path.name, r.headers["content-type"])


@pytest.mark.parametrize("name", ["app.js", "chat.js", "heapview.js", "markdown.js"])
def test_replies_are_never_written_as_raw_html(name):
    """innerHTML only ever receives renderMarkdown output (which escapes first)."""
    text = (WEB / name).read_text()
    for line in text.splitlines():
        if re.search(r"\.(innerHTML|outerHTML)\s*=|insertAdjacentHTML\(", line):
            assert "renderMarkdown(" in line, f"{name}: {line.strip()}"
