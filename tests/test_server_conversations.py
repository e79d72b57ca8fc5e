"""OpenAI's Conversations API (/v1/conversations) through the real server (uvicorn in a thread, a
tiny torch model carrying a Qwen-style template), driven by the official OpenAI SDK and the
Agents SDK, unmodified: conversations and their items made, listed a page at a time, changed and
deleted; a response that names a conversation reads its items first (the prompt the whole
conversation sent as input renders, in the same session) and adds its input and output to it;
the conversations outlive a restart and a torn line."""

from __future__ import annotations

import re

import pytest

openai = pytest.importorskip("openai")

from tool_server import CALL, qwen_model, serve  # noqa: E402


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory, torch_one_thread):
    with serve(qwen_model(model_dirs, tmp_path_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model(server) -> str:
    return server.services.model_id


def test_a_conversation_and_its_items(client):
    conv = client.conversations.create(items=[{"role": "system", "content": "Be brief."},
                                              {"type": "message", "role": "user", "content": "One"}],
                                       metadata={"topic": "count"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "count"}
    import httpx

    kept = float(re.search(r"^localheap_conversations (\S+)$", httpx.get(str(client.base_url).removesuffix("/v1/") +
                                                                          "/metrics", timeout=30).text, re.M).group(1))
    assert kept >= 1
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    added = client.conversations.items.create(conv.id, items=[
        {"role": "assistant", "content": "Two"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"}])
    assert [i.type for i in added.data] == ["message", "function_call", "function_call_output"]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    first = client.conversations.items.list(conv.id, order="asc", limit=2)
    assert [i.type for i in first.data] == ["message", "message"] and first.has_more
    assert first.data[0].content[0].type == "input_text" and first.data[0].content[0].text == "Be brief."
    every = list(client.conversations.items.list(conv.id, order="asc", limit=2))   # the SDK pages on by after
    assert len(every) == 5 and every[:2] == first.data and every[2].content[0].type == "output_text"
    newest = client.conversations.items.list(conv.id)   # desc by default
    assert [i.id for i in newest.data] == [i.id for i in reversed(every)] and not newest.has_more
    one = client.conversations.items.retrieve(every[3].id, conversation_id=conv.id)
    assert one.type == "function_call" and one.call_id == "c1"
    assert client.conversations.items.delete(every[3].id, conversation_id=conv.id).id == conv.id
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc")] == \
        [i.id for i in every if i.id != every[3].id]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(every[3].id, conversation_id=conv.id)
    assert client.conversations.update(conv.id, metadata={"topic": "numbers"}).metadata == {"topic": "numbers"}
    assert client.conversations.delete(conv.id).deleted
    for gone in (lambda: client.conversations.retrieve(conv.id), lambda: client.conversations.items.list(conv.id)):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_bad_items_and_metadata_are_400s(server, client):
    import httpx

    for body, param in [({"items": [{"type": "web_search_call", "id": "w"}]}, None),
                        ({"items": [{"role": "nobody", "content": "x"}]}, "items.0"),
                        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata")]:
        r = httpx.post(server.url + "/v1/conversations", json=body, timeout=30)
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["param"] == param
    conv = client.conversations.create()
    r = httpx.get(server.url + f"/v1/conversations/{conv.id}/items", params={"after": "msg_nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model(server), conversation=conv.id, previous_response_id="resp_x", input="x")
    assert e.value.body["param"] == "conversation"


def test_an_item_reference_adds_the_item_it_names(server, client, force):
    """item_reference items, in a conversation's items or a response's input: the item of that id a
    kept response or a conversation holds (the same key's), else a 404 naming the reference."""
    import httpx

    force("Paris.")
    asked = client.responses.create(model=model(server), input="Capital of France?", max_output_tokens=8)
    answer = asked.output[-1]
    conv = client.conversations.create(items=[{"type": "item_reference", "id": answer.id}])
    listed = client.conversations.items.list(conv.id).data
    assert [(i.id, i.type, i.content[0].text) for i in listed] == [(answer.id, "message", "Paris.")]
    added = client.conversations.items.create(conv.id, items=[{"role": "user", "content": "And Spain?"}])
    other = client.conversations.create(items=[{"type": "item_reference", "id": added.data[0].id}])
    assert client.conversations.items.list(other.id).data[0].content[0].text == "And Spain?"
    force("Madrid.")
    direct = client.responses.create(model=model(server), max_output_tokens=8, input=[
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Spain?"}])
    by_ref = client.responses.create(model=model(server), max_output_tokens=8, input=[
        {"role": "user", "content": "Capital of France?"}, {"type": "item_reference", "id": answer.id},
        {"type": "item_reference", "id": added.data[0].id}])   # one a response's, one a conversation's
    assert by_ref.usage.input_tokens == direct.usage.input_tokens and by_ref.output_text == "Madrid."
    for url in (f"/v1/conversations/{conv.id}/items", "/v1/conversations"):
        r = httpx.post(server.url + url, json={"items": [{"role": "user", "content": "x"},
                                                         {"type": "item_reference", "id": "msg_nope"}]}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "items.1", r.text
    assert len(client.conversations.items.list(conv.id).data) == 2   # nothing added


def test_a_response_on_a_conversation_reads_it_and_adds_to_it(server, client, force):
    """Each turn names the conversation: the prompt is its items then the input (the prompt the
    whole conversation sent as input renders, token for token, in the same session), and its
    input and output are added to it. A call and its output go through it too."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    conv = client.conversations.create(items=[{"role": "user", "content": "Hello"},
                                              {"role": "assistant", "content": "Hi."}])
    force(CALL)
    first = client.responses.create(model=model(server), conversation=conv.id, input="Weather in Paris?",
                                    tools=tools, max_output_tokens=60)
    assert first.conversation.id == conv.id
    (call,) = first.output
    force("Sunny.")
    second = client.responses.create(model=model(server), conversation={"id": conv.id}, tools=tools,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sun"}])
    assert second.output_text == "Sunny." and second.localheap["session_id"] == first.localheap["session_id"]
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in items] == ["message", "message", "message", "function_call", "function_call_output",
                                       "message"]
    assert items[3].call_id == call.call_id and items[5].content[0].text == "Sunny."
    asked = client.responses.input_items.list(first.id).data   # a text input: one item, one id in both lists
    assert [i.id for i in asked] == [items[2].id]
    whole = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
             {"role": "user", "content": "Weather in Paris?"}, call.model_dump(mode="json", by_alias=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sun"},
             {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Nice?"}]
    force("Nice too.")
    third = client.responses.create(model=model(server), conversation=conv.id, input="And Nice?", tools=tools)
    again = client.responses.create(model=model(server), input=whole, tools=tools)
    assert again.usage.input_tokens == third.usage.input_tokens   # the same prompt
    assert again.localheap["session_id"] == third.localheap["session_id"]
    assert len(client.conversations.items.list(conv.id).data) == 8   # (the request without it added nothing)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model(server), conversation="conv_nope", input="x")


def test_the_agents_sdk_keeps_its_history_in_a_conversation(server):
    """The Agents SDK's OpenAIConversationsSession: two runs of an agent, the second seeing the
    first's turn through the conversation's items; and a run by conversation_id."""
    import asyncio

    agents = pytest.importorskip("agents")
    from localheap.grammar import ForcedTokens

    agents.set_tracing_disabled(True)
    svc = server.services
    replies = ["First answer.", "Second answer.", "Third answer."]
    ids = [svc.tokenizer.encode(t, add_special_tokens=False) for t in replies]
    svc.force_tokens = lambda: ForcedTokens(ids.pop(0), svc.backend.eos_token_ids)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def run():
        agent = agents.Agent(name="a", instructions="Answer.",
                             model=agents.OpenAIResponsesModel(model=model(server), openai_client=client),
                             model_settings=agents.ModelSettings(max_tokens=40))
        session = agents.OpenAIConversationsSession(openai_client=client)
        one = await agents.Runner.run(agent, "First?", session=session)
        two = await agents.Runner.run(agent, "Second?", session=session)
        history = await session.get_items()
        conv = await client.conversations.create()
        three = await agents.Runner.run(agent, "Third?", conversation_id=conv.id)
        kept = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        return one, two, history, three, kept

    try:
        one, two, history, three, kept = asyncio.run(run())
    finally:
        svc.force_tokens = None
    assert (one.final_output, two.final_output, three.final_output) == tuple(replies)
    texts = [i["content"][0]["text"] if isinstance(i["content"], list) else i["content"] for i in history]
    assert texts == ["First?", "First answer.", "Second?", "Second answer."]
    assert [i.role for i in kept] == ["user", "assistant"] and kept[1].content[0].text == "Third answer."


def test_conversations_outlive_a_restart_and_a_torn_line(tmp_path):
    from localheap.server.conversations import ConversationLog, ConversationNotFound

    path = tmp_path / "conversations.jsonl"
    log = ConversationLog(path=path)
    a = log.create([{"role": "user", "content": "a1"}], {"k": "v"}, owner="key-1")
    b = log.create([], None, owner=None)
    added = log.add_items(a.id, [{"role": "assistant", "content": "a2"}, {"role": "user", "content": "a3"}], "key-1")
    log.delete_item(a.id, added[0]["id"], "key-1")
    log.update(a.id, {"k": "w"}, "key-1")
    log.add_items(b.id, [{"role": "user", "content": "b1"}], None)
    log.flush()
    assert path.stat().st_mode & 0o777 == 0o600
    log.close()
    again = ConversationLog(path=path)
    assert [i["content"][0]["text"] for i in again.get(a.id, "key-1").items.values()] == ["a1", "a3"]
    assert again.get(a.id, "key-1").metadata == {"k": "w"} and again.chars == log.chars
    with pytest.raises(ConversationNotFound):
        again.get(a.id, None)   # another owner's
    again.delete(b.id, None)
    again.close()
    data = path.read_bytes()
    path.write_bytes(data + b'{"add":"' + a.id.encode() + b'","items":[{"ty')   # a crash mid-line
    torn = ConversationLog(path=path)
    assert len(torn.get(a.id, "key-1").items) == 2 and b.id not in torn._convs
    assert path.read_bytes().endswith(b"\n")
    for i in range(200):   # mostly changes that are gone: the file is rewritten from what is kept
        torn.add_items(a.id, [{"role": "user", "content": f"x{i}", "id": "msg_same"}], "key-1")
    torn.close()
    assert path.read_bytes().count(b"\n") <= 2 * 2 + 64
    last = ConversationLog(path=path)
    assert [i["content"][0]["text"] for i in last.get(a.id, "key-1").items.values()] == ["a1", "a3", "x199"]
    last.close()


def test_the_least_recently_used_conversation_goes_past_the_bound():
    from localheap.server.conversations import ConversationLog, ConversationNotFound

    log = ConversationLog(max_chars=2000)
    a = log.create([{"role": "user", "content": "a" * 600}], None, None)
    b = log.create([{"role": "user", "content": "b" * 600}], None, None)
    log.get(a.id, None)   # a used last
    c = log.create([{"role": "user", "content": "c" * 600}], None, None)
    assert log.get(a.id, None) and log.get(c.id, None)
    with pytest.raises(ConversationNotFound):
        log.get(b.id, None)
    assert log.chars == sum(x.chars for x in log._convs.values()) <= 2000


def test_a_restarted_server_keeps_a_conversation_and_its_session(model_dirs, tmp_path_factory, tmp_path,
                                                                 torch_one_thread):
    from localheap.grammar import ForcedTokens

    model_dir = qwen_model(model_dirs, tmp_path_factory)
    settings = dict(sessions_dir=tmp_path, persist_sessions=True)
    with serve(model_dir, **settings) as srv:
        svc = srv.services
        ids = svc.tokenizer.encode("It is 42.", add_special_tokens=False)
        svc.force_tokens = lambda: ForcedTokens(ids, svc.backend.eos_token_ids)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        conv = client.conversations.create(items=[{"role": "user", "content": "The pass key"}])
        first = client.responses.create(model=model(srv), conversation=conv.id, input="is what?", max_output_tokens=8,
                                        temperature=0)
    with serve(model_dir, **settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        items = list(client.conversations.items.list(conv.id, order="asc"))
        assert [i.role for i in items] == ["user", "user", "assistant"]
        assert items[2].content[0].text == first.output_text == "It is 42."
        second = client.responses.create(model=model(srv), conversation=conv.id, input="And then?",
                                         max_output_tokens=4, temperature=0)
        assert second.localheap["session_id"] == first.localheap["session_id"]   # its session restored too
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
