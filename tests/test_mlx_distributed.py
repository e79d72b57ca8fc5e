"""The heap on mlx.distributed: 2 local ranks under `mlx.launch` (ring backend, loopback TCP), each
holding its shard (tensor: half the KV heads of every layer; pipeline: half the layers), give
exactly the greedy tokens of the single-process heap, without eviction (and then the sharded
model's own mlx-lm cache), with eviction and with recall; a session saved on 2 ranks restores on
2 ranks, and one saved in another layout is refused. A killed rank ends the run with a clear
error, never a hang. The rank program and its cases: distributed_cases.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("rank_env")   # the ranks: a ring that waits in poll(), not spinning

import distributed_cases as dc  # noqa: E402

from localheap.backends.mlx import MLXBackend  # noqa: E402
from localheap.backends.mlx.distributed import DistributedError, lost_rank_errors, require_ranks, shard  # noqa: E402
from localheap.models import demo_model_dir  # noqa: E402
from server_process import free_ports  # noqa: E402

HERE = Path(__file__).parent
LAUNCH = Path(sys.executable).with_name("mlx.launch")
TIMEOUT = 300   # seconds: two ranks sharing a busy 2-core CPU; a hang fails the test, never blocks it


def launch(model_dir, mode: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed beside this python")
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--", sys.executable, str(HERE / "distributed_cases.py"),
           str(model_dir), mode, str(out), *extra]
    return subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=TIMEOUT)


def single_process(model_dir, where: Path) -> dict:
    """The reference tokens; leaves a heap saved by one process at where/single.safetensors."""
    backend = MLXBackend.load(model_dir)
    ref = {"stock": dc.stock_tokens(backend.model, backend.vocab_size)}
    for name in dc.CASES:
        ref[name] = dc.run_case(backend, name)
    (where / "single").mkdir()
    ref["session"] = dc.session_case(backend, where / "single")
    (where / "single" / "session.safetensors").rename(where / "single.safetensors")
    return ref


MODELS = {"demo": lambda dirs: demo_model_dir(),
          "llama": lambda dirs: dirs("llama", size="small"),     # 8 query, 4 KV heads, 4 layers
          "qwen2": lambda dirs: dirs("qwen2", size="small")}     # mlx-lm pipelines qwen2 (not llama)


@pytest.mark.parametrize("model,mode", [("demo", "tensor"), ("llama", "tensor"), ("qwen2", "pipeline")])
def test_two_ranks_give_the_single_process_tokens(model_dirs, tmp_path, model, mode):
    model_dir = MODELS[model](model_dirs)
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    want = single_process(model_dir, tmp_path)
    out = tmp_path / "tokens.json"
    run = launch(model_dir, mode, out)
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["stock"] == got["full"], "the sharded heap that never evicts is not the shard's mlx-lm cache"
    for name in ("stock", *dc.CASES):
        assert got[name] == want[name], name
    assert len(set(want["evict"])) > 3, "a degenerate case proves little"
    # a session saved on 2 ranks (each its own shard and pages) restores on 2 ranks
    assert got["session"]["restored"] == got["session"]["continued"] == want["session"]["continued"]
    shards = sorted(p.name for p in (tmp_path / f"{mode}-session").iterdir())
    assert shards == sorted(["session.safetensors"] + [f"session.{mode}-rank{r}of2.{ext}" for r in (0, 1)
                                                       for ext in ("pages", "safetensors")])   # the layout, the shards
    assert got["refused"] == (f"{tmp_path / 'single.safetensors'} was saved as one process; this run is {mode} "
                              f"on 2 ranks: restore it with the layout it was saved with")


def test_a_killed_rank_fails_clearly(tmp_path):
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    out = tmp_path / "tokens.json"
    run = launch(model_dir, "tensor", out, "die")   # rank 1 exits right after loading
    log = run.stdout + run.stderr
    # rank 0 ends (no hang: launch's timeout) without a result; mlx.launch 0.32 exits 0 whatever
    # its ranks did, but names the rank that died; a survivor the launcher has not stopped yet
    # raises MLX's "[ring] connection to a peer was lost"
    assert not out.exists(), log
    assert "rank 1 exited with code 3" in log, log


def test_a_lost_peer_is_reported_as_such_by_the_survivor():
    def tokens():
        yield 7
        raise RuntimeError("[ring] connection to a peer was lost")

    it = lost_rank_errors(tokens())
    assert next(it) == 7
    with pytest.raises(DistributedError, match="another rank was lost"):   # a ValueError: the CLI prints it
        next(it)


class Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def test_sharding_that_cannot_work_is_refused_before_loading(model_dirs):
    model = MLXBackend.load(demo_model_dir() or model_dirs("llama")).model   # llama: 4 query, 2 KV heads
    with pytest.raises(DistributedError, match="no pipeline sharding"):
        shard(model, "pipeline", Group(2))
    with pytest.raises(DistributedError, match="divides both"):
        shard(model, "tensor", Group(3))
    with pytest.raises(DistributedError, match="mlx.launch"):
        require_ranks(Group(1))


def test_generate_distributed_outside_mlx_launch_says_how(capsys):
    from localheap.cli import main

    assert main(["generate", "--distributed", "tensor", "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert "mlx.launch" in capsys.readouterr().err


def test_bench_speed_distributed_reports_shards_against_one_process(tmp_path):
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed beside this python")
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "localheap.cli", "bench", "speed",
           "--distributed", "tensor", "--contexts", "96", "--decode-tokens", "4", "--budget", "48", "--recent", "8",
           "--slack", "16", "--recall", "off"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, run.stdout[-3000:] + run.stderr[-3000:]   # rank 0 reports, once
    rows = reports[0]["rows"]
    assert [r["path"] for r in rows] == ["stock-full", "heap", "tensor:stock-full", "tensor:heap"]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)


def test_generate_with_a_rank_stuck_mid_run_exits_within_the_step_timeout(tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, never answering) once rank 0 has printed text: rank 0, waiting
    in a collective MLX's ring would never end, says the ranks did not answer and exits with status 1
    within --step-timeout (without the watch it waits for ever)."""
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    ports = free_ports(2)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{ports[0]}"], [f"127.0.0.1:{ports[1]}"]]))
    cmd = [sys.executable, "-m", "localheap.cli", "generate", "--distributed", "tensor", "--model", str(model_dir),
           "--prompt", "Tell me a long story about a lighthouse.", "--max-tokens", "5000", "--temperature", "0",
           "--budget", "48", "--recent", "8", "--slack", "16", "--recall", "off", "--step-timeout", "3"]
    out = tmp_path / "rank0.out"   # a file, not a pipe: a full pipe would stop rank 0 too
    with open(out, "wb") as f:
        procs = [subprocess.Popen(cmd, env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
                                  stdout=f if r == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE) for r in (0, 1)]
    try:
        deadline = time.monotonic() + TIMEOUT
        while not out.stat().st_size and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.stat().st_size and procs[0].poll() is None, procs[0].stderr.read().decode()   # generating
        os.kill(procs[1].pid, signal.SIGSTOP)
        try:
            code = procs[0].wait(40)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 waited on the stopped rank past its --step-timeout")
        err = procs[0].stderr.read().decode()
        assert code == 1 and "the ranks did not answer within 3 s (--step-timeout)" in err, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
