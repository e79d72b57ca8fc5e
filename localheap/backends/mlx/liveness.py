"""Is every rank still there? A heartbeat beside the ring: one TCP connection from each follower to rank 0.

MLX's ring collectives cannot be interrupted, and a collective running when a peer dies does not
always fail (MLX 0.32, CPU): rank 0 can wait in it for ever. So each follower keeps a connection
to rank 0 that carries one byte a second each way, and, from rank 0, one byte before each command
it sends (a wake: MLX's ring waits for a collective by polling its socket, so a follower idle in
one would keep a core busy for as long as the server is idle; it waits here for the wake instead,
then enters the collective). A process that ends (kill -9,
a crash, a follower leaving the ring after failing mid-step) has its connection closed by its
kernel: the other side knows at once. A host that vanishes (power, cable) falls silent: known
after `timeout` seconds. Rank 0 reports such a rank lost (`on_lost`); a follower whose rank 0 is
gone exits. No decision goes through here: what the ranks agree on goes through collectives.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("localheap.distributed")
BEAT_S = 1.0        # one byte each way this often
TIMEOUT_S = 30.0    # (default) a rank silent this long is lost
CONNECT_S = 30.0    # a follower's connect at start
BEAT, BYE, WAKE = b".", b"x", b"!"   # BYE: an orderly end, not a loss; WAKE: a command follows
GRACE_S = 2.0       # an orderly close waits this long at most for the peers to close their side
HOST_ENV = "LOCALHEAP_RANK0_HOST"
HELLO = "<iq"   # a follower's first words: its rank and the key rank 0 sent through a collective


def rank0_host(environ=os.environ) -> Optional[str]:
    """The address every rank reaches rank 0 at: HOST_ENV, else what mlx.launch gave the ranks
    (the ring's hostfile, jaccl's coordinator, NCCL's host); None when none says."""
    if environ.get(HOST_ENV):
        return environ[HOST_ENV]
    try:
        if environ.get("MLX_HOSTFILE"):
            with open(environ["MLX_HOSTFILE"]) as f:
                return json.load(f)[0][0].rsplit(":", 1)[0]   # ring: [["ip:port", ...] per rank]
    except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError):
        pass
    for name in ("MLX_JACCL_COORDINATOR", "NCCL_HOST_IP"):
        if environ.get(name):
            return environ[name].rsplit(":", 1)[0] if ":" in environ[name] else environ[name]
    return None


