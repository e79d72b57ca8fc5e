"""`localheap serve --distributed` on 2 local ranks (ring backend over loopback TCP, started the
way mlx.launch starts them: MLX_RANK and MLX_HOSTFILE): rank 0 serves HTTP, rank 1 follows its
heap calls. A conversation through the server gives the single-process server's greedy replies
(tensor on the demo model, pipeline on a random qwen2, both evicting); sessions saved at shutdown
on 2 ranks (each rank its shard) restore on a restart with the same layout, and another layout is
refused; a killed rank fails requests with a clear 503 and /health says which."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
pytest.importorskip("mlx_lm")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.usefixtures("rank_env")   # the ranks: a ring that waits in poll(), not spinning

from fastapi.testclient import TestClient  # noqa: E402

from localheap.commands.ranks import check_layout  # noqa: E402
from localheap.models import demo_model_dir  # noqa: E402
from server_process import free_ports, listens  # noqa: E402

START_S = 240     # two ranks loading on a busy 2-core CPU
HEAP = ["--budget", "48", "--recent", "8", "--slack", "16", "--prefill-chunk", "32"]
RECALL = {"off": ["--recall", "off"],   # evicting only
          "on": ["--recall", "on", "--recall-budget", "16", "--page-size", "8", "--page-format", "f32"]}
TURNS = ["Tell me a long story about a cat who lives in a lighthouse by the sea.",
         "Now tell me what the cat eats for breakfast, and why it likes fish so much.",
         "And what happens when the winter storm comes to the lighthouse?"]
MAX_TOKENS = 40


class Ranks:
    """Two `localheap serve --distributed` processes; rank 0's URL once /health answers."""

    def __init__(self, tmp: Path, model_dir, mode: str, sessions, *extra: str, follower_env: dict = None,
                 heap: list = HEAP):
        """`sessions`: the sessions directory of both ranks, or a list of one per rank (as on two hosts)."""
        ring, ring2, http = free_ports(3)
        hosts = tmp / f"hosts-{ring}.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring2}"]]))
        dirs = sessions if isinstance(sessions, list) else [sessions, sessions]
        cmd = lambda r: [sys.executable, "-m", "localheap.cli", "serve", "--distributed", mode,   # noqa: E731
                         "--model", str(model_dir), "--port", str(http), "--sessions-dir", str(dirs[r]),
                         "--ram-budget", "4G", "--max-resident-sessions", "1", *heap, *(extra or RECALL["off"])]
        self.url = f"http://127.0.0.1:{http}"
        self.logs = [open(tmp / f"rank{r}-{ring}.log", "w+") for r in (0, 1)]
        env = lambda r: {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts),   # noqa: E731
                         **((follower_env or {}) if r else {})}
        self.procs = [subprocess.Popen(cmd(r), env=env(r), stdout=self.logs[r], stderr=subprocess.STDOUT)
                      for r in (0, 1)]

    def log(self) -> str:
        out = []
        for r, f in enumerate(self.logs):
            f.seek(0)
            out.append(f"--- rank {r}\n{f.read()[-3000:]}")
        return "\n".join(out)

    @property
    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=5).json()["data"][0]["id"]

    def wait_ready(self) -> "Ranks":
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError("a rank exited while starting\n" + self.log())
            try:
                if (httpx.get(self.url + "/health", timeout=2).status_code == 200
                        and listens(self.procs[0].pid, int(self.url.rsplit(":", 1)[1]))):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("the ranks did not start\n" + self.log())

    def stop(self) -> list[int]:
        """SIGTERM to rank 0 (it saves the sessions on every rank, then tells rank 1 to stop)."""
        if self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(60))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc):
        self.stop()


def chat(post, history: list, text: str, model: str, session: str = None) -> dict:
    history.append({"role": "user", "content": text})
    r = post("/v1/chat/completions", json={"model": model, "messages": history, "max_tokens": MAX_TOKENS,
                                           "temperature": 0}, headers={"X-Session-Id": session} if session else {})
    assert r.status_code == 200, r.text
    body = r.json()
    chat.session = body["localheap"]["session_id"]
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    heap = body["localheap"]["heap"]
    return {"text": body["choices"][0]["message"]["content"], "usage": body["usage"], "evicted": heap["evicted"],
            "recalled": (heap["pages"] or {}).get("recalled_tokens", 0)}


def single_process(model_dir, heap: list) -> list[dict]:
    """The same conversation on one process's server (the reference), round-robin as `serve
    --distributed` is: a batched turn that ends leaves its last sampled token (EOS) unfed, where
    the round-robin generator has fed it already, so the next turn's chunks (and, with evictions,
    its tokens) differ between the two engines."""
    def script(post, model: str) -> list[dict]:
        history: list = []
        replies = conversation(post, history, TURNS[:2], model)
        forked = fork_and_ask(post, history, model)
        return replies + [chat(post, history, TURNS[2], model), forked]

    return on_one_process(model_dir, heap, script)


