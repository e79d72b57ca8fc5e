"""`localheap serve`: the OpenAI-compatible server with a managed KV heap per session."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import IO, Optional

from . import ranks
from .common import (TOTAL_SHARE, add_compile_arg, add_decode_arg, add_distributed_arg, add_graphs_arg, add_heap_args,
                     add_model_args, apply_decode_attention, disk_total, freeze_startup_objects, heap_config,
                     load_model_backend, model_spec, with_backend_chunk)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API with a heap per session",
                       description="Serve chat and completions over HTTP (OpenAI API) plus session, "
                                   "heap-event and metrics routes.")
    add_model_args(p)
    add_heap_args(p, recall=True)
    add_decode_arg(p)
    add_compile_arg(p)
    add_graphs_arg(p)
    p.add_argument("--ram-budget", default=None, metavar="SIZE",
                   help="RAM budget for weights + heaps + runtime, e.g. 12G, 512M or bytes "
                        "(default: 75%% of this machine's RAM)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default: localhost only; 0.0.0.0 opens the server to the network "
                        "and turns off the Host-header check)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (e.g. a reverse proxy's name; repeatable)")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="the names the model answers to in requests' `model` (vLLM's flag): a client that sends a "
                        "fixed name (gpt-4o, an editor's default) finds it; replies and /v1/models carry the first. "
                        "A name with a shell wildcard ('claude-*': Claude Code's small model) matches names and is "
                        "not listed (default: the model's own name)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every API route (not /health); repeatable, each "
                        "key sees only its own sessions. Visible in `ps`: prefer LOCALHEAP_API_KEY or --api-keys-file "
                         "(default: no key unless LOCALHEAP_API_KEY or a keys file gives one)")
    p.add_argument("--api-keys-file", type=Path, default=None, metavar="PATH",
                   help="API keys, one a line (# comments); with LOCALHEAP_API_KEY and --api-key (default: none)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN, repeatable (default: only the server's own origin)")
    p.add_argument("--max-body", default="16M", metavar="SIZE",
                   help="largest request body (413 beyond); 16M holds a 1M-token document")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="largest prompt one request may hold (400 beyond; default: from the RAM budget)")
    p.add_argument("--admission-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long a request may queue for RAM under the budget before 503")
    p.add_argument("--max-observers", type=int, default=8, help="open /v1/heap/events streams (503 beyond)")
    p.add_argument("--max-active", type=int, default=None,
                   help="requests running at once (beyond: queued) (default: --max-batch's value, at least 8)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="decoding sessions advanced together in one forward pass per step; more wait their "
                        "turn, longest-waiting first (README: the decode batch) (default: 16 on CUDA, where an "
                        "H200 stepped 16 sessions of 32K tokens in the time of one; 8 elsewhere)")
    p.add_argument("--mixed-chunk", type=int, default=64, metavar="N",
                   help="prefill tokens a document read feeds per step while other sessions decode "
                        "(its chunk rides in their forward pass; alone it uses --prefill-chunk)")
    p.add_argument("--prefill-lane", choices=("auto", "on", "off"), default="auto",
                   help="read a prompt's chunks on a second thread while other sessions decode, while more "
                        "than --mixed-chunk of its tokens are left (shorter prompts ride in the decode pass) "
                        "(auto: where the backend can, the torch CPU backend; off: chunks ride in the decode "
                        "pass, --mixed-chunk tokens a step; README: the decode batch)")
    p.add_argument("--round-robin", action="store_true",
                   help="serve one run per forward pass in turn, without batching (for comparison)")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond those (503 beyond)")
    p.add_argument("--max-sessions", type=int, default=256, help="sessions kept (oldest idle ones are dropped)")
    p.add_argument("--max-resident-sessions", type=int, default=None,
                   help="idle sessions beyond are spilled to disk (default: 8, or --max-sessions where fewer)")
    p.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="a client that trims old messages (to fit its own context) resends the conversation "
                        "without them: keep the session's runs of at least N tokens that the shorter history "
                        "still holds, re-rotated to their new positions, instead of reading them again; their "
                        "K/V still carry what the trimmed messages added (as llama.cpp's --cache-reuse). "
                        "0 = off: the shorter history is read again, as the stock path would (default: 0)")
    p.add_argument("--sessions-dir", type=Path, default=None,
                   help="where sessions are spilled and saved (default: ~/.cache/localheap/sessions/MODEL)")
    p.add_argument("--disk-total", default="auto", metavar="SIZE",
                   help="bytes the whole sessions directory may hold (pages, heaps, tokens, checkpoints), e.g. 50G; "
                        "past it idle sessions give space back, least recently used first; 0 = no bound "
                        f"(default auto: 1/{TOTAL_SHARE} of the free space on its disk plus what it holds, at start)")
    p.add_argument("--slot-save-path", type=Path, default=None, metavar="DIR",
                   help="where llama-server's POST /slots/ID?action=save writes a slot's session as one file, "
                        "and action=restore reads one back as a new session (made if missing; default: none, "
                        "those actions answer 501 as llama-server's do)")
    p.add_argument("--no-persist", dest="persist", action="store_false",
                   help="do not save sessions at shutdown nor restore them at start: they spill into a temporary "
                        "directory removed at exit, inside --sessions-dir where given (default: they are saved)")
    p.add_argument("--default-max-tokens", type=int, default=8192, help="chat reply limit when a request sets none")
    p.add_argument("--max-tokens-limit", type=int, default=32768,
                   help="the largest max_tokens a request may ask for (400 beyond)")
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, requests get this long to finish; then each is stopped and ends "
                        "with a final event saying what was kept, sessions are saved, and the server exits 0")
    p.add_argument("--tool-format", default="auto",
                   choices=("auto", "hermes", "qwen3_xml", "glm45", "glm4", "mistral", "llama3_json", "harmony", "phi4_mini", "prompted"),
                   help="how the model writes tool calls (default: auto, recognised from its chat template)")
    p.add_argument("--no-tool-grammar", action="store_true",
                   help="sample the tool calls a reply opens freely (tool_choice auto); by default, once the model "
                        "opens a call, the call is held by a grammar to an offered tool's name and to arguments "
                        "valid for its schema (a forced tool_choice is always held)")
    p.add_argument("--embed-pooling", default="mean", choices=("mean", "last"),
                   help="/v1/embeddings and /api/embed: a text's vector is the mean of the model's last hidden "
                        "states, or the last token's (default: mean)")
    add_distributed_arg(p, watched=True)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log detail")
    p.set_defaults(func=run)


# README (Past one machine): why --disk-total is off under --distributed
DISK_TOTAL_RANKS = ("--disk-total does not run with --distributed: it takes space back by dropping a session's "
                    "lowest-value pages, and each rank would rank and drop its own, so the ranks' page stores (and the "
                    "recall vote summed across them) would part; leave it out or give 0")


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return port


def bind_host(text: str) -> str:
    """--host as the socket takes it: an IPv6 address without the brackets a URL puts around it."""
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError("--host takes an address or a name, e.g. 127.0.0.1, ::1 or 0.0.0.0")
    return host


def check_port_free(host: str, port: int) -> Optional[socket.socket]:
    """Fail before the model loads when the port is taken: the server would find out only once it
    had loaded the model and restored every session. Port 0 (the system picks one): the socket,
    bound, for the server to listen on, so that the port it prints and records is the one it serves."""
    from ..server.settings import url_host

    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds: a closed socket's TIME_WAIT is no user
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is in use (by another server: is a localheap serve "
                                 f"running already? GET http://{url_host(host)}:{port}/health says); pass --port N") from None
            raise ValueError(f"cannot listen on {url_host(host)}:{port}: {e.strerror or e}") from None
        if port == 0:
            kept, s = s, None
            return kept
        return None
    finally:
        if s is not None:
            s.close()


def lock_sessions_dir(path: Path, name: str, settings) -> Optional[IO]:
    """`path/name`, open and locked, for the server to hold while it runs (closing it lets go): a
    second server on the same sessions directory would restore the same sessions, then write over
    the first one's index and heaps. The system lets go of it however the process ends (kill -9
    too). None where nothing can be locked (no flock: Windows; a directory that cannot be written,
    which the store refuses with its own message)."""
    try:
        import fcntl
    except ImportError:   # pragma: no cover
        return None
    from ..heap.private import open_private, private_dir
    from ..server.settings import url_host

    try:
        private_dir(path)   # 0700 and 0600, as the store makes its own
        f = os.fdopen(open_private(path / name, os.O_RDWR | os.O_CREAT), "r+")
    except OSError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        who = f.read().strip()
        f.close()
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None   # a file system without locks: as on Windows
        raise ValueError(f"the sessions directory {path} is in use by another localheap serve"
                         f"{f' ({who})' if who else ''}: stop that one, or give this one a directory of its "
                         f"own (--sessions-dir DIR) or none (--no-persist)") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}, http://{url_host(settings.host)}:{settings.port}\n")
    f.flush()
    return f


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_open_without_key(settings) -> None:
    """A server on the network (--host other than loopback) without an API key answers anyone who can
    reach it; with a wildcard address the Host check is off too, so a web page whose name resolves to
    this machine can drive it (DNS rebinding). Said once at start, not refused: a trusted LAN is a
    choice."""
    if is_loopback(settings.host) or settings.keys:
        return
    print(f"localheap: warning: --host {settings.host} serves everyone who can reach this machine, and no API key "
          f"is set: anyone on the network can run generations and read or delete sessions; set LOCALHEAP_API_KEY "
          f"(or --api-keys-file) to require one", file=sys.stderr)


def default_sessions_dir(model_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name).strip("_") or "model"
    base = Path(os.environ.get("LOCALHEAP_CACHE", Path.home() / ".cache" / "localheap"))
    return base / "sessions" / slug


DEFAULT_MAX_BATCH = 8
CUDA_MAX_BATCH = 16   # measured: an H200 stepped 16 sessions of 32K (Llama 3 8B's shape) in the time of one


def default_max_batch(backend) -> int:
    """--max-batch when not given: 16 on CUDA, 8 elsewhere (the CPU: docs/serve_bench.md)."""
    device = getattr(backend, "device", None)
    return CUDA_MAX_BATCH if getattr(device, "type", None) == "cuda" else DEFAULT_MAX_BATCH


def batch_limits(args, device_max_batch: int = DEFAULT_MAX_BATCH) -> tuple[int, int]:
    """(max_batch, max_active): a flag given wins; --max-batch defaults to the device's, and
    --max-active to --max-batch (at least 8), so that many requests can run at once."""
    max_batch = args.max_batch or device_max_batch
    return max_batch, args.max_active or max(DEFAULT_MAX_BATCH, max_batch)


DEFAULT_RESIDENT_SESSIONS = 8


def settings_from_args(args):
    from ..server import ServerSettings, parse_bytes

    for name in ("max_active", "max_batch", "mixed_chunk", "max_sessions", "max_resident_sessions", "default_max_tokens", "max_tokens_limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_resident_sessions is None:   # a resident session is a kept one: no more than --max-sessions
        args.max_resident_sessions = min(DEFAULT_RESIDENT_SESSIONS, args.max_sessions)
    elif args.max_resident_sessions > args.max_sessions:
        raise ValueError(f"--max-resident-sessions {args.max_resident_sessions} is more than --max-sessions "
                         f"{args.max_sessions}: a resident session is one of those kept")
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if args.cache_reuse < 0:
        raise ValueError("--cache-reuse must be >= 0 (0: off)")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError("--max-prompt-tokens must be >= 1")
    if args.admission_timeout < 0 or args.max_observers < 1:
        raise ValueError("--admission-timeout must be >= 0 and --max-observers >= 1")
    if not 0 <= args.shutdown_grace <= 3600:
        raise ValueError("--shutdown-grace must be between 0 and 3600 seconds")
    if args.distributed and args.disk_total.strip().lower() != "auto" and disk_total(args.disk_total):
        raise ValueError(DISK_TOTAL_RANKS)
    if args.slot_save_path is not None and args.distributed:
        raise ValueError("--slot-save-path is not supported with --distributed (a slot file holds one host's heap)")
    names = list(dict.fromkeys(n.strip() for n in args.served_model_name))
    if any(not n for n in names):
        raise ValueError("--served-model-name takes non-empty names")
    max_batch, max_active = batch_limits(args)   # run() sets the device's default once it is loaded
    return ServerSettings(
        host=bind_host(args.host), port=args.port, api_keys=api_keys(args), served_model_names=names,
        cors_origins=list(args.cors_origin),
        allowed_hosts=list(args.allow_host), max_prompt_tokens=args.max_prompt_tokens,
        admission_timeout=args.admission_timeout, max_observers=args.max_observers,
        max_body_bytes=parse_bytes(args.max_body), max_queued=args.max_queue,
        max_batch=max_batch, max_active=max_active, batched=not args.round_robin, mixed_chunk=args.mixed_chunk,
        prefill_lane={"auto": None, "on": True, "off": False}[args.prefill_lane],
        max_sessions=args.max_sessions,
        max_resident_sessions=args.max_resident_sessions, persist_sessions=args.persist, cache_reuse=args.cache_reuse,
        sessions_dir=args.sessions_dir, slot_save_path=slot_dir(args.slot_save_path),
        ram_budget=parse_bytes(args.ram_budget) if args.ram_budget else None,
        default_max_tokens=args.default_max_tokens, max_tokens_limit=args.max_tokens_limit,
        shutdown_grace_s=args.shutdown_grace, heap=heap_config(args),
        disk_total=None if args.disk_total.strip().lower() == "auto" else disk_total(args.disk_total),   # auto: in run
        tool_format=None if args.tool_format == "auto" else args.tool_format,
        tool_grammar=not args.no_tool_grammar, embed_pooling=args.embed_pooling,
    )


def slot_dir(path: Optional[Path]) -> Optional[Path]:
    """--slot-save-path made (if missing) before the model loads: a directory that cannot be is an error now."""
    if path is None:
        return None
    from ..sessions.slotfiles import prepare_dir

    try:
        return prepare_dir(path)
    except OSError as e:
        raise ValueError(f"--slot-save-path {path}: {e.strerror or e}") from None


def api_keys(args) -> list[str]:
    """LOCALHEAP_API_KEY, then --api-keys-file's lines, then --api-key (warned: `ps` shows it)."""
    keys = [os.environ["LOCALHEAP_API_KEY"]] if os.environ.get("LOCALHEAP_API_KEY") else []
    if args.api_keys_file is not None:
        try:
            lines = args.api_keys_file.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --api-keys-file {args.api_keys_file}: {e.strerror}") from None
        found = [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        if not found:   # a keys file meant to lock the server: starting open would be the worst outcome
            raise ValueError(f"--api-keys-file {args.api_keys_file} holds no key (every line is empty or a # "
                             f"comment), so the server would answer without one: add a key, one a line, or "
                             f"leave the flag out")
        keys += found
    if args.api_key:
        print("localheap: warning: an API key given with --api-key is visible to every user of this machine "
              "(ps, /proc); use LOCALHEAP_API_KEY or --api-keys-file", file=sys.stderr)
        keys += args.api_key
    if any(any(c.isspace() for c in k) for k in keys):
        raise ValueError("API keys cannot hold spaces")
    return list(dict.fromkeys(keys))


def run(args) -> int:
    from ..models import model_name_of
    from ..server import create_app

    settings = settings_from_args(args)   # bad flags fail before the model loads
    if not args.distributed or os.environ.get("MLX_RANK", "0") == "0":   # (rank 0 alone listens)
        warn_open_without_key(settings)
        args.listen_socket = check_port_free(settings.host, settings.port)   # port 0: its socket, bound
        if args.listen_socket is not None:
            settings.port = args.listen_socket.getsockname()[1]
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    lock = None
    scratch = scratch_sessions_dir(settings)
    try:
        # (ranks on one host may share a directory: a lock each; a rank's number, where its launcher
        # says it before the model loads: mlx.launch's MLX_RANK)
        told = os.environ.get("MLX_RANK", "")
        early_rank = int(told) if args.distributed and told.isdigit() else None
        if settings.persist_sessions and (not args.distributed or early_rank is not None):
            # before the model loads, where its directory is known: a second server is refused at once
            if settings.sessions_dir is None and (name := model_name_of(model_spec(args))) is not None:
                settings.sessions_dir = default_sessions_dir(name)
            if settings.sessions_dir is not None:
                lock = lock_sessions_dir(Path(settings.sessions_dir), _lock_name(early_rank), settings)
        backend = ranks.load_rank(args) if args.distributed else load_model_backend(args)
        apply_decode_attention(backend, args, batched=True)
        settings.heap = with_backend_chunk(settings.heap, args, backend)
        settings.max_batch, settings.max_active = batch_limits(args, default_max_batch(backend))
        if settings.persist_sessions and settings.sessions_dir is None:
            settings.sessions_dir = default_sessions_dir(backend.model_name)
        if args.distributed and lock is not None and backend.rank != early_rank:   # (a launcher that lied)
            lock.close()
            lock = None
        if settings.persist_sessions and lock is None:
            lock = lock_sessions_dir(Path(settings.sessions_dir),
                                     _lock_name(backend.rank if args.distributed else None), settings)
        if settings.disk_total is None:   # auto: measured where the sessions directory is (or a temp dir goes)
            settings.disk_total = disk_total("auto", settings.sessions_dir or Path(tempfile.gettempdir()))
        if args.distributed:
            return serve_ranks(backend, settings, args)
        backend.check_heap(settings.heap)   # a heap the model cannot have fails here, not at each request
        ranks.check_layout(settings.sessions_dir if settings.persist_sessions else None, None)
        app = create_app(backend, settings)   # BudgetTooSmall here says what would fit
        if lock is not None:   # a directory made anew while it runs: its lock taken there before a write
            # (ValueError: another server holds it, and nothing is written)
            app.state.services.store.dir.relock = lambda: lock_sessions_dir(Path(settings.sessions_dir),
                                                                            _lock_name(None), settings)
        return serve_built(app, backend, settings, args)
    finally:
        if lock is not None:
            lock.close()   # (the lock goes with it)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def scratch_sessions_dir(settings) -> Optional[Path]:
    """--no-persist with --sessions-dir DIR: the sessions spill into a temporary directory of their own
    inside DIR (settings.sessions_dir, returned: removed at exit), as they would in the system's
    temporary directory without it. DIR picks the disk (the system's may be in RAM: a tmpfs); the
    sessions a persisting server saved there are left alone (no lock needed, nothing read or
    written over, no disk bound reclaiming them)."""
    if settings.persist_sessions or settings.sessions_dir is None:
        return None
    from ..heap.private import private_dir

    parent = Path(settings.sessions_dir)
    try:
        private_dir(parent)
        settings.sessions_dir = Path(tempfile.mkdtemp(prefix="localheap-sessions-", dir=parent))
    except OSError as e:
        raise ValueError(f"cannot use --sessions-dir {parent}: {e.strerror or e}") from None
    return settings.sessions_dir


def _lock_name(rank: Optional[int]) -> str:
    """The lock file a server (None) or a rank of --distributed holds in its sessions directory."""
    return "serve.lock" if rank is None else f"serve.rank{rank}.lock"


def serve_ranks(backend, settings, args) -> int:
    """--distributed: every rank plans its RAM; rank 0 serves on a Leader, the others follow."""
    from ..backends.mlx.leader import Leader
    from ..governor import governor_for
    from ..server import create_app

    plan = ranks.agreed_plan(backend, settings.heap, settings.ram_budget)   # BudgetTooSmall on any rank: all stop
    settings.disk_total = 0   # auto is off: DISK_TOTAL_RANKS (an explicit bound was refused)
    sessions_dir = settings.sessions_dir if settings.persist_sessions else None
    ranks.check_layout(sessions_dir, ranks.layout_of(backend))   # every rank: each has its own disk
    beat = ranks.heartbeat(backend, args.rank_timeout, args.step_timeout)
    if backend.rank != 0:
        sensors = governor_for(backend, plan).sensors   # this rank's allocator limits; its memory for admissions
        return ranks.follower(backend, sessions_dir, beat, ranks.own_reading(sensors, plan.budget))
    leader = Leader(backend, heartbeat=beat)   # from its first command: the followers wait for its wake
    try:
        governor = governor_for(leader, plan)
        governor.sensors = ranks.RankSensors(governor.sensors, leader, plan.budget)   # admissions: every rank's RAM
        app = create_app(leader, settings, governor=governor, on_close=leader.stop, on_start=leader.prune_files)
        leader.root = app.state.services.store.spill_dir
        ranks.lead(leader, beat, args.step_timeout, on_stuck=app.state.services.engine.abandon)
        ranks.keep_pinging(app.state.services.engine, leader)
        print(f"localheap: --distributed {backend.mode} on {backend.ranks.size} ranks: this is rank 0 (HTTP); "
              f"the heap of every rank counts as the tightest rank's", file=sys.stderr)
        if getattr(args, "rewind", "on") == "on":   # README (Past one machine): exact rollbacks only
            print("localheap: --rewind does nothing with --distributed: a prompt that shares an evicted session's "
                  "prefix is read again (as --rewind off)", file=sys.stderr)
        code = serve_built(app, leader, settings, args)
    finally:
        leader.stop()   # also when the app never started (at most once: it says stop once)
    if leader.lost is not None:   # the engine thread may wait in a collective for ever: do not wait for it
        ranks.exit_now(f"localheap: exiting with status 1: {leader.lost}", 1)
    return code


def serve_built(app, backend, settings, args) -> int:
    from ..heap import format_bytes
    from ..server.runner import serve_app

    plan = app.state.services.governor.plan
    print(f"localheap: RAM budget {format_bytes(plan.budget)} = weights {format_bytes(plan.weights)} + runtime "
          f"{format_bytes(plan.overhead)} (of which {format_bytes(plan.activations)} for prefill activations, "
          f"{format_bytes(plan.requests)} for requests: prompts up to "
          f"{settings.max_prompt_tokens:,} tokens) + room for {plan.max_resident} resident heap(s); "
          f"thermal state {app.state.services.governor.sensors.thermal()}", file=sys.stderr)
    heap = settings.heap
    print(f"localheap: {backend.model_name} on {backend.name} | heap: {heap.sinks} sinks + {heap.budget} budget + "
          f"max({heap.slack} slack, {heap.chunk} prefill chunk), policy {heap.policy} ({format_bytes(backend.heap_bytes(heap))} per session)",
          file=sys.stderr)
    if heap.recall:
        print(f"localheap: recall on: each heap's plan includes page summaries for {plan.recall_base_tokens:,} tokens, "
              f"{format_bytes(plan.recall_token_bytes)} of RAM per token past them; a session keeps pages of at most "
              f"{heap.recall_ram_tokens:,} tokens (what the budget holds with it alone) and at most "
              f"{format_bytes(heap.disk_budget) if heap.disk_budget else 'unbounded'} of pages on disk "
              f"(--disk-budget)", file=sys.stderr)
    print(f"localheap: sessions in {app.state.services.store.spill_dir}, at most "
          f"{format_bytes(settings.disk_total) if settings.disk_total else 'unbounded'} in all (--disk-total)",
          file=sys.stderr)
    freeze_startup_objects()

    def listening() -> None:   # (once it listens: a script that waits for this line can connect at once)
        print(f"localheap: serving {settings.base_url}  (OpenAI base_url: {settings.base_url}/v1)", file=sys.stderr,
              flush=True)

    return serve_app(app, settings, args.log_level, sock=getattr(args, "listen_socket", None), on_listening=listening)
