"""Prefix reuse, checkpoints and forks on the real server (tiny random llama, on each backend
installed): cached_tokens is what was reused, and the reused heap answers exactly
as a fresh one does (a heap wider than the context gives the stock tokens)."""

from __future__ import annotations

import httpx
import pytest

from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.testing import ServerThread

WIDE = HeapConfig(budget=1024, slack=32, recent=16, policy="h2o")     # nothing is evicted in these chats
TIGHT = HeapConfig(budget=48, slack=16, recent=8, policy="h2o")       # a document evicts most of itself
# ... and pages it out: the fork gets the page store as it was at the checkpoint
TIGHT_RECALL = TIGHT.with_(policy="snapkv", recall=True, recall_budget=16, page_size=8)
# Past assistant turns open with a BOS marker the generation prompt lacks (the hidden-token case).
MARKER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}<|begin|>{% endif %}{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DOC = " ".join(f"Room {i} keeps the code word blue{i}." for i in range(60))


def load_backend(model_dirs, kind):
    if kind == "torch":
        pytest.importorskip("torch")
        from localheap.backends.torch import TorchBackend
        return TorchBackend.load(model_dirs("llama"), model_name="tiny")
    pytest.importorskip("mlx.core")
    from localheap.backends.mlx import MLXBackend
    return MLXBackend.load(model_dirs("llama"), model_name="tiny")


def serve(backend, heap, tmp_path):
    return ServerThread(create_app(backend, ServerSettings(heap=heap, web_dir=None, sessions_dir=tmp_path,
                                                           persist_sessions=False)))


@pytest.fixture(scope="module", params=["torch", "mlx"])
def backend(request, model_dirs, torch_one_thread):
    return load_backend(model_dirs, request.param)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def marker_backend(request, model_dirs, torch_one_thread):
    b = load_backend(model_dirs, request.param)
    b.tokenizer.chat_template = MARKER_TEMPLATE
    inner = getattr(b.tokenizer, "_tokenizer", None)   # mlx-lm's wrapper around the HF tokenizer
    if hasattr(inner, "apply_chat_template"):
        inner.chat_template = MARKER_TEMPLATE
    return b


def chat(http, messages, session_id=None, max_tokens=10):
    headers = {"X-Session-Id": session_id} if session_id else {}
    r = http.post("/v1/chat/completions", headers=headers,
                  json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"], body["localheap"]["session_id"]


def fresh_reply(http, messages):
    """The same request on a new, empty session: nothing reused."""
    sid = http.post("/v1/sessions").json()["id"]
    text, usage, _ = chat(http, messages, sid)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    return text


def tokens(backend, messages, generation=True):
    tok = backend.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return list(tok.encode(text, add_special_tokens=False))


def shared(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_hidden_marker_template_reuses_the_common_prefix(marker_backend, tmp_path):
    with serve(marker_backend, WIDE, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        q1 = [{"role": "user", "content": "Where are the code words kept?"}]
        a1, usage1, sid = chat(http, q1)
        assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
        turn2 = q1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And room 7?"}]
        first, second = tokens(marker_backend, q1), tokens(marker_backend, turn2)
        assert second[:len(first)] == first and "<|begin|>" in marker_backend.tokenizer.decode(second[len(first):])
        a2, usage2, sid2 = chat(http, turn2)
        assert sid2 == sid                                         # the same session, rolled back
        assert usage2["prompt_tokens_details"]["cached_tokens"] == len(first) > 0
        assert usage2["prompt_tokens"] == len(second)
        assert a2 == fresh_reply(http, turn2)                      # the rolled-back heap answers as a fresh one


def test_an_edited_reply_and_a_regenerated_turn_reuse_the_prefix(backend, tmp_path):
    with serve(backend, WIDE, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        q1 = [{"role": "user", "content": "Name a room."}]
        a1, _, sid = chat(http, q1)
        # the client sends the reply back edited: it re-tokenizes differently from what was generated
        turn2 = q1 + [{"role": "assistant", "content": a1[: len(a1) // 2] + " (edited)"},
                      {"role": "user", "content": "Another?"}]
        a2, usage2, sid2 = chat(http, turn2)
        expected = shared(tokens(backend, q1) + [0], tokens(backend, turn2))
        assert sid2 == sid and usage2["prompt_tokens_details"]["cached_tokens"] >= expected > 0
        assert a2 == fresh_reply(http, turn2)
        # regenerate: the very same request again rolls back to before its reply
        again, usage3, sid3 = chat(http, turn2)
        assert sid3 == sid and again == a2
        assert usage3["prompt_tokens_details"]["cached_tokens"] == usage3["prompt_tokens"] - 1


@pytest.mark.parametrize("heap", [TIGHT, TIGHT_RECALL], ids=["evicting", "recall"])
def test_fork_from_the_checkpoint_after_a_document_answers_as_the_original(backend, heap, tmp_path):
    with serve(backend, heap, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["id"]
        done = http.post(f"/v1/sessions/{sid}/documents", json={"text": DOC, "stream": False}).json()
        n_doc = done["tokens_added"]
        assert done["session"]["checkpoints"] == [n_doc] and done["session"]["heap"]["evicted"] > 0
        question = [{"role": "user", "content": "Which word is in room 7?"}]
        answer, usage, _ = chat(http, question, sid)
        assert usage["prompt_tokens_details"]["cached_tokens"] == n_doc
        fork = http.post(f"/v1/sessions/{sid}/fork", json={"tokens": n_doc})
        assert fork.status_code == 201, fork.text
        fid = fork.json()["id"]
        assert fid != sid and fork.json()["tokens"] == n_doc and fork.json()["checkpoints"] == [n_doc]
        again, usage_f, _ = chat(http, question, fid)
        assert again == answer and usage_f["prompt_tokens_details"]["cached_tokens"] == n_doc
        if heap.recall:   # both recalled from their own store, as it was at the checkpoint
            pages = [http.get(f"/v1/sessions/{x}").json()["heap"]["pages"] for x in (sid, fid)]
            assert [p["last_recall"]["tokens"] for p in pages] == [heap.recall_budget] * 2
            assert pages[0]["pages_written"] == pages[1]["pages_written"] > 0
            assert (tmp_path / f"{fid}.pages").is_dir() and (tmp_path / "checkpoints" / sid / f"{n_doc}.pages").is_dir()
        # a stateless client resending the document with another question starts from the checkpoint
        doc_msg = [{"role": "user", "content": DOC}]
        other_q = doc_msg + [{"role": "user", "content": "And room 9?"}]
        reply, usage_s, new_sid = chat(http, other_q)
        assert usage_s["prompt_tokens_details"]["cached_tokens"] == n_doc and new_sid not in (sid, fid)
        assert http.post(f"/v1/sessions/{sid}/fork", json={"tokens": n_doc - 1}).status_code == 400
        # a checkpoint on request, then a fork at the current state
        r = http.post(f"/v1/sessions/{sid}/checkpoint")
        assert r.status_code == 201 and r.json()["tokens"] > n_doc and r.json()["session"]["checkpoints"][0] == n_doc
        assert http.post(f"/v1/sessions/{sid}/fork").json()["tokens"] == r.json()["tokens"]
        assert http.post("/v1/sessions/sess_nope/checkpoint").status_code == 404
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
        assert not (tmp_path / "checkpoints" / sid).exists() and (tmp_path / "checkpoints" / fid).exists()


def test_checkpoints_and_forks_stay_with_their_api_key(backend, tmp_path):
    settings = ServerSettings(heap=TIGHT, web_dir=None, sessions_dir=tmp_path, persist_sessions=False,
                              api_keys=["key-alice", "key-bob"])
    with ServerThread(create_app(backend, settings)) as srv:
        alice = httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": "Bearer key-alice"})
        bob = httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": "Bearer key-bob"})
        with alice, bob:
            sid = alice.post("/v1/sessions").json()["id"]
            done = alice.post(f"/v1/sessions/{sid}/documents", json={"text": DOC, "stream": False}).json()
            n_doc = done["tokens_added"]
            assert bob.post(f"/v1/sessions/{sid}/checkpoint").status_code == 404
            assert bob.post(f"/v1/sessions/{sid}/fork", json={"tokens": n_doc}).status_code == 404
            resend = [{"role": "user", "content": DOC}, {"role": "user", "content": "Room 3?"}]
            _, usage, _ = chat(bob, resend, max_tokens=2)
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0    # alice's checkpoint is not bob's
            _, usage, _ = chat(alice, resend, max_tokens=2)
            assert usage["prompt_tokens_details"]["cached_tokens"] == n_doc
            fork = alice.post(f"/v1/sessions/{sid}/fork", json={"tokens": n_doc}).json()
            assert bob.get(f"/v1/sessions/{fork['id']}").status_code == 404
            assert alice.get(f"/v1/sessions/{fork['id']}").status_code == 200