class Heartbeat:
    """Beats to and watches `peers` (rank -> connected socket) on a thread of its own; the first
    sign that a peer is gone calls `on_lost(rank, why)`, once per peer."""

    def __init__(self, peers: dict[int, socket.socket], timeout: float = TIMEOUT_S,
                 on_lost: Optional[Callable[[int, str], None]] = None):
        self.peers = dict(peers)
        self.timeout = timeout
        self.on_lost = on_lost
        self._seen = {r: time.monotonic() for r in self.peers}
        self.gone: dict[int, str] = {}   # rank -> why it counts as lost
        self._any_gone = threading.Event()
        self._closed = threading.Event()
        self._wakes = threading.Semaphore(0)   # a follower: commands rank 0 said it is sending
        self._ended = threading.Event()        # a follower: rank 0 said BYE (its last command follows)
        self._thread = threading.Thread(target=self._run, name="localheap-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def close(self, bye: bool = True) -> None:
        """An orderly end: the peers hear BYE (not a loss), then the connections close. Without
        `bye` the peers see the connection end, as if this process had: a follower then exits.

        After BYE this side stops sending and reads the peer's beats until the peer closes (at
        most GRACE_S): a TCP socket closed with bytes unread sends a reset, not an end, and the
        peer then reads "connection reset" (the BYE possibly lost with it) and takes this orderly
        end for a loss: a follower exited with status 1 at serve's shutdown that way."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(BEAT_S + 1.0)   # its loop ends within a beat: the sockets are this thread's
        deadline = time.monotonic() + GRACE_S
        for s in list(self.peers.values()):
            try:
                if bye:
                    s.sendall(BYE)
                    s.shutdown(socket.SHUT_WR)
                    _read_to_end(s, deadline)
                s.close()
            except OSError:
                s.close()

    def wake(self) -> None:
        """Rank 0, before each command: every follower may enter the command's collective now."""
        for s in list(self.peers.values()):
            try:
                s.sendall(WAKE)
            except OSError:   # gone: the heartbeat's own loop says so
                pass

    def wait_wake(self) -> None:
        """A follower, before it enters the next command's collective: until rank 0 says one
        comes (WAKE), or until no wake can come (rank 0 said BYE, or this heartbeat ended, its
        thread included): then the collective itself waits, as it would without a heartbeat."""
        while not (self._ended.is_set() or self._closed.is_set() or not self.peers) and self._thread.is_alive():
            if self._wakes.acquire(timeout=BEAT_S):
                return

    def wait_gone(self, timeout: float) -> Optional[str]:
        """"rank R WHY" for the first rank found gone, waiting up to `timeout` s for one (a ring
        error may come first: this says which rank it was)."""
        self._any_gone.wait(timeout)
        return next((f"rank {r} {why}" for r, why in self.gone.items()), None)

    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._closed.is_set() and self.peers:
            wait = max(0.0, next_beat - time.monotonic())
            readable, _, _ = select.select(list(self.peers.values()), [], [], wait)
            for rank, s in list(self.peers.items()):   # first what they said (a BYE, an end)
                if s in readable:
                    self._read(rank, s)
            now = time.monotonic()
            if now >= next_beat:   # on a clock of its own: never in answer to a peer's beat
                next_beat = now + BEAT_S
                for rank, s in list(self.peers.items()):
                    try:
                        s.sendall(BEAT)
                    except OSError as e:
                        if not self._said_bye(s):   # it may have ended in order just now
                            self._gone(rank, f"cannot be reached ({e.strerror or e})")
                        else:
                            self.peers.pop(rank).close()
            for rank in [r for r, t in self._seen.items() if r in self.peers and now - t > self.timeout]:
                self._gone(rank, f"was silent for {self.timeout:.0f} s (its host or network is down)")

    @staticmethod
    def _said_bye(s: socket.socket) -> bool:
        try:
            return BYE in s.recv(4096, socket.MSG_DONTWAIT)
        except OSError:
            return False

    def _read(self, rank: int, s: socket.socket) -> None:
        try:
            data = s.recv(4096)
        except OSError as e:
            data, why = b"", f"dropped its connection ({e.strerror or e})"
        else:
            why = "ended (its process is gone: killed, crashed, or it left the ring; see its log)"
        wakes = data.count(WAKE)
        if wakes:
            self._wakes.release(wakes)
        if BYE in data:
            self._ended.set()
            self._wakes.release()   # a wait in progress ends now
            self.peers.pop(rank).close()   # it ended in order
        elif not data:
            self._gone(rank, why)
        else:
            self._seen[rank] = time.monotonic()

    def _gone(self, rank: int, why: str) -> None:
        s = self.peers.pop(rank, None)
        if s is None or self._closed.is_set():
            return
        s.close()
        log.error("heartbeat: rank %d %s", rank, why)
        self.gone[rank] = why
        self._any_gone.set()
        if self.on_lost is not None:
            self.on_lost(rank, why)


def _read_to_end(s: socket.socket, deadline: float) -> None:
    """Read and drop what the peer sends until it closes its side, or until `deadline`."""
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            if not s.recv(4096):
                return
        except OSError:   # the deadline (a timeout), or the peer reset
            return


def connect(ranks, timeout: float = TIMEOUT_S, environ=os.environ) -> Optional[Heartbeat]:
    """Every rank, at start: rank 0 listens on its address, the port and a random key reach the
    followers through collectives, each follower connects and says its rank and the key (rank 0
    closes a connection that does not). Returns this rank's Heartbeat (not started), or None on
    every rank when one of them could not connect (a warning says that a rank's death may then
    leave rank 0 waiting)."""
    host = rank0_host(environ)
    server = None
    if ranks.rank == 0 and host is not None:
        try:
            server = socket.create_server((host, 0))
        except OSError as e:
            log.warning("heartbeat: cannot listen on %s: %s", host, e)
    port = ranks.each(server.getsockname()[1] if server is not None else 0)[0]
    key = ranks.each(secrets.randbits(62) if ranks.rank == 0 else 0)[0]
    mine = None
    if ranks.rank != 0 and port and host is not None:
        try:
            mine = socket.create_connection((host, port), timeout=CONNECT_S)
            mine.sendall(struct.pack(HELLO, ranks.rank, key))
        except OSError as e:
            log.warning("heartbeat: cannot reach rank 0 at %s:%d: %s", host, port, e)
            mine = None
    connected = ranks.each(int(ranks.rank == 0 and server is not None or mine is not None))
    if not all(connected):
        log.warning("heartbeat: off (rank(s) %s could not connect; set %s): a rank that dies mid-step can leave "
                    "rank 0 waiting", [r for r, ok in enumerate(connected) if not ok], HOST_ENV)
        for s in (server, mine):
            if s is not None:
                s.close()
        return None
    if ranks.rank != 0:
        mine.settimeout(None)
        return Heartbeat({0: mine}, timeout)
    try:
        return Heartbeat(_accept(server, ranks.size, key), timeout)
    finally:
        server.close()


def _accept(server: socket.socket, size: int, key: int) -> dict[int, socket.socket]:
    """Rank 0: every follower's connection (rank -> socket), the ones that say the key; others closed."""
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + CONNECT_S
    while len(peers) < size - 1:
        server.settimeout(max(0.1, deadline - time.monotonic()))
        s, addr = server.accept()
        s.settimeout(5.0)
        try:
            rank, said = struct.unpack(HELLO, s.recv(struct.calcsize(HELLO), socket.MSG_WAITALL))
        except (OSError, struct.error):
            rank, said = -1, None
        if said != key or not 0 < rank < size or rank in peers:
            log.warning("heartbeat: a connection from %s is not a rank's: closed", addr[0])
            s.close()
            continue
        s.settimeout(None)
        peers[rank] = s
    return peers
