"""An editor's completions (fill in the middle: /infill, a `suffix` on /v1/completions and Ollama's
/api/generate) run in scratch sessions (engine.Generate.scratch) in a durable store, as `serve`
runs: their turns are never written (no heap file, not in the index, no saved flag in the reply),
only scratch requests match them (a chat never continues one), an owner keeps at most two
(a cursor moving through a long file does not leave a session a keystroke), and none is there
after a restart, while a chat beside them is saved and comes back."""

from __future__ import annotations

import httpx
import pytest
import torch

from localheap.engine.admission import SCRATCH_KEEP
from localheap.heap import HeapConfig
from localheap.server.fim import FIM_TOKENS

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SPECIAL = FIM_TOKENS[0] + ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")
HEAP = HeapConfig(budget=48, slack=16, recent=8, policy="h2o")   # a file of a few hundred tokens evicts
CODE = "".join(f"def f{i}(a):\n    return a + {i}\n" for i in range(40))


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    pytest.importorskip("fastapi")
    from localheap.backends.torch import TorchBackend
    from localheap.randmodel import build_random_model

    return TorchBackend.load(build_random_model("qwen2", tmp_path_factory.mktemp("coder"), special=SPECIAL),
                             dtype=torch.float32)


def _files(root) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]


def test_completions_are_never_written_never_mix_with_chats_and_do_not_pile_up(backend, tmp_path):
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True)
    model = backend.model_name
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        chat = http.post("/v1/completions", json={"model": model, "prompt": CODE[:300], "max_tokens": 4})
        assert chat.headers["X-Localheap-Saved"] == "true"
        chat_id = chat.headers["X-Session-Id"]
        assert any(chat_id in f for f in _files(tmp_path))
        scratch = set()
        for k in range(3):   # the cursor moves on: each prompt extends the last one's file text
            body = {"model": model, "prompt": CODE[:400 + 9 * k], "suffix": CODE[400 + 9 * k:600], "raw": True,
                    "stream": False, "options": {"num_predict": 4, "temperature": 0}}
            r = http.post("/api/generate", json=body)
            assert r.status_code == 200 and "X-Localheap-Saved" not in r.headers, r.text
            assert "saved" not in r.json()["localheap"]
            scratch.add(r.headers["X-Session-Id"])
        r = http.post("/v1/completions", json={"model": model, "prompt": CODE[:420], "suffix": CODE[420:600],
                                               "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and "X-Localheap-Saved" not in r.headers
        scratch.add(r.headers["X-Session-Id"])
        on_disk = _files(tmp_path)
        assert not [f for f in on_disk if any(sid in f for sid in scratch)], on_disk
        index = (tmp_path / "index.json").read_text()
        assert chat_id in index and not any(sid in index for sid in scratch)
        # a chat whose prompt extends a scratch session's tokens exactly still starts on its own
        held = next(s for s in srv.services.store.sessions() if s.scratch)
        ids = list(held.fed) + [5]
        r = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 2})
        assert r.headers["X-Session-Id"] not in scratch and r.json()["usage"]["prompt_tokens_details"][
            "cached_tokens"] == 0
        for k in range(6):   # a window that slides with the cursor: nothing is shared, nothing piles up
            r = http.post("/api/generate", json={"model": model, "prompt": CODE[30 * k:300 + 30 * k],
                                                 "suffix": CODE[300 + 30 * k:400 + 30 * k], "raw": True,
                                                 "stream": False, "options": {"num_predict": 2}})
            assert r.status_code == 200, r.text
        assert sum(1 for s in srv.services.store.sessions() if s.scratch) <= SCRATCH_KEEP == 2
    with ServerThread(create_app(backend, settings)) as srv:   # restarted
        kept = [s.id for s in srv.services.store.sessions()]
        assert chat_id in kept and not [s for s in kept if s in scratch]
        assert not [f for f in _files(tmp_path) if any(sid in f for sid in scratch)]


def test_a_scratch_session_past_max_resident_is_dropped_not_spilled(backend, tmp_path):
    """With one resident heap allowed, the chat that runs next drops the editor's idle session
    (no spill file written) and a chat's idle session is spilled as before."""
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              max_resident_sessions=1)
    model = backend.model_name
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": model, "prompt": CODE[:200], "suffix": CODE[200:300],
                                               "max_tokens": 2})
        editor = r.headers["X-Session-Id"]
        r = http.post("/v1/completions", json={"model": model, "prompt": "Once upon", "max_tokens": 2})
        first_chat = r.headers["X-Session-Id"]
        assert editor not in {s.id for s in srv.services.store.sessions()}
        assert not [f for f in _files(tmp_path) if editor in f]
        http.post("/v1/completions", json={"model": model, "prompt": "A different start", "max_tokens": 2})
        spilled = srv.services.store.get(first_chat)
        assert spilled.cache is None   # the chat's session was spilled, not dropped


def test_a_warm_up_outlives_the_room_other_requests_make(backend, tmp_path):
    """An editor's warm-up checkpoint survives chats that need its session's room (one resident
    heap allowed): the session is emptied, nothing is written, and the next completion still forks
    the checkpoint and reuses the whole context."""
    from localheap.server import ServerSettings, create_app
    from localheap.server.llamacpp import LlamaRequest, infill_context
    from localheap.server.testing import ServerThread

    settings = ServerSettings(heap=HEAP, web_dir=None, sessions_dir=tmp_path, persist_sessions=True,
                              max_resident_sessions=1)
    model = backend.model_name
    extra = [{"filename": "a.py", "text": CODE}]
    with ServerThread(create_app(backend, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        context = len(infill_context(backend.tokenizer, LlamaRequest(input_extra=extra), None).tokens)
        warm = http.post("/infill", json={"input_extra": extra, "n_predict": 0})
        editor = warm.headers["X-Session-Id"]
        for prompt in ("Once upon", "A different start"):   # each needs the one resident heap
            assert http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2}).is_success
        husk = srv.services.store.get(editor)
        assert husk.cache is None and not husk.fed and srv.services.store.checkpoints.of(editor)
        assert not [f for f in _files(tmp_path) if editor in f and "checkpoints" not in f]
        got = http.post("/infill", json={"input_prefix": "def g(", "input_suffix": "\n", "input_extra": extra,
                                         "n_predict": 3}).json()
        assert got["tokens_cached"] >= context, (got["tokens_cached"], context)
