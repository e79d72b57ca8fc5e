"""The agent CLIs people point at a local server, run for real against this one: OpenAI's Codex
CLI on /v1/responses and Anthropic's Claude Code on /v1/messages, each making a tool call that the
CLI itself carries out (a shell command), then reading the result back and finishing its turn; and
the Vercel AI SDK's OpenAI provider (which opencode and many JavaScript agents build on), running a
tool over /v1/responses.

The tiny model will not choose to call a tool, so its replies are forced (the server's test-only
`force_tokens` hook); everything else is real: the CLI's own requests (its system prompt, its
dozens of tools, Codex's namespaced and hosted tools, Claude Code's fields), the template, the
tool-call parser, the stream, the sessions. The CLIs come from npm at pinned versions (.ci/run
installs them under .ci/clients); elsewhere these tests skip unless LOCALHEAP_CODEX /
LOCALHEAP_CLAUDE name the binaries (LOCALHEAP_NODE_CLIENTS a directory whose node_modules holds
`ai` and `@ai-sdk/openai`), and fail where LOCALHEAP_REQUIRE_AGENT_CLIS is set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from localheap.grammar import ForcedTokens
from tool_server import qwen_model, serve

NODE_CLIENTS = Path(__file__).resolve().parents[1] / ".ci" / "clients"   # npm install --prefix .ci/clients
CLIENTS = NODE_CLIENTS / "node_modules" / ".bin"
REQUIRED = bool(os.environ.get("LOCALHEAP_REQUIRE_AGENT_CLIS"))


def cli(name: str, env: str) -> str:
    path = os.environ.get(env) or shutil.which(name, path=str(CLIENTS)) or ""
    if not path or not os.access(path, os.X_OK):
        if REQUIRED:
            pytest.fail(f"{name} is not installed (.ci/run installs it with npm; or set {env})")
        pytest.skip(f"no {name}: npm install @openai/codex @anthropic-ai/claude-code, or set {env}")
    return path


class Recorder:
    """ASGI middleware: keeps the JSON body of every POST to `path`, as the CLI sent it."""

    def __init__(self, app, path: str, bodies: list):
        self.app, self.path, self.bodies = app, path, bodies

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.bodies.append(json.loads(body))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def run_forced(model_dirs, tmp_path_factory, path: str, replies: list[str], command) -> tuple:
    """Serve the tiny Qwen-template model, force `replies` one request after another, record the
    bodies POSTed to `path`, and run `command(url, model_id)` -> CompletedProcess."""
    srv = serve(qwen_model(model_dirs, tmp_path_factory))
    bodies: list = []
    srv.app.add_middleware(Recorder, path=path, bodies=bodies)
    with srv:
        svc = srv.services
        ids = [svc.tokenizer.encode(t, add_special_tokens=False) for t in replies]
        svc.force_tokens = lambda: ForcedTokens(ids.pop(0) if ids else [], svc.backend.eos_token_ids)
        done = command(srv.url, svc.model_id)
    assert not ids, f"{len(ids)} forced replies were not asked for ({len(bodies)} requests)"
    return done, bodies


def codex_exec(codex: str, home: Path, work: Path, url: str, model_id: str, prompt: str, top: str = "",
               tables: str = ""):
    """`codex exec` at the server as a Responses provider (`top`: more top-level settings, `tables`:
    more TOML tables), its approvals and sandbox bypassed."""
    (home / "config.toml").write_text(
        f'{top}model = "{model_id}"\nmodel_provider = "localheap"\n[model_providers.localheap]\n'
        f'name = "localheap"\nbase_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "LOCALHEAP_KEY"\n{tables}')
    env = {**os.environ, "CODEX_HOME": str(home), "LOCALHEAP_KEY": "unused"}
    return subprocess.run([codex, "exec", "--json", "--skip-git-repo-check",
                           "--dangerously-bypass-approvals-and-sandbox", prompt],
                          cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


def agent_messages(events: list[dict]) -> list[str]:
    return [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]


def test_codex_runs_a_command_and_a_namespaced_tool(model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    codex = cli("codex", "LOCALHEAP_CODEX")
    replies = ['<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hello-from-codex"}}\n</tool_call>',
               '<tool_call>\n{"name": "multi_agent_v1.close_agent", "arguments": {"target": "nobody"}}\n</tool_call>',
               "All done."]
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()

    done, bodies = run_forced(model_dirs, tmp_path_factory, "/v1/responses", replies,
                              lambda url, model_id: codex_exec(codex, home, work, url, model_id, "say hello"))
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (ran,) = [e["item"] for e in events if e["type"] == "item.completed"
              and e["item"]["type"] == "command_execution"]
    assert ran["aggregated_output"] == "hello-from-codex\n" and ran["exit_code"] == 0
    assert agent_messages(events) == ["All done."]
    assert "unsupported call" not in done.stderr, "the namespaced call reached its tool"
    assert len(bodies) == 3
    assert any(t["type"] == "namespace" for t in bodies[0]["tools"])   # what the test is about
    (call,) = [i for i in bodies[2]["input"] if i.get("type") == "function_call" and i.get("namespace")]
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "close_agent")
    assert any(i.get("type") == "function_call_output" and i["call_id"] == call["call_id"] for i in bodies[2]["input"])
    outputs = [i["output"] for i in bodies[1]["input"] if i.get("type") == "function_call_output"]
    assert len(outputs) == 1 and "hello-from-codex" in json.dumps(outputs[0])
    usage = next(e["usage"] for e in events if e["type"] == "turn.completed")
    assert usage["cached_input_tokens"] > usage["input_tokens"] / 2, "each turn continued the session"


def test_codex_applies_a_patch_through_its_freeform_tool(model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    """A model Codex's catalog (model_catalog_json) gives the freeform apply_patch tool: Codex offers
    it as a custom tool with its Lark grammar, reads the streamed custom_tool_call (with
    apply_patch_streaming_events on), applies the patch, and sends the call and its output back. (That
    the input streams in parts is test_server_responses' to check: Codex's output does not show the parts.)"""
    codex = cli("codex", "LOCALHEAP_CODEX")
    patch = '*** Begin Patch\n*** Add File: notes.txt\n+hello "heap"\n+\tindented\n*** End Patch\n'
    replies = ["<tool_call>\n" + json.dumps({"name": "apply_patch", "arguments": {"input": patch}}) + "\n</tool_call>",
               "Patched."]
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()

    def run(url: str, model_id: str):
        (home / "catalog.json").write_text(json.dumps({"models": [{
            "slug": model_id, "display_name": "localheap", "description": "A local model.",
            "apply_patch_tool_type": "freeform", "shell_type": "shell_command", "visibility": "list",
            "supported_in_api": True, "priority": 1, "context_window": 32768,
            "truncation_policy": {"mode": "tokens", "limit": 10000}, "supported_reasoning_levels": [],
            "input_modalities": ["text"], "supports_parallel_tool_calls": False, "support_verbosity": False,
            "experimental_supported_tools": [], "base_instructions": "You edit files."}]}))
        return codex_exec(codex, home, work, url, model_id, "write the notes",
                          top=f'model_catalog_json = "{home / "catalog.json"}"\nsuppress_unstable_features_warning = true\n',
                          tables="[features]\napply_patch_freeform = true\napply_patch_streaming_events = true\n")

    done, bodies = run_forced(model_dirs, tmp_path_factory, "/v1/responses", replies, run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (work / "notes.txt").read_text() == 'hello "heap"\n\tindented\n', "Codex applied the patch"
    (tool,) = [t for t in bodies[0]["tools"] if t.get("name") == "apply_patch"]
    assert tool["type"] == "custom" and tool["format"]["syntax"] == "lark"   # what the test is about
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert agent_messages(events) == ["Patched."]
    (call,) = [i for i in bodies[1]["input"] if i.get("type") == "custom_tool_call"]
    assert call["name"] == "apply_patch" and call["input"] == patch
    assert any(i.get("type") == "custom_tool_call_output" and i["call_id"] == call["call_id"]
               for i in bodies[1]["input"])


def test_claude_code_runs_a_command(model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    claude = cli("claude", "LOCALHEAP_CLAUDE")
    replies = ['<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hello-from-claude > out.txt", '
               '"description": "Write a file"}}\n</tool_call>', "All done."]
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()

    def run(url: str, model_id: str):
        env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-unused",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        return subprocess.run([claude, "-p", "write hello", "--model", model_id, "--output-format", "stream-json",
                               "--verbose", "--allowedTools", "Bash"],
                              cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)

    done, bodies = run_forced(model_dirs, tmp_path_factory, "/v1/messages", replies, run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (work / "out.txt").read_text() == "hello-from-claude\n", "Claude Code ran the call"
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    result = events[-1]
    assert result["type"] == "result" and not result["is_error"] and result["result"] == "All done."
    assert len(bodies) == 2
    (use,) = [b for m in bodies[1]["messages"] if isinstance(m["content"], list) for b in m["content"]
              if b.get("type") == "tool_use"]
    assert use["name"] == "Bash" and use["input"]["command"] == "echo hello-from-claude > out.txt"
    assert result["usage"]["cache_read_input_tokens"] > result["usage"]["input_tokens"] / 2, "the session continued"


def test_codex_oss_takes_the_server_for_ollama(model_dirs, tmp_path_factory, tmp_path, torch_one_thread):
    """`codex --oss --local-provider ollama` (the server where Ollama would be: CODEX_OSS_BASE_URL, or
    `localheap serve --port 11434`) asks /api/version for 0.13.4 or newer, finds the model in
    /api/tags (or pulls it), then speaks /v1/responses."""
    codex = cli("codex", "LOCALHEAP_CODEX")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()

    def run(url: str, model_id: str):
        env = {**os.environ, "CODEX_HOME": str(home), "CODEX_OSS_BASE_URL": url + "/v1"}
        return subprocess.run([codex, "exec", "--json", "--skip-git-repo-check", "--oss", "--local-provider",
                               "ollama", "-m", model_id, "-s", "read-only", "say hello"],
                              cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)

    done, bodies = run_forced(model_dirs, tmp_path_factory, "/v1/responses", ["Hello from the heap."], run)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert agent_messages(events) == ["Hello from the heap."]
    assert len(bodies) == 1


AI_SDK_SCRIPT = """
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText, tool, stepCountIs } from "ai";
import { z } from "zod";
const [base, model] = process.argv.slice(-2);
const openai = createOpenAI({ baseURL: base + "/v1", apiKey: "unused" });
const seen = [];
const tools = { get_weather: tool({ description: "Weather in a city",
  inputSchema: z.object({ city: z.enum(["Paris", "Lyon", "Nice"]) }),
  execute: async ({ city }) => { seen.push(city); return `18C in ${city}`; } }) };
