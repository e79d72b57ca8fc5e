"""Waiting for a `localheap serve` subprocess that a test started."""

import subprocess
import time

import httpx


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Return once GET url/health answers 200; raise with the server's output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")