def on_one_process(model_dir, heap: list, script):
    """`script(post, model)` against one process's server (no sessions kept on disk), on the
    round-robin engine, as `serve --distributed` runs."""
    from localheap.backends.mlx import MLXBackend
    from localheap.commands.common import heap_config
    from localheap.commands.serve import add_parser, settings_from_args
    from localheap.server import create_app
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(model_dir), "--no-persist", "--ram-budget", "4G",
                              "--max-resident-sessions", "1", "--round-robin", *heap])
    settings = settings_from_args(args)
    settings.heap = heap_config(args)
    backend = MLXBackend.load(model_dir)
    with TestClient(create_app(backend, settings), base_url="http://127.0.0.1:8000") as client:
        return script(lambda path, json, headers={}: client.post(path, json=json, headers=headers),
                      backend.model_name)


def conversation(post, history: list, turns: list, model: str) -> list[dict]:
    """`turns` in one session; after the first, another session's turn, which spills this one
    (one resident session): the next turn restores it (on every rank)."""
    replies = [chat(post, history, turns[0], model)]
    if len(turns) > 1:
        chat(post, [], "Hello!", model)
    return replies + [chat(post, history, t, model) for t in turns[1:]]


def fork_and_ask(post, history: list, model: str) -> dict:
    """Fork the last session at its current point (a checkpoint every rank saves) and ask on in the fork."""
    r = post(f"/v1/sessions/{chat.session}/fork", json={})
    assert r.status_code == 201, r.text
    return chat(post, list(history), "What is the cat's name?", model, session=r.json()["id"])


MODELS = {"demo": lambda dirs: demo_model_dir(), "qwen2": lambda dirs: dirs("qwen2", size="small")}


@pytest.mark.parametrize("model,mode,recall", [("demo", "tensor", "off"), ("qwen2", "pipeline", "on")])
def test_serve_on_two_ranks_gives_the_single_process_replies_and_restores_them(model_dirs, tmp_path, model, mode,
                                                                              recall):
    model_dir = MODELS[model](model_dirs)
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    heap = HEAP + RECALL[recall]
    want = single_process(model_dir, heap)
    assert want[-1]["evicted"] > 0, "the conversation must evict to prove much"
    assert (want[-1]["recalled"] > 0) == (recall == "on"), want   # the span vote summed across ranks
    sessions = tmp_path / "sessions"
    history: list = []
    post = None
    with Ranks(tmp_path, model_dir, mode, sessions, *RECALL[recall]) as ranks:
        post = lambda path, json, headers={}: httpx.post(ranks.url + path, json=json, headers=headers,  # noqa: E731
                                                         timeout=120)
        got = conversation(post, history, TURNS[:2], ranks.model)
        forked = fork_and_ask(post, history, ranks.model)
        metrics = httpx.get(ranks.url + "/metrics").text
        assert "localheap_session_restores_total 1.0" in metrics, metrics   # restored from both ranks' shards
        health = httpx.get(ranks.url + "/health").json()
        assert health["ranks"] == {"size": 2, "mode": mode, "lost": None, "failed_calls": 0, "last_failure": None}
    codes = ranks.stop()   # rank 0: uvicorn ends by re-raising the SIGTERM it handled
    assert codes[0] in (0, -signal.SIGTERM) and codes[1] == 0, (codes, ranks.log())
    assert got == want[:2], ranks.log()
    assert forked == want[3], ranks.log()   # a fork from a checkpoint of every rank's shard
    # each session's committed generation: the layout file, every rank's shard; older ones removed
    index = json.loads((sessions / "index.json").read_text())["sessions"]
    shards = sorted(p.name for p in sessions.iterdir() if "-rank" in p.name)
    assert shards == sorted(f"{e['id']}.{e['gen']}.{mode}-rank{r}of2.safetensors" for e in index for r in (0, 1))
    assert all((sessions / f"{e['id']}.{e['gen']}.safetensors").exists() for e in index)
    # a restart with the same layout restores the session on both ranks: the third turn reuses it
    with Ranks(tmp_path, model_dir, mode, sessions, *RECALL[recall]) as ranks:
        third = chat(lambda path, json, headers: httpx.post(ranks.url + path, json=json, timeout=120), history,
                     TURNS[2], ranks.model)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, ranks.log()
    assert third == want[2], ranks.log()
    # another layout (one process, or another rank count) is refused before anything is read
    with pytest.raises(SystemExit, match=f"saved by --distributed {mode} on 2 ranks; this run is one process"):
        check_layout(sessions, None)
    with pytest.raises(SystemExit, match="this run is --distributed tensor on 4 ranks"):
        check_layout(sessions, {"mode": "tensor", "ranks": 4})


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}}}


