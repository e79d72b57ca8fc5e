"""Bad input on the command line ends in one line that says what is wrong (exit status 2), never
a traceback, and before a model loads where it can: counts of 0 or less, unreadable files, a
closed standard input, a heap larger than the RAM, a keys file without a key, --port 0."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_process import listens

from localheap.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["bench", "speed", "--contexts", "0"], "'0': must be >= 1"),
    (["bench", "speed", "--contexts=-5"], "'-5': must be >= 1"),
    (["bench", "speed", "--contexts", "4k,,x"], "give one or more numbers"),
    (["bench", "speed", "--contexts", "1.5"], "'1.5' is not a whole number"),
    (["bench", "speed", "--contexts", "nan"], "'nan' is not a whole number"),
    (["bench", "speed", "--contexts", ","], "give one or more numbers"),
    (["bench", "speed", "--decode-tokens", "0"], "--decode-tokens: '0': must be >= 1"),
    (["bench", "speed", "--decode-tokens", "-1"], "must be >= 1"),
    (["bench", "speed", "--repeats", "0"], "--repeats: '0': must be >= 1"),
    (["bench", "speed", "--threads", "0"], "--threads: '0': must be >= 1"),
    (["bench", "batch-step", "--rows", "0"], "--rows: '0': must be >= 1"),
    (["bench", "slots", "--contexts", "0"], "must be >= 1"),
    (["bench", "serve", "--clients", "0"], "--clients: '0': must be >= 1"),
    (["bench", "serve", "--stagger", "-1"], "--stagger: '-1': must be >= 0"),
    (["bench", "memory", "--tokens", "0"], "--tokens: '0': must be >= 1"),
    (["bench", "needle", "--trials", "0"], "--trials: '0': must be >= 1"),
    (["bench", "needle", "--context", "0"], "--context: '0': must be >= 1"),
    (["bench", "peer", "--threads", "0"], "must be >= 1"),
    (["generate", "--prompt", "hi", "--model", "demo", "--random-model", "llama:tiny"], "not allowed with"),
    (["bench", "speed", "--contexts", "4096,,"], "give one or more numbers"),   # a typo, not a list of one
    (["chat", "--max-tokens", "0"], "--max-tokens: 0 is less than 1"),   # (every reply was empty)
    (["bench", "memory", "--tokens", "64k,1m"], "takes one number, not a list"),   # (the rest were dropped)
    (["bench", "serve", "--doc-tokens", "1k,2k"], "takes one number, not a list"),
    (["generate", "--prompt", "hi", "--max-tokens", "-1"], "--max-tokens: -1 is less than 0"),   # (not a field's name)
    (["generate", "--prompt", "hi", "--prefill-chunk", "-1"], "--prefill-chunk: -1 is less than 0"),
    (["generate", "--prompt", "hi", "--max-tokens", "\u0663"], "is not a whole number"),   # (int() reads it as 3)
    (["bench", "batch-step", "--rows", "1,,2"], "give one or more numbers"),
    (["bench", "needle", "--prune", ","], "pruning levels are fractions"),   # (it was no pruning level at all)
    (["bench", "needle", "--prune", "x"], "pruning levels are fractions"),
    (["bench", "perplexity", "--texts", ","], "give one or more names"),
])
def test_a_bad_count_or_flag_is_refused_by_the_parser(argv, says, capsys):
    err = parse_error(argv, capsys)
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("flags, said", [(["--keys", "1", "--turns", "2"], "need named facts"),
                                          (["--keys", "4", "--long-contexts", "", "--long-full", "8192"],
                                           "--long-contexts is empty")])
def test_needle_refuses_options_it_would_ignore_before_its_first_table(flags, said, capsys, monkeypatch):
    import localheap.bench.needle as needle

    monkeypatch.setattr(needle, "cell", lambda *a, **k: pytest.fail("a cell ran before the options were checked"))
    assert main(["bench", "needle", "--random-model", "llama:tiny", "--context", "512", "--trials", "1", *flags]) == 2
    assert said in capsys.readouterr().err


def test_recall_on_with_no_room_for_a_page_says_which_flags_leave_none(capsys):
    assert main(["generate", "--random-model", "llama:tiny", "--prompt", "hi", "--recall", "on", "--budget", "64"]) == 2
    err = capsys.readouterr().err
    assert "--budget 64 with --recent 64 leaves no room" in err and "(2048)" not in err, err


def test_a_bench_json_line_is_json_where_a_figure_is_not_a_number():
    """NaN and infinities are null in the JSON line (JSON.parse refuses NaN), "-" in the table."""
    import io
    import json

    from localheap.bench.report import emit

    out = io.StringIO()
    emit("serve", "table", {"rows": [{"chat_alone": float("nan"), "ratio": float("inf"), "n": 3}]}, out=out)
    line = out.getvalue().splitlines()[-1]
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line)["rows"] == [{"chat_alone": None, "ratio": None, "n": 3}]


def test_sigterm_unwinds_a_command_as_ctrl_c_does(tmp_path):
    """SIGTERM to `localheap generate` mid-prefill: it exits 143, saying so, and its temporary page
    store goes as it does on Ctrl-C (it was left behind: 46-53 MiB each time)."""
    import signal
    import time

    prompt = tmp_path / "long.txt"
    prompt.write_text(" ".join(f"line {i} of a long document" for i in range(40_000)))
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "localheap.cli", "generate", "--random-model", "llama:tiny",
                             "--backend", "torch", "--prompt-file", str(prompt), "--budget", "64", "--recent", "16",
                             "--slack", "32", "--recall", "on", "--max-tokens", "4"],
                            cwd=ROOT, env={**ENV, "TMPDIR": str(temp)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(temp.glob("localheap-pages-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert any(temp.glob("localheap-pages-*")), "the page store never appeared"
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err, err[-2000:]
    assert not any(temp.glob("localheap-pages-*")), sorted(temp.iterdir())


def test_counts_take_suffixes_and_zero_where_zero_means_skip():
    args = build_parser().parse_args(["bench", "speed", "--contexts", "2048, 8k,1m,1.5m"])
    assert args.contexts == [2048, 8192, 1_000_000, 1_500_000]
    args = build_parser().parse_args(["bench", "serve", "--doc-tokens", "0", "--clients", "1,2"])
    assert args.doc_tokens == [0] and args.clients == [1, 2]
    assert build_parser().parse_args(["bench", "batch-step", "--mixed-chunks", "0"]).mixed_chunks == [0]
    assert build_parser().parse_args(["bench", "needle", "--long-contexts", ""]).long_contexts == []
    assert build_parser().parse_args(["bench", "profile", "--decode-tokens", "0"]).decode_tokens == 0


def test_an_unknown_random_size_names_the_real_shapes_too(capsys):
    assert main(["generate", "--random-model", "llama:huge", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "tiny, small" in err and "llama:8b" in err and "Traceback" not in err


def test_a_prompt_file_that_cannot_be_read_says_why(tmp_path, capsys):
    assert main(["generate", "--prompt-file", str(tmp_path)]) == 2
    assert "cannot read --prompt-file" in capsys.readouterr().err
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    assert main(["generate", "--prompt-file", str(latin)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_chat_with_standard_input_closed_says_so_before_loading():
    r = subprocess.run(["bash", "-c", f"exec {sys.executable} -m localheap.cli chat <&-"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=ENV)
    assert r.returncode == 2, r.stderr
    assert "standard input, which is closed" in r.stderr and "Traceback" not in r.stderr
    assert "loading the model" not in r.stderr


@pytest.mark.parametrize("flag, said", [(["--temperature", "-1"], "temperature must be >= 0"),
                                         (["--top-p", "2"], "top_p must be in (0, 1]")])
def test_chat_refuses_bad_sampling_flags_before_loading(capsys, flag, said):
    assert main(["chat", "--random-model", "llama:tiny", *flag]) == 2
    err = capsys.readouterr().err
    assert said in err and "loading the model" not in err and "Traceback" not in err


def test_a_heap_larger_than_the_ram_is_refused_with_what_fits(capsys):
    from localheap.commands.common import check_heap_fits
    from localheap.heap import HeapConfig
    from localheap.models import load_backend

    assert main(["generate", "--prompt", "hi", "--max-tokens", "1", "--backend", "torch",
                 "--budget", "100000000"]) == 2
    err = capsys.readouterr().err
    m = re.search(r"about ([\d,]+) tokens would fit", err)
    assert m and "Traceback" not in err, err
    fits = int(m.group(1).replace(",", ""))
    assert 0 < fits < 100_000_000
    # the figure is what the RAM available holds (it moves a little between two reads: half and twice it)
    backend = load_backend("demo", "torch")
    check_heap_fits(backend, HeapConfig(budget=fits // 2, prefill_chunk=512))
    with pytest.raises(ValueError, match="would fit"):
        check_heap_fits(backend, HeapConfig(budget=fits * 2, prefill_chunk=512))


def test_serve_refuses_a_heap_the_budget_cannot_hold_naming_one_it_can():
    """The activations of a prefill grow with the heap: the budget named is searched, and fits."""
    from localheap.governor.budget import BudgetTooSmall
    from localheap.governor.setup import plan_for
    from localheap.heap import HeapConfig
    from localheap.models import load_backend

    backend = load_backend("demo", "torch")
    ram = 2 * 1024**3
    with pytest.raises(BudgetTooSmall) as e:
        plan_for(backend, HeapConfig(budget=3_000_000, prefill_chunk=512), ram)
    m = re.search(r"A heap of ([\d,]+) tokens would fit \(--budget (\d+)\)", str(e.value))
    assert m, str(e.value)
    fits = int(m.group(2))
    assert fits < 3_000_000
    assert plan_for(backend, HeapConfig(budget=fits, prefill_chunk=512), ram).max_resident >= 1
    with pytest.raises(BudgetTooSmall):   # and it is the largest (to the token)
        plan_for(backend, HeapConfig(budget=fits + 1, prefill_chunk=512), ram)


def test_max_sessions_bounds_the_resident_ones_and_is_never_raised():
    """--max-sessions 3 kept 8 sessions: it was raised to the default --max-resident-sessions."""
    from localheap.cli import build_parser
    from localheap.commands.serve import settings_from_args

    def settings(*flags):
        return settings_from_args(build_parser().parse_args(["serve", "--port", "9", *flags]))

    s = settings("--max-sessions", "3")
    assert (s.max_sessions, s.max_resident_sessions) == (3, 3)
    s = settings()
    assert (s.max_sessions, s.max_resident_sessions) == (256, 8)
    s = settings("--max-sessions", "3", "--max-resident-sessions", "2")
    assert (s.max_sessions, s.max_resident_sessions) == (3, 2)
    with pytest.raises(ValueError, match="--max-resident-sessions 4 is more than --max-sessions 3"):
        settings("--max-sessions", "3", "--max-resident-sessions", "4")


def test_a_file_where_a_directory_should_be_is_called_that(tmp_path, capsys):
    from localheap.heap.private import private_dir

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path in (a_file, a_file / "below"):
        with pytest.raises(NotADirectoryError):
            private_dir(path)
    assert main(["serve", "--slot-save-path", str(a_file), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "Not a directory" in err and "File exists" not in err


def _start(argv, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "localheap.cli", "serve", *argv], cwd=cwd, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _serving_url(proc: subprocess.Popen, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"serving (http://\S+?)\s", line):
            return m.group(1)
    raise AssertionError("".join(lines))


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_serve_on_port_0_prints_and_records_the_port_it_serves(host, tmp_path):
    import httpx

    if host == "[::1]":
        try:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    proc = _start(["--host", host, "--port", "0", "--sessions-dir", str(tmp_path / "sessions")], tmp_path)
    try:
        url = _serving_url(proc)
        port = int(url.rsplit(":", 1)[1])
        assert port != 0 and url == f"http://{host}:{port}"
        assert listens(proc.pid, port)   # the line comes once the server listens: asked at once, it answers
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
        assert (tmp_path / "sessions" / "serve.lock").read_text().strip().endswith(url)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.parametrize("recall", [[], ["--recall", "on"]])
def test_a_recall_region_of_no_page_is_refused_saying_how_to_turn_recall_off(recall, capsys):
    """--recall-budget 0 turned recall off by default, gave a region of 2,048 with --recall on, and, with a small
    budget, an error naming that 2,048 nobody gave: a region under one page is refused, by name."""
    argv = ["generate", "--random-model", "llama:tiny", "--prompt", "hi", "--recall-budget", "0", *recall]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--recall-budget 0" in err and "--recall off" in err and "2048" not in err, err
