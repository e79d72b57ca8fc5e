"""Starting a `localheap serve` (or an MLX rank) subprocess from a test: its ports, and waiting
until it answers."""

import itertools
import os
import random
import socket
import subprocess
import time

import httpx
import psutil

PORTS_PER_WORKER = 1000


def _port_block() -> range:
    """This pytest process's ports: below the kernel's ephemeral range (where a client connection's
    own port, and bind(0)'s, come from), a block of its own per pytest-xdist worker."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    top = min(low, 32768) - index * PORTS_PER_WORKER
    return range(max(1024, top - PORTS_PER_WORKER), top)


_BLOCK = _port_block()
_START = random.randrange(len(_BLOCK)) if _BLOCK else 0   # (not the ports an earlier run's servers may hold)
_NEXT = itertools.cycle([*_BLOCK[_START:], *_BLOCK[:_START]])


def free_ports(n: int = 1) -> list[int]:
    """`n` ports that are free now, for servers and rings a test starts: from this worker's block
    (_port_block), not from bind(0). A port bind(0) hands out is free only until the process that
    asked lets it go, and a server binds it seconds later, once its model is loaded: meanwhile
    another worker's bind(0) can get the same one (its server then answers the first test's
    requests), or a client connection can take it as its own port."""
    ports: list[int] = []
    for port in itertools.islice(_NEXT, len(_BLOCK)):   # (once round the block at most)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:   # in use (another program, or a connection of an earlier test's server)
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    socks = [socket.socket() for _ in range(n - len(ports))]   # no block on this machine: bind(0)
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports += [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` (or a child of it) listens on `port`."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return False
    for p in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="inet")):
                return True
        except psutil.Error:
            continue
    return False


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Return once GET url/health answers 200 from `proc` itself; raise with the server's output if
    it exits first (a server of another test on its port, should one be there, is not taken for it)."""
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200 and listens(proc.pid, port):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")