def test_structured_output_on_two_ranks_binds_every_rank(tmp_path):
    """A json_schema reply, greedy: the constraint lives on rank 0, whose sampled token every rank
    feeds; the reply validates and equals one process's (a rank that fed its own unconstrained
    token would hold other keys and values and answer differently)."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    asks = [[{"role": "user", "content": "Describe a person as JSON."}],
            [{"role": "user", "content": "Tell me about the lighthouse keeper, as JSON."}]]

    def script(post, model: str) -> list[str]:
        out = []
        for messages in asks:
            r = post("/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": 60, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["message"]["content"])
        return out

    want = on_one_process(model_dir, HEAP + RECALL["off"], script)
    with Ranks(tmp_path, model_dir, "tensor", tmp_path / "sessions") as ranks:
        got = script(lambda path, json, headers={}: httpx.post(ranks.url + path, json=json, timeout=120),
                     ranks.model)
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)
    assert got == want, (got, want)


IDLE_S = 4.0          # an idle server's follower is watched this long
IDLE_CPU_S = 1.0     # and may use this much CPU in it (MLX's ring polls: waiting in a collective, a whole core)


def test_an_idle_follower_sleeps_and_a_killed_rank_fails_requests_clearly_and_health_says_so(tmp_path):
    """Idle (after a reply, pings every 2 s), the follower waits for rank 0's wake, not in the ring's
    collective, which polls its socket: a core busy for as long as the server is idle. Then rank 1
    killed: requests fail clearly, /health says so, what was saved stays."""
    psutil = pytest.importorskip("psutil")
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    sessions = tmp_path / "sessions"
    with Ranks(tmp_path, model_dir, "tensor", sessions) as ranks:
        post = lambda path, json, headers={}: httpx.post(ranks.url + path, json=json, timeout=120)  # noqa: E731
        chat(post, [], TURNS[0], ranks.model)
        follower = psutil.Process(ranks.procs[1].pid)
        before = sum(follower.cpu_times()[:2])
        time.sleep(IDLE_S)
        idle = sum(follower.cpu_times()[:2]) - before
        assert idle < IDLE_CPU_S, f"the idle follower used {idle:.2f} s of CPU in {IDLE_S:g} s"
        ranks.procs[1].kill()
        ranks.procs[1].wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:   # an idle server pings the ranks every 2 s
            health = httpx.get(ranks.url + "/health", timeout=5)
            if health.status_code == 503:
                break
            time.sleep(0.5)
        assert health.status_code == 503, ranks.log()
        assert health.json()["status"] == "failed" and "rank lost" in health.json()["ranks"]["lost"]
        r = post("/v1/chat/completions", {"model": ranks.model, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "rank_lost", r.text
        assert "restart every rank" in r.json()["error"]["message"]
    # what the first turn saved is intact: its index still names it, with its shards
    index = json.loads((sessions / "index.json").read_text())
    assert len(index["sessions"]) == 1 and index["sessions"][0]["gen"] == 0


LOST_BOUND_S = 20   # a killed rank: the request in flight fails within this (heartbeat: at once; +2 s grace)
LONG_PROMPT = " ".join(f"The lighthouse keeper counted {n} waves and {n + 1} gulls before the night."
                       for n in range(150))   # ~3K tokens: a prefill of many chunks


def stream_until(ranks, messages: list, max_tokens: int, kill_after_tokens: int) -> dict:
    """A streamed chat request; rank 1 is killed (SIGKILL) after `kill_after_tokens` content deltas
    (mid-decode), or with 0 as soon as the request started (its first chunk: its session admitted,
    the prompt's prefill under way). Returns what the stream said."""
    seen = {"deltas": 0, "error": None, "killed_at": None, "ended_at": None}

    def kill() -> None:
        ranks.procs[1].kill()
        seen["killed_at"] = time.monotonic()

    body = {"model": ranks.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", ranks.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        while True:
            if seen["killed_at"] is not None and time.monotonic() - seen["killed_at"] > LOST_BOUND_S:
                break   # hung (the stream's keep-alive pings come every 15 s): the assert below says so
            try:
                line = next(lines)
            except StopIteration:
                break
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if seen["killed_at"] is None and not kill_after_tokens:
                kill()
            if "error" in chunk:
                seen["error"] = chunk["error"]
                continue
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                seen["deltas"] += 1
                if seen["killed_at"] is None and kill_after_tokens and seen["deltas"] >= kill_after_tokens:
                    kill()
    seen["ended_at"] = time.monotonic()
    return seen


@pytest.mark.parametrize("when", ["decode", "prefill"])
def test_a_rank_killed_mid_step_fails_the_request_within_a_bound_and_disk_stays_whole(model_dirs, tmp_path, when):
    """kill -9 of rank 1 while rank 0 is inside a forward's collectives (a decode step, or a long
    prefill): the heartbeat finds it, the request fails with rank_lost within LOST_BOUND_S, /health
    says which rank, later requests fail at once, and SIGTERM ends rank 0 (status 1, saying why).
    The session's saved turn is untouched: a fresh pair of ranks restores it and the next turn is
    the single-process reply."""
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    want = single_process(model_dir, HEAP + RECALL["off"])
    sessions = tmp_path / "sessions"
    history: list = []
    ranks = Ranks(tmp_path, model_dir, "tensor", sessions).wait_ready()
    try:
        post = lambda path, json, headers={}: httpx.post(ranks.url + path, json=json, timeout=120)  # noqa: E731
        chat(post, history, TURNS[0], ranks.model)
        if when == "decode":
            seen = stream_until(ranks, [*history, {"role": "user", "content": TURNS[1]}], 4000, 3)
            assert seen["deltas"] >= 3, (seen, ranks.log())
        else:   # killed as the long prompt's prefill starts
            seen = stream_until(ranks, [*history, {"role": "user", "content": LONG_PROMPT}], 8, 0)
            assert seen["deltas"] == 0, (seen, ranks.log())
        assert seen["killed_at"] is not None and seen["error"] is not None, (seen, ranks.log())
        print(f"killed mid-{when}: the request failed {seen['ended_at'] - seen['killed_at']:.2f} s after the kill")
        assert seen["ended_at"] - seen["killed_at"] < LOST_BOUND_S, (seen, ranks.log())
        assert seen["error"]["code"] == "rank_lost" and "rank 1" in seen["error"]["message"], seen
        health = httpx.get(ranks.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failed", health.text
        assert "rank 1" in health.json()["ranks"]["lost"], health.text
        began = time.monotonic()
        r = post("/v1/chat/completions", {"model": ranks.model, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "rank_lost", r.text
        assert time.monotonic() - began < 5
        ranks.procs[0].send_signal(signal.SIGTERM)
        assert ranks.procs[0].wait(LOST_BOUND_S + 20) == 1, ranks.log()
        assert "exiting with status 1: rank lost: rank 1" in ranks.log(), ranks.log()
    finally:
        ranks.stop()
    index = json.loads((sessions / "index.json").read_text())["sessions"]
    assert [e["gen"] for e in index] == [0], index   # turn 1's save; nothing of the failed turn
    with Ranks(tmp_path, model_dir, "tensor", sessions) as ranks:
        second = chat(lambda path, json, headers: httpx.post(ranks.url + path, json=json, timeout=120), history,
                      TURNS[1], ranks.model)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, ranks.log()   # restored from disk
    assert second == want[1], ranks.log()


def test_a_follower_failing_mid_decode_leaves_the_ring_and_rank_0_says_so(tmp_path):
    """Rank 1 fails its 5th generated token (rank 0 is inside that token's collectives): rank 1 logs
    the traceback and exits (status 3), and the request fails with rank_lost naming rank 1 within
    LOST_BOUND_S instead of waiting in the collective."""
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    ranks = Ranks(tmp_path, model_dir, "tensor", tmp_path / "sessions",
                  follower_env={"LOCALHEAP_TEST_FOLLOWER_FAULT": "next:5"}).wait_ready()
    try:
        began = time.monotonic()
        r = httpx.post(ranks.url + "/v1/chat/completions", timeout=120, json={
            "model": ranks.model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": TURNS[0]}]})
        assert time.monotonic() - began < LOST_BOUND_S + 30, ranks.log()   # + the prefill
        assert r.status_code == 503 and r.json()["error"]["code"] == "rank_lost", (r.text, ranks.log())
        assert "rank 1" in r.json()["error"]["message"], r.text
        assert ranks.procs[1].wait(10) == 3, ranks.log()
        assert httpx.get(ranks.url + "/health", timeout=5).status_code == 503
    finally:
        ranks.stop()
    ranks.logs[1].seek(0)
    follower_log = ranks.logs[1].read()
    assert "next failed on this rank mid-step" in follower_log and "InjectedFault" in follower_log, follower_log


STEP_TIMEOUT_S = 5   # the test's --step-timeout: far above one step of the demo model, even on a busy CPU


def test_a_follower_alive_but_stuck_mid_step_fails_the_request_within_the_step_timeout(tmp_path):
    """Rank 1 stays alive, its heartbeat beating, but never ends its second generation (a test
    stall): rank 0 waits in that step's collective. Past --step-timeout the request fails with
    rank_lost saying the ranks did not answer within it, /health says so, and SIGTERM ends rank 0
    (status 1), whose end ends rank 1. The first turn, with the same bound, runs as usual."""
    from localheap.backends.mlx.follow import STALL_ENV

    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    ranks = Ranks(tmp_path, model_dir, "tensor", tmp_path / "sessions", *RECALL["off"],
                  "--step-timeout", str(STEP_TIMEOUT_S), follower_env={STALL_ENV: "generate:2"}).wait_ready()
    try:
        post = lambda path, json, headers={}: httpx.post(ranks.url + path, json=json, timeout=120)  # noqa: E731
        history: list = []
        chat(post, history, TURNS[0], ranks.model)
        began = time.monotonic()
        try:
            r = httpx.post(ranks.url + "/v1/chat/completions", timeout=STEP_TIMEOUT_S + 30, json={
                "model": ranks.model, "max_tokens": MAX_TOKENS, "temperature": 0,
                "messages": [*history, {"role": "user", "content": TURNS[1]}]})
        except httpx.ReadTimeout:
            pytest.fail("the request hung on the stuck rank\n" + ranks.log())
        took = time.monotonic() - began
        print(f"a stuck follower: the request failed {took:.2f} s after it was sent (--step-timeout {STEP_TIMEOUT_S})")
        assert r.status_code == 503 and r.json()["error"]["code"] == "rank_lost", (r.text, ranks.log())
        message = r.json()["error"]["message"]
        assert f"did not answer within {STEP_TIMEOUT_S} s" in message and "--step-timeout" in message, message
        assert ranks.procs[1].poll() is None, ranks.log()   # alive: its heartbeat alone could not tell
        health = httpx.get(ranks.url + "/health", timeout=5)
        assert health.status_code == 503 and "did not answer within" in health.json()["ranks"]["lost"], health.text
        ranks.procs[0].send_signal(signal.SIGTERM)
        assert ranks.procs[0].wait(30) == 1, ranks.log()
        assert ranks.procs[1].wait(30) == 1, ranks.log()   # its rank 0 gone: it exits, stuck or not
    finally:
        ranks.stop()


FAIL_BOUND_S = 60   # a failed step answers within this


def fails(ranks, messages: list, step: str, count: int) -> None:
    """The request fails at once on rank 1's injected fault in `step`; the ranks go on (/health ok)."""
    began = time.monotonic()
    r = httpx.post(ranks.url + "/v1/chat/completions", timeout=FAIL_BOUND_S,
                   json={"model": ranks.model, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages})
    assert time.monotonic() - began < FAIL_BOUND_S
    assert r.status_code == 503 and r.json()["error"]["code"] == "rank_failed", (r.text, ranks.log())
    message = r.json()["error"]["message"]
    assert f"rank 1 failed the {step} step" in message and "InjectedFault" in message, message
    health = httpx.get(ranks.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert health.json()["ranks"]["failed_calls"] == count and health.json()["ranks"]["lost"] is None
    assert f"rank 1: {step}: InjectedFault" in health.json()["ranks"]["last_failure"]


def test_a_call_failing_on_a_follower_alone_fails_the_request_and_the_ranks_go_on(tmp_path):
    """Rank 1 alone cannot start its first prefill, then fails its first restore (a heap read):
    each time the request fails at once with 503 rank_failed naming rank 1, the step and the error,
    /health counts it, the session's saved copy is kept, and the same request again gives the
    single-process reply. Rank 1 logs each failure with its traceback."""
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    want = single_process(model_dir, HEAP + RECALL["off"])
    with Ranks(tmp_path, model_dir, "tensor", tmp_path / "sessions",
               follower_env={"LOCALHEAP_TEST_FOLLOWER_FAULT": "prefill:1,load:1"}) as ranks:
        def post(path, json, headers={}):
            return httpx.post(ranks.url + path, json=json, timeout=FAIL_BOUND_S)

        history: list = []
        fails(ranks, [*history, {"role": "user", "content": TURNS[0]}], "prefill", 1)
        first = chat(post, history, TURNS[0], ranks.model)   # the same request again: in step
        chat(post, [], "Hello!", ranks.model)   # spills the first session (one resident)
        fails(ranks, [*history, {"role": "user", "content": TURNS[1]}], "load", 2)
        second = chat(post, history, TURNS[1], ranks.model)   # restored on both ranks this time
        assert ranks.procs[1].poll() is None
    assert [first, second] == want[:2], ranks.log()
    ranks.logs[1].seek(0)
    follower_log = ranks.logs[1].read()
    for step in ("prefill", "load"):
        assert f"InjectedFault: injected failure of {step} #1" in follower_log, follower_log
    assert follower_log.count("Traceback") >= 2, follower_log


ROLLBACK_HEAP = ["--budget", "48", "--recent", "8", "--slack", "256", "--prefill-chunk", "32"]   # a reply rolls back


def regenerate(post, model: str) -> list[dict]:
    """Turn 1, another session (spilling this one), turn 2, then turn 2 again: its reply rolled back
    (the heap cut back to the prompt on every rank) and written anew."""
    history: list = []
    replies = conversation(post, history, TURNS[:2], model)
    return replies + [chat(post, history[:-2], TURNS[1], model)]


def test_a_request_failing_after_the_followers_advanced_leaves_every_rank_at_the_same_turn(tmp_path):
    """Rank 1 fails the generation of turn 2 after every rank read its prompt, then fails a rollback
    (a regenerate cutting every rank's heap back to the prompt): each request fails with rank_failed,
    and the same request again gives the single-process reply, so every rank's heap was back at the
    same turn (a rank left a turn ahead or behind answers differently). The reference is the same
    conversation on 2 ranks with no fault: tensor sharding sums the heads' outputs across ranks, and
    with this heap (no eviction) the sums' rounding makes the replies part from one process's."""
    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    with Ranks(tmp_path, model_dir, "tensor", tmp_path / "reference", heap=ROLLBACK_HEAP) as ranks:
        want = regenerate(lambda path, json, headers={}: httpx.post(ranks.url + path, json=json, timeout=120),
                          ranks.model)
    assert want[2]["text"] == want[1]["text"] and want[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        want[2]["usage"]["prompt_tokens"] - 1, want   # a rollback, not a fresh session
    with Ranks(tmp_path, model_dir, "tensor", tmp_path / "sessions", heap=ROLLBACK_HEAP,
               follower_env={"LOCALHEAP_TEST_FOLLOWER_FAULT": "generate:3,truncate:1"}) as ranks:
        post = lambda path, json, headers={}: httpx.post(ranks.url + path, json=json, timeout=120)  # noqa: E731
        history: list = []
        got = [chat(post, history, TURNS[0], ranks.model)]
        chat(post, [], "Hello!", ranks.model)   # spills the first session
        asked = [*history, {"role": "user", "content": TURNS[1]}]
        fails(ranks, asked, "generate", 1)   # after every rank restored the session and read the prompt
        got.append(chat(post, history, TURNS[1], ranks.model))
        fails(ranks, asked, "truncate", 2)   # the regenerate's rollback
        got.append(chat(post, history[:-2], TURNS[1], ranks.model))
        assert ranks.procs[1].poll() is None
    assert got == want, ranks.log()


def test_a_follower_failing_inside_a_forward_logs_it_and_leaves_the_ring(tmp_path, caplog):
    """A forward that fails on a follower once started (rank 0 is inside its collectives): the
    follower cannot get back in step, so it logs the traceback and says the process must exit."""
    from localheap.backends.mlx import follow as follow_mod

    class Shard:
        rank = 1

        class ranks:
            any = staticmethod(lambda flag: flag)
            notes = staticmethod(lambda note: [note])

        def new_cache(self, cfg, pages_dir):
            return object()

        def prefill(self, cache, tokens):
            raise MemoryError("out of memory on this host")

    from localheap.heap import HeapConfig
    cfg = HeapConfig(budget=48, recent=8).to_dict()
    commands = [{"op": "new", "drop": [], "handle": 1, "cfg": cfg, "pages_dir": None},
                {"op": "prefill", "drop": [], "handle": 1, "tokens": [1, 2, 3]},
                {"op": "stop", "drop": []}]
    sent = iter(commands)
    follow_mod_broadcast = follow_mod.broadcast
    try:
        follow_mod.broadcast = lambda ranks, payload: json.dumps(next(sent)).encode()
        with caplog.at_level("ERROR", logger="localheap.distributed"):
            assert follow_mod.follow(Shard(), tmp_path) == follow_mod.OUT_OF_STEP_EXIT
    finally:
        follow_mod.broadcast = follow_mod_broadcast
    assert "prefill failed on this rank mid-step" in caplog.text and "MemoryError" in caplog.text


def test_chat_on_two_ranks_gives_the_single_process_reply(tmp_path):
    from localheap.backends.mlx import MLXBackend
    from localheap.commands.chat_engine import ChatEngine
    from localheap.generation import SamplingParams
    from localheap.heap import HeapConfig

    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    cfg = HeapConfig(budget=48, recent=8, slack=16, prefill_chunk=32)
    one = ChatEngine(MLXBackend.load(model_dir), cfg)
    try:
        want = [one.ask(t, SamplingParams(max_tokens=24, temperature=0.0), lambda _: None).text for t in TURNS[:2]]
    finally:
        one.close()
    ring, ring2 = free_ports(2)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring2}"]]))
    cmd = [sys.executable, "-m", "localheap.cli", "chat", "--distributed", "tensor", "--model", str(model_dir),
           "--max-tokens", "24", "--temperature", "0", *HEAP, *RECALL["off"]]
    procs = [subprocess.Popen(cmd, env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    out = [p.communicate("\n".join([*TURNS[:2], "/quit", ""]) if r == 0 else "", timeout=START_S)
           for r, p in enumerate(procs)]
    assert [p.returncode for p in procs] == [0, 0], out
    assert all(w.strip() and w in out[0][0] for w in want), (want, out[0])


@pytest.mark.parametrize("fault", ["stuck", "exits"])
def test_chat_on_two_ranks_whose_follower_is_stuck_or_exits_says_why_and_exits_1(tmp_path, fault):
    """`chat --distributed`, rank 1 alive but stuck in the first reply's generation (past
    --step-timeout), or leaving the ring at its 5th generated token (exit 3): rank 0 prints why the
    ranks are lost and exits with status 1 instead of hanging or chatting on; rank 1 exits too."""
    from localheap.backends.mlx.follow import FAULT_ENV, STALL_ENV

    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    ring, ring2 = free_ports(2)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring2}"]]))
    cmd = [sys.executable, "-m", "localheap.cli", "chat", "--distributed", "tensor", "--model", str(model_dir),
           "--max-tokens", "24", "--temperature", "0", "--step-timeout", str(STEP_TIMEOUT_S), *HEAP, *RECALL["off"]]
    follower = {STALL_ENV: "generate:1"} if fault == "stuck" else {FAULT_ENV: "next:5"}
    procs = [subprocess.Popen(cmd, env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts),
                                        **(follower if r else {})},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        out = [p.communicate("\n".join([*TURNS[:2], "/quit", ""]) if r == 0 else "", timeout=START_S)
               for r, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    said = out[0][0] + out[0][1]
    assert [p.returncode for p in procs] == [1, 1 if fault == "stuck" else 3], out
    want = f"did not answer within {STEP_TIMEOUT_S} s" if fault == "stuck" else "rank lost: rank 1"
    assert want in said and "restart every rank" in said, out
    assert TURNS[1] not in said, out   # echo-free, but to be sure: nothing after the first turn


def test_chat_ends_with_status_1_when_a_reply_finds_the_ranks_lost(monkeypatch, capsys):
    """A reply that fails with RankLost (the ring failed the collective itself) ends the chat with
    status 1 and the reason: every later message would fail the same way."""
    import argparse

    from localheap.commands import chat as chat_cmd
    from localheap.commands import chat_engine
    from localheap.engine import RankLost
    from localheap.heap import HeapConfig

    asked = []

    class LostChat:
        store = type("Store", (), {"spill_dir": None})()

        def __init__(self, backend, cfg, system=None):
            pass

        def ask(self, text, params, on_text):
            asked.append(text)
            raise RankLost("rank lost: rank 1 ended (its process is gone); the ranks cannot go on: restart every rank")

        def ensure_session(self):
            return True

        def close(self):
            pass

    monkeypatch.setattr(chat_engine, "ChatEngine", LostChat)
    typed = iter(["hello", "again", "/quit"])
    monkeypatch.setattr(chat_cmd, "read_message", lambda: next(typed))
    args = argparse.Namespace(distributed="tensor", system=None, max_tokens=4, temperature=0.0, top_p=1.0, seed=None,
                              min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repeat_penalty=1.0,
                              repeat_last_n=64)
    backend = type("Leader", (), {"model_name": "demo", "name": "mlx"})()
    assert chat_cmd.chat_on(backend, HeapConfig(budget=48, recent=8), args) == 1
    assert asked == ["hello"]
    assert "error: rank lost: rank 1 ended" in capsys.readouterr().out


class FakeRanks:
    def __init__(self, fits: list[int]):
        self.fits = fits

    def each(self, n: int) -> list[int]:
        return [n, *self.fits[1:]]


def test_the_tightest_rank_sets_the_resident_heaps(monkeypatch):
    """Each rank plans its own RAM; rank 0's governor admits what every rank can hold."""
    import localheap.governor as governor
    from localheap.commands.ranks import agreed_plan
    from localheap.governor import MemoryPlan
    from localheap.governor.budget import BudgetTooSmall

    mine = MemoryPlan(budget=1000, weights=100, heap=50, overhead=100)   # room for 16 heaps here
    monkeypatch.setattr(governor, "plan_for", lambda backend, cfg, budget: mine)
    backend = type("Shard", (), {})()
    backend.ranks = FakeRanks([None, 3])
    plan = agreed_plan(backend, None, None)
    assert (mine.max_resident, plan.max_resident) == (16, 3)
    backend.ranks = FakeRanks([None, 0])
    with pytest.raises(SystemExit, match="rank 1 cannot hold one heap"):
        agreed_plan(backend, None, None)

    def too_small(backend, cfg, budget):
        raise BudgetTooSmall(need=2, have=1, advice="raise --ram-budget")

    monkeypatch.setattr(governor, "plan_for", too_small)
    backend.ranks = FakeRanks([None, 3])
    with pytest.raises(BudgetTooSmall):
        agreed_plan(backend, None, None)


def test_a_follower_removes_its_own_files_of_a_session(tmp_path, monkeypatch):
    """On another host a follower keeps its shards under its own sessions directory: when rank 0's
    store removes a session's old generation (or the whole session), the follower removes its own."""
    from localheap.backends.mlx import follow as follow_mod
    from localheap.commands.ranks import remove_files

    sid = "sess_abc"
    for name in (f"{sid}.0.tensor-rank1of2.safetensors", f"{sid}.1.tensor-rank1of2.safetensors",
                 f"{sid}.pages/rank1/layer0.bin", f"checkpoints/{sid}/3.tensor-rank1of2.safetensors",
                 "sess_other.0.tensor-rank1of2.safetensors"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    commands = [{"op": "remove", "drop": [], "session": sid, "keep_gen": 1, "whole": False},
                {"op": "remove", "drop": [], "session": "../etc", "keep_gen": None, "whole": True},
                {"op": "stop", "drop": []}]
    monkeypatch.setattr(follow_mod, "broadcast", lambda ranks, payload: json.dumps(commands.pop(0)).encode())
    shard = type("Shard", (), {"rank": 1, "ranks": None})()
    assert follow_mod.follow(shard, tmp_path, remove_files) == 0
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == [f"checkpoints/{sid}/3.tensor-rank1of2.safetensors", f"{sid}.1.tensor-rank1of2.safetensors",
                    f"{sid}.pages/rank1/layer0.bin", "sess_other.0.tensor-rank1of2.safetensors"]
    commands[:] = [{"op": "remove", "drop": [], "session": sid, "keep_gen": None, "whole": True},
                   {"op": "stop", "drop": []}]
    assert follow_mod.follow(shard, tmp_path, remove_files) == 0
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["sess_other.0.tensor-rank1of2.safetensors"]


def test_a_checkpoint_the_cap_drops_leaves_no_file_on_any_rank(tmp_path):
    """Each rank with a sessions directory of its own (as on two hosts): a session checkpointed
    more times than the per-session cap keeps its newest checkpoints (and its first); the one the
    cap drops is removed on rank 0 and, through the step stream, on rank 1. What is kept is on both:
    a restart restores the session and forks from a checkpoint; at that start rank 1 removes its
    files that no saved session holds (a crash's leftovers), and only its own."""
    from localheap.sessions.checkpoints import PER_SESSION

    model_dir = demo_model_dir()
    if model_dir is None:
        pytest.skip("no bundled demo model in this installation")
    dirs = [tmp_path / "host0", tmp_path / "host1"]
    made = []
    with Ranks(tmp_path, model_dir, "tensor", dirs) as ranks:
        history: list = []
        for n in range(PER_SESSION + 1):
            history.append({"role": "user", "content": f"Say a word about the number {n}."})
            r = httpx.post(ranks.url + "/v1/chat/completions", timeout=120, json={
                "model": ranks.model, "messages": history, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, (r.text, ranks.log())
            sid = r.json()["localheap"]["session_id"]
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            c = httpx.post(f"{ranks.url}/v1/sessions/{sid}/checkpoint", timeout=120)
            assert c.status_code == 201, (c.text, ranks.log())
            made.append(c.json()["tokens"])
            kept = c.json()["session"]["checkpoints"]
        r = httpx.post(ranks.url + "/v1/chat/completions", timeout=120, json={   # rank 1 has done each command
            "model": ranks.model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 1})
        assert r.status_code == 200, (r.text, ranks.log())
        shards = lambda d, r: sorted(int(p.name.split(".")[0]) for p in   # noqa: E731
                                     (d / "checkpoints" / sid).glob(f"*.tensor-rank{r}of2.safetensors"))
        held = [shards(dirs[0], 0), shards(dirs[1], 1)]
        assert ranks.procs[1].poll() is None, ranks.log()
    assert len(set(made)) == PER_SESSION + 1 and kept == [made[0], *made[2:]], (made, kept)
    assert held == [kept, kept], (held, kept, made)   # made[1] dropped on every rank
    assert not list((dirs[1] / "checkpoints" / sid).glob(f"{made[1]}.*")), sorted((dirs[1] / "checkpoints").rglob("*"))
    # what rank 1 could have kept on its host from a crash, or from removals it never heard of
    orphan = "sess_0rphan"
    stale = [f"{orphan}.0.tensor-rank1of2.safetensors", f"{sid}.99.tensor-rank1of2.safetensors",
             f"{orphan}.pages/rank1/meta.json", f"checkpoints/{orphan}/22.tensor-rank1of2.safetensors",
             f"checkpoints/{sid}/{made[1]}.tensor-rank1of2.safetensors"]
    others = [f"{orphan}.0.tensor-rank0of2.safetensors"]   # another rank's file in a shared directory: not rank 1's
    for name in stale + others:
        (dirs[1] / name).parent.mkdir(parents=True, exist_ok=True)
        (dirs[1] / name).write_bytes(b"x")
    # a restart on the same directories restores the session from each rank's own, and forks from a checkpoint
    with Ranks(tmp_path, model_dir, "tensor", dirs) as ranks:
        history.append({"role": "user", "content": "And one more word."})
        r = httpx.post(ranks.url + "/v1/chat/completions", timeout=120, json={
            "model": ranks.model, "messages": history, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["localheap"]["session_id"] == sid, (r.text, ranks.log())
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= made[-1], r.text   # from disk
        fork = httpx.post(f"{ranks.url}/v1/sessions/{sid}/fork", json={"tokens": made[0]}, timeout=120)
        assert fork.status_code == 201 and fork.json()["forked_from"]["tokens"] == made[0], (fork.text, ranks.log())
    left = [name for name in stale + others if (dirs[1] / name).exists()]
    assert left == others, left   # rank 1 pruned its files that no saved session holds, at start
    assert not (dirs[1] / f"{orphan}.pages").exists() and not (dirs[1] / "checkpoints" / orphan).exists()


def test_rank_0s_governor_spills_for_a_follower_past_its_ram_budget(tmp_path, monkeypatch):
    """At an admission rank 0's governor reads every rank's memory (a "reading" command, then one
    collective each): a follower past its own RAM budget, or a host short of memory, makes rank 0
    spill an idle session as its own would; rank 0's own reading alone would admit with no spill."""
    from localheap.backends.mlx import follow as follow_mod
    from localheap.commands.ranks import RankSensors, own_reading
    from localheap.governor import MemoryPlan
    from localheap.governor.governor import Governor, MemoryReading

    class Sensors:
        def __init__(self, rss, available):
            self.r = MemoryReading(rss=rss, allocator_active=0, allocator_cache=0, available=available, swap_used=0)

        def memory(self):
            return self.r

        def thermal(self):
            return "nominal"

    GiB = 1 << 30
    plan = MemoryPlan(budget=4 * GiB, weights=GiB, heap=GiB // 8, overhead=GiB // 2)   # room for 20 heaps
    follower_said = []

    class Leader:   # rank 1's answer comes from its own loop, fed the command rank 0 sent
        def __init__(self, rank1):
            self.rank1 = rank1

        def readings(self, over, available):
            commands = [{"op": "reading", "drop": []}, {"op": "stop", "drop": []}]
            monkeypatch.setattr(follow_mod, "broadcast", lambda ranks, payload: json.dumps(commands.pop(0)).encode())
            shard = type("Shard", (), {"rank": 1})()
            shard.ranks = type("R", (), {"each": staticmethod(follower_said.append)})()
            assert follow_mod.follow(shard, tmp_path, None, own_reading(self.rank1, plan.budget)) == 0
            return [(over, available), tuple(follower_said[-2:])]

    calm = Sensors(rss=2 * GiB, available=8 * GiB)
    for rank1, spills in [(Sensors(rss=2 * GiB, available=8 * GiB), 0),          # every rank within its budget
                          (Sensors(rss=4 * GiB - GiB // 16, available=8 * GiB), 1),   # rank 1 past its budget with one more heap
                          (Sensors(rss=2 * GiB, available=64 << 20), 1)]:            # rank 1's host short of RAM
        alone = Governor(plan, calm).admit(3, ["a", "b"])
        assert alone.action == "admit" and alone.spill == []
        decision = Governor(plan, RankSensors(calm, Leader(rank1), plan.budget)).admit(3, ["a", "b"])
        assert decision.action == "admit" and decision.spill == ["a", "b"][:spills], (rank1.r, decision)


@pytest.mark.parametrize("command", [["serve", "--no-persist"], ["chat"]])
def test_serve_and_chat_distributed_outside_mlx_launch_say_how(capsys, command):
    from localheap.cli import main

    assert main([*command, "--distributed", "tensor"]) == 2
    assert "mlx.launch" in capsys.readouterr().err


def test_serve_distributed_refuses_a_disk_total_and_says_why(capsys):
    from localheap.cli import main

    assert main(["serve", "--no-persist", "--distributed", "tensor", "--disk-total", "10G"]) == 2
    err = capsys.readouterr().err
    assert "--disk-total does not run with --distributed" in err and "recall vote" in err, err
    assert "mlx.launch" not in err   # refused before anything loads

