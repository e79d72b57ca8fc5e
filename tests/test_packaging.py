"""The wheel holds every package, ships kernels as localheap.kernels, and its data files."""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def listed_packages():
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_package_directory_is_listed():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "localheap").rglob("__init__.py")}
    for mapped in ("kernels", "web"):
        found |= {"localheap." + ".".join(p.parent.relative_to(ROOT).parts)
                  for p in (ROOT / mapped).rglob("__init__.py")}
    assert found == listed_packages()


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build offline")
def test_wheel_contents(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("localheap-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "localheap/models.toml" in names
    assert "localheap/kernels/__init__.py" in names
    assert not any(n.startswith("kernels/") for n in names), "kernels must not shadow a top-level package"
    for pkg in listed_packages():
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    if (ROOT / "web" / "index.html").exists():
        assert "localheap/web/index.html" in names
    vendored = [p.relative_to(ROOT / "web").as_posix() for p in (ROOT / "web" / "vendor").glob("*") if p.is_file()]
    missing = [v for v in vendored if f"localheap/web/{v}" not in names]
    assert missing == [], f"vendored browser libraries not in the wheel: {missing}"
