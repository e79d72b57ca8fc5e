"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version) through the
real server (uvicorn in a thread, a tiny torch model carrying a Qwen-style template) driven by
Ollama's own Python client, unmodified: the chat route's prompt and reply, whole and streamed as
NDJSON; tool calls with their arguments as objects, and a conversation sent back with them
(Ollama's calls carry no ids) rendering the prompt the OpenAI route renders; thinking; JSON
format held by the grammar; options mapped or refused by name; errors in Ollama's shape."""

from __future__ import annotations

import json

import httpx
import pytest

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

from localheap.server.ollama import ChatRequest  # noqa: E402
from localheap.server.errors import PromptTooLong  # noqa: E402
from localheap.server.prompts import ChatOptions, after_context, chat_prompt  # noqa: E402
from localheap.server.schemas import ChatMessage  # noqa: E402
from localheap.sessions import Prompt  # noqa: E402
from localheap.server.toolformats import tool_format  # noqa: E402
from tool_server import CALL, CITY, qwen_model, serve  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory, torch_one_thread):
    with serve(qwen_model(model_dirs, tmp_path_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


def model(server) -> str:
    return server.services.model_id


def test_chat_is_the_chat_routes_reply_whole_and_streamed(server, client):
    options = {"temperature": 0, "num_predict": 12}
    msgs = [{"role": "user", "content": "The pass key"}]
    whole = client.chat(model=model(server) + ":latest", messages=msgs, options=options)
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="x").chat.completions.create(
        model=model(server), messages=msgs, max_tokens=12, temperature=0)
    assert whole.message.content == chat.choices[0].message.content
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    assert whole.prompt_eval_count + chat.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 1
    assert whole.total_duration >= whole.eval_duration > 0
    parts = list(client.chat(model=model(server), messages=msgs, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == whole.message.content
    raw = httpx.post(server.url + "/api/chat", json={"model": model(server), "messages": msgs, "options": options},
                     timeout=60)
    assert raw.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.text.splitlines()]
    assert lines[-1]["localheap"]["session_id"] == raw.headers["x-session-id"]


def test_generate_whole_streamed_and_raw(server, client):
    options = {"temperature": 0, "num_predict": 8}
    whole = client.generate(model=model(server), prompt="The pass key", options=options)
    parts = list(client.generate(model=model(server), prompt="The pass key", options=options, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].eval_count == 8
    chat = client.chat(model=model(server), messages=[{"role": "user", "content": "The pass key"}], options=options)
    assert whole.response == chat.message.content   # a prompt is a user message through the template
    raw = client.generate(model=model(server), prompt="The pass key", raw=True, options=options)
    text = openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
        model=model(server), prompt="The pass key", max_tokens=8, temperature=0)
    assert raw.response == text.choices[0].text   # raw: no template, as /v1/completions
    loaded = client.generate(model=model(server), prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    for keep in (0, "0", "0s", "0m"):   # Ollama's unload: it says so (the model stays: it is the one served)
        gone = client.generate(model=model(server), prompt="", keep_alive=keep)
        assert gone.done_reason == "unload", keep
        assert client.chat(model=model(server), messages=[], keep_alive=keep).done_reason == "unload"
    assert client.generate(model=model(server), prompt="", keep_alive="5m").done_reason == "load"
    # Ollama's repetition penalty: taken (it was refused), a greedy raw reply is what /v1/completions
    # gives with llama-server's same option, and a strong one changes the reply
    assert client.generate(model=model(server), prompt="x", options={"num_predict": 4, "typical_p": 0.5, "seed": 1})
    assert client.generate(model=model(server), prompt="x", options={"num_predict": 4, "mirostat": 2, "seed": 1,
                                                                     "mirostat_tau": 3.0, "mirostat_eta": 0.2})
    penalized = {**options, "repeat_penalty": 4.0, "repeat_last_n": 16}
    pen = client.generate(model=model(server), prompt="The pass key", raw=True, options=penalized)
    same = httpx.post(server.url + "/v1/completions", json={"prompt": "The pass key", "max_tokens": 8, "temperature": 0,
                                                            "repeat_penalty": 4.0, "repeat_last_n": 16}, timeout=60)
    assert pen.response == same.json()["choices"][0]["text"] != raw.response


def test_a_tool_call_and_its_result_sent_back(server, client, force):
    force(CALL)
    r = client.chat(model=model(server), messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                    options={"num_predict": 60})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert r.message.content == "" and r.done_reason == "stop"
    force(CALL)
    streamed = [p for p in client.chat(model=model(server), messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=TOOLS, stream=True) if p.message.tool_calls]
    assert [c.function.arguments for p in streamed for c in p.message.tool_calls] == [{"city": "Paris"}]
    # the conversation sent back as Ollama's clients send it (no call ids; the result names its tool)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                 "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    force("Sunny.")
    again = client.chat(model=model(server), messages=history, tools=TOOLS)
    assert again.message.content == "Sunny."
    req = ChatRequest(model="m", messages=history, tools=TOOLS)
    ours = chat_prompt(server.services.tokenizer, req.chat_messages(),
                       opts=ChatOptions(TOOLS, tool_format(server.services.tokenizer)))
    theirs = chat_prompt(server.services.tokenizer, [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", content=None, tool_calls=[
            {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        ChatMessage(role="tool", tool_call_id="x", content="sunny")],
        opts=ChatOptions(TOOLS, tool_format(server.services.tokenizer)))
    assert list(ours.tokens) == list(theirs.tokens)
    assert again.prompt_eval_count < len(ours.tokens), "the session the conversation extends was reused"


def test_thinking(server, client, force):
    force("<think>\nplan\n</think>\n\nHello.")
    r = client.chat(model=model(server), messages=[{"role": "user", "content": "Hi"}], think=True)
    assert r.message.thinking == "\nplan\n" and r.message.content == "Hello."
    force("<think>\nplan\n</think>\n\nHello.")
    parts = list(client.generate(model=model(server), prompt="Hi", stream=True))
    assert "".join(p.thinking or "" for p in parts) == "\nplan\n" and "".join(p.response for p in parts) == "Hello."


def test_logprobs_whole_and_streamed(server, client, force):
    """logprobs (and top_logprobs): each generated token once, in the line its text comes out in,
    as Ollama's client reads them; the chat route's figures for the same prompt; thinking's tokens
    listed too; none asked for, none sent."""
    msgs = [{"role": "user", "content": "The pass key"}]
    options = {"temperature": 0, "num_predict": 10}
    whole = client.chat(model=model(server), messages=msgs, options=options, logprobs=True, top_logprobs=2)
    assert len(whole.logprobs) == 10 and "".join(e.token for e in whole.logprobs) == whole.message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in whole.logprobs)
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="x").chat.completions.create(
        model=model(server), messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in whole.logprobs] == [e.token for e in entries]
    assert [e.logprob for e in whole.logprobs] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    parts = list(client.chat(model=model(server), messages=msgs, options=options, logprobs=True, stream=True))
    for p in parts[:-1]:
        assert "".join(e.token for e in p.logprobs or []) == p.message.content
    assert [e.token for p in parts for e in p.logprobs or []] == [e.token for e in whole.logprobs]
    assert all(not e.top_logprobs for p in parts for e in p.logprobs or [])   # top_logprobs 0: none
    plain = httpx.post(server.url + "/api/generate", timeout=60, json={
        "model": model(server), "prompt": "The pass key", "stream": False, "options": options}).json()
    assert "logprobs" not in plain
    r = httpx.post(server.url + "/api/chat", timeout=60, json={
        "model": model(server), "messages": msgs, "stream": False, "options": options, "truncate": False,
        "shift": False})
    assert r.status_code == 200 and r.json()["message"]["content"] == whole.message.content
    force("<think>\nplan\n</think>\n\nHello.")
    gen = client.generate(model=model(server), prompt="Hi", logprobs=True, options={"num_predict": 40})
    assert "".join(e.token for e in gen.logprobs) == "<think>\nplan\n</think>\n\nHello."


def test_json_format_holds(server, client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
              "required": ["city"], "additionalProperties": False}
    r = client.chat(model=model(server), messages=[{"role": "user", "content": "A city"}], format=schema,
                    options={"num_predict": 40, "seed": 3})
    assert json.loads(r.message.content)["city"] in ("Paris", "Lyon")
    r = client.generate(model=model(server), prompt="A city", format=schema, options={"num_predict": 40, "seed": 4})
    assert json.loads(r.response)["city"] in ("Paris", "Lyon")
    r = client.generate(model=model(server), prompt="JSON please", format="json", options={"num_predict": 40})
    assert r.response.lstrip().startswith("{")   # any object (a random model's may run past num_predict)
    assert r.done_reason == "length" or isinstance(json.loads(r.response), dict)
    # the empty schema is any JSON too (Ollama turns every object into a grammar); it was no format at all
    for path, body in (("/api/generate", {"prompt": "JSON please"}),
                       ("/api/chat", {"messages": [{"role": "user", "content": "JSON please"}]})):
        r = httpx.post(server.url + path, json={"model": model(server), "stream": False, "format": {},
                                                "options": {"num_predict": 40, "seed": 2}, **body}, timeout=60).json()
        text = r["response"] if path == "/api/generate" else r["message"]["content"]
        assert text.lstrip().startswith("{"), (path, json.dumps(r))
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": model(server), "format": {}, "max_tokens": 40, "seed": 2,
        "messages": [{"role": "user", "content": "JSON please"}]}, timeout=60).json()
    assert r["choices"][0]["message"]["content"].lstrip().startswith("{"), r