const args = { model: openai(model), prompt: "Weather in Paris?", tools, stopWhen: stepCountIs(3), maxOutputTokens: 200 };
const whole = await generateText(args);
const streamed = streamText(args);
let text = "";
for await (const part of streamed.textStream) text += part;
console.log(JSON.stringify({ whole: whole.text, steps: whole.steps.length, streamed: text,
                             streamedSteps: (await streamed.steps).length, seen }));
"""


def test_the_ai_sdks_openai_provider_runs_a_tool(model_dirs, tmp_path_factory, torch_one_thread):
    """The AI SDK's `openai(model)` speaks /v1/responses and sends a kept response's reasoning back
    as an item_reference: a call (after reasoning), its result, an answer; whole, then streamed."""
    where = Path(os.environ.get("LOCALHEAP_NODE_CLIENTS") or NODE_CLIENTS)
    node = shutil.which("node")
    if node is None or not (where / "node_modules" / "@ai-sdk" / "openai").is_dir():
        if REQUIRED:
            pytest.fail("the AI SDK is not installed (.ci/run installs it with npm)")
        pytest.skip("no AI SDK: npm install --prefix .ci/clients ai @ai-sdk/openai zod")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    replies = ["<think>\nlook it up\n</think>\n\n" + call, "It is 18C in Paris."] * 2

    def run(url: str, model_id: str):
        return subprocess.run([node, "--input-type=module", "-e", AI_SDK_SCRIPT, url, model_id], cwd=where,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)

    done, bodies = run_forced(model_dirs, tmp_path_factory, "/v1/responses", replies, run)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"whole": "It is 18C in Paris.", "steps": 2, "streamed": "It is 18C in Paris.",
                   "streamedSteps": 2, "seen": ["Paris", "Paris"]}
    assert any(i.get("type") == "item_reference" for i in bodies[1]["input"]), "what the test is about"