def test_a_body_posted_as_curl_posts_it(server):
    """Ollama's own examples post JSON with `curl -d`, labelled a form: read as JSON all the same."""
    body = json.dumps({"model": model(server), "messages": [{"role": "user", "content": "Hi"}], "stream": False,
                       "options": {"num_predict": 3}})
    r = httpx.post(server.url + "/api/chat", content=body, timeout=60,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["done"] and r.json()["eval_count"] <= 3, r.text
    r = httpx.post(server.url + "/api/generate", content=b"not json", timeout=60)
    assert r.status_code in (400, 422) and isinstance(r.json()["error"], str)


def test_tags_show_ps_version(server, client):
    (entry,) = client.list().models
    assert entry.model == model(server) + ":latest" and entry.size == server.services.backend.weights_bytes
    assert entry.details.family == "qwen2"
    shown = client.show(model(server))
    assert "tools" in shown.capabilities and shown.template and shown.modelinfo["general.architecture"] == "qwen2"
    assert "insert" not in shown.capabilities   # (no fill-in-the-middle tokens: test_llamacpp's model has them)
    assert client.ps().models[0].model == entry.model
    v = httpx.get(server.url + "/api/version", timeout=10).json()
    assert v["version"] and v["localheap"] is None or isinstance(v["localheap"], str)


def test_options_and_fields_it_does_not_know_are_ignored_as_ollama_ignores_them(server, client, caplog):
    """Ollama logs "invalid option provided" and answers (llm.nvim sends rope_frequency_base), and its
    JSON decoding ignores unknown fields (Cline sends tool_choice, and fields inside messages)."""
    msgs = [{"role": "user", "content": "The pass key"}]
    plain = client.chat(model=model(server), messages=msgs, options={"temperature": 0, "num_predict": 6})
    with caplog.at_level("WARNING", logger="localheap.server"):
        odd = client.chat(model=model(server), messages=msgs, options={
            "temperature": 0, "num_predict": 6, "rope_frequency_base": 1e6, "frobnicate": 1})
        r = httpx.post(server.url + "/api/chat", timeout=60, json={
            "model": model(server), "messages": [{**msgs[0], "ts": 1}], "stream": False, "tool_choice": "auto",
            "tools": TOOLS, "options": {"temperature": 0, "num_predict": 6}})
    assert odd.message.content == plain.message.content
    assert "frobnicate, rope_frequency_base" in caplog.text
    assert r.status_code == 200, r.text
    same = httpx.post(server.url + "/api/chat", timeout=60, json={
        "model": model(server), "messages": msgs, "stream": False, "tools": TOOLS,
        "options": {"temperature": 0, "num_predict": 6}})
    assert r.json()["message"]["content"] == same.json()["message"]["content"]
    assert "messages.0.ts, tool_choice" in caplog.text


@pytest.mark.parametrize("body,param", [
    ({"options": {"tfs_z": 0.5}}, "options.tfs_z"),
    ({"options": {"mirostat": 3}}, "options.mirostat"),
    ({"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
    ({"options": {"repeat_last_n": -2}}, "options.repeat_last_n"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages.0.images"),
    ({"messages": "hi"}, None),
    ({"format": 5}, "format"), ({"format": "yaml"}, "format"),   # (not "format.literal['','json']")
    ({"format": {"type": "nonsense"}}, "format"),
])
def test_what_it_cannot_do_is_a_400_in_ollamas_shape(server, body, param):
    payload = {"model": model(server), "messages": [{"role": "user", "content": "hi"}], "stream": False, **body}
    r = httpx.post(server.url + "/api/chat", json=payload, timeout=60)
    assert r.status_code in (400, 422) and isinstance(r.json()["error"], str), r.text
    if param is not None:
        assert r.json()["localheap"]["param"] == param
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url).chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and "nope" in e.value.error
    neutral = {"repeat_penalty": 1.0, "num_ctx": 8192, "mirostat": 0, "num_predict": 2}
    assert ollama.Client(host=server.url).chat(model=model(server), messages=[{"role": "user", "content": "x"}],
                                               options=neutral).eval_count <= 2
    r = httpx.post(server.url + "/api/generate", json={"model": model(server), "prompt": "x", "context": [1, 2],
                                                       "suffix": "y"}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]


def test_a_replys_context_continues_its_session(server, client):
    """/api/generate's `context` (deprecated by Ollama, still sent by its clients): the final line
    gives the prompt's and reply's ids; sent back, the next prompt is read after them in the same
    session (only the new ids read), and the reply is what those ids give as a token prompt."""
    options = {"temperature": 0, "num_predict": 6}

    def generate(**body) -> dict:
        r = httpx.post(server.url + "/api/generate", json={"model": model(server), "options": options,
                                                           "stream": False, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first = generate(prompt="The pass key")
    asked = chat_prompt(server.services.tokenizer, [ChatMessage(role="user", content="The pass key")]).tokens
    assert first["context"][:len(asked)] == list(asked) and len(first["context"]) == len(asked) + first["eval_count"]
    then = chat_prompt(server.services.tokenizer, [ChatMessage(role="user", content="And then")]).tokens
    second = generate(prompt="And then", context=first["context"])
    assert second["localheap"]["session_id"] == first["localheap"]["session_id"]
    assert second["prompt_eval_count"] == len(then) + 1   # the reply's last id (never fed), then the new ones
    ids = first["context"] + list(then)
    assert second["context"][:len(ids)] == ids
    same = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0},
                      timeout=60).json()
    assert second["response"] == same["choices"][0]["text"]
    assert client.generate(model=model(server), prompt="x", raw=True, options=options).context is None
    streamed = list(client.generate(model=model(server), prompt="The pass key", options=options, stream=True))
    assert streamed[-1].context == first["context"] and all(p.context is None for p in streamed[:-1])
    r = httpx.post(server.url + "/api/generate", json={"model": model(server), "prompt": "x", "context": [10 ** 9],
                                                       "stream": False}, timeout=60)
    assert r.status_code == 400 and "out of range" in r.json()["error"], r.text[:300]
    with pytest.raises(PromptTooLong):
        after_context(server.services.tokenizer, first["context"], Prompt(then), len(first["context"]))


def test_a_reply_a_stop_sequence_ended_gives_its_text_as_context(server, force):
    """The stop sequence's tokens are not the conversation's: the context is the prompt's ids and
    the reply's text as returned, tokenized; the next turn after it reads in the same session."""
    force("Hello there. END and more")
    body = {"model": model(server), "prompt": "Greet me", "stream": False, "options": {"stop": ["END"]}}
    first = httpx.post(server.url + "/api/generate", json=body, timeout=60).json()
    asked = chat_prompt(server.services.tokenizer, [ChatMessage(role="user", content="Greet me")]).tokens
    assert first["response"] == "Hello there. "
    tok = server.services.tokenizer
    assert first["context"] == list(asked) + tok.encode("Hello there. ", add_special_tokens=False)
    force("Fine.")
    second = httpx.post(server.url + "/api/generate", json={**body, "prompt": "Again", "context": first["context"]},
                        timeout=60).json()
    assert second["response"] == "Fine." and second["localheap"]["session_id"] == first["localheap"]["session_id"]


def test_a_context_keeps_one_bos(model_dirs):
    """A template that writes the BOS: the prompt after a context loses its own (the context's is first)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs("llama"))
    asked = chat_prompt(tok, [ChatMessage(role="user", content="hi")]).tokens
    assert asked[0] == tok.bos_token_id
    joined = after_context(tok, list(asked) + [5], Prompt(asked)).tokens
    assert joined == list(asked) + [5] + list(asked[1:]) and joined.count(tok.bos_token_id) == 1


def test_an_api_key_guards_the_ollama_routes(model_dirs, tmp_path_factory, torch_one_thread):
    with serve(qwen_model(model_dirs, tmp_path_factory), api_keys=["k1"]) as srv:
        assert httpx.get(srv.url + "/api/tags", timeout=10).status_code == 401
        keyed = ollama.Client(host=srv.url, headers={"Authorization": "Bearer k1"})
        assert keyed.list().models


def test_a_client_that_leaves_stops_its_reply(server, force):
    """A stream closed early, and a whole reply the client gave up on: both jobs are cancelled
    (each is forced to write 5,000 tokens: only a cancel ends it early)."""
    from localheap.engine import wait_idle

    svc = server.services
    force(" a" * 6000)
    cancelled = svc.engine.counters.cancelled
    payload = {"model": model(server), "messages": [{"role": "user", "content": "Never stop."}],
               "options": {"num_predict": 5000}}
    with httpx.stream("POST", server.url + "/api/chat", json=payload, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            assert json.loads(line)["done"] is False
            if i == 8:
                break
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/api/chat", json={**payload, "stream": False}, timeout=0.5)
    assert wait_idle(svc.engine) and svc.engine.counters.cancelled == cancelled + 2


def test_model_management_answers_for_the_one_served_model(server, client):
    """pull: the served model (by id or id:latest) succeeds at once, streamed or not; another name
    is a 404 naming the served one. delete of the served model is a 400 (it was chosen at start),
    of another a 404; copy, create and push are 400s that say why. Ollama's client raises them."""
    name = model(server)
    assert client.pull(name).status == "success"
    assert [p.status for p in client.pull(name + ":latest", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3:8b")
    assert e.value.status_code == 404 and server.services.model_id in str(e.value.error)
    for call, status in ((lambda: client.delete(name), 400), (lambda: client.delete("other"), 404),
                         (lambda: client.copy(name, "mine"), 400), (lambda: client.create("mine", from_=name), 400),
                         (lambda: client.push(name), 400)):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == status, e.value
    assert "serves the one model" in str(e.value.error)
    assert [m.model for m in client.list().models] == [name + ":latest"]   # still there
