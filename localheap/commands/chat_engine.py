"""The terminal chat's link to the engine: one session on the server's own Engine and
SessionStore, driven from the terminal thread through each job's event queue."""

from __future__ import annotations

import queue
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..engine import Delta, Engine, Failed, Feed, Finished, Generate, Progress
from ..generation import SamplingParams
from ..heap import HeapConfig
from ..server.prompts import chat_prompt
from ..server.schemas import ChatMessage
from ..sessions import SessionStore


@dataclass
class Reply:
    text: str
    finished: Finished
    decode_s: float        # first token to the last

    @property
    def tokens_per_s(self) -> float:
        n = self.finished.usage.completion_tokens
        return (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else 0.0


class ChatEngine:
    """A conversation with one session: ask() streams a reply, read() feeds a document."""

    def __init__(self, backend, cfg: HeapConfig, system: Optional[str] = None):
        self.backend = backend
        self._dir = tempfile.TemporaryDirectory(prefix="localheap-chat-")
        self.store = SessionStore(backend, cfg, Path(self._dir.name), max_resident=2, max_sessions=4)
        self.engine = Engine(backend, self.store, max_active=1, max_queued=1).start()
        self.session_id = self.engine.call(self.store.create).result().id
        self.system = system

    def ask(self, text: str, params: SamplingParams, on_text: Callable[[str], None]) -> Reply:
        prompt = chat_prompt(self.backend.tokenizer, self._opening() + [ChatMessage(role="user", content=text)])
        parts: list[str] = []
        first: Optional[float] = None

        def on_event(event) -> None:
            nonlocal first
            if isinstance(event, Delta):
                first = first or time.perf_counter()
                parts.append(event.text)
                on_text(event.text)

        done = self._run(lambda emit: Generate(prompt, params, emit, self.session_id), on_event)
        return Reply("".join(parts), done, time.perf_counter() - first if first else 0.0)

    def read(self, text: str, on_progress: Callable[[int, int], None]) -> Finished:
        """Read a document into the session (as a user message), reporting (done, total) tokens."""
        prompt = chat_prompt(self.backend.tokenizer, self._opening() + [ChatMessage(role="user", content=text)],
                             add_generation_prompt=False)

        def on_event(event) -> None:
            if isinstance(event, Progress):
                on_progress(event.done, event.total)

        return self._run(lambda emit: Feed(prompt, emit, self.session_id), on_event)

    def _opening(self) -> list[ChatMessage]:
        """The system message, where the session has read nothing yet (a first message or document)."""
        if self.system and self.session.turns == 0 and not self.session.fed:
            return [ChatMessage(role="system", content=self.system)]
        return []

    def ensure_session(self) -> bool:
        """After a failed request the engine may have dropped the session: start a new one.
        True when the conversation had to start over."""
        if self.session_id in self.store:
            return False
        self.session_id = self.engine.call(self.store.create).result().id
        return True

    @property
    def session(self):
        return self.store.get(self.session_id)

    def status(self) -> str:
        s = self.session
        heap = s.stats.summary() if s.stats is not None else "empty"
        saved = f" | checkpoints at {', '.join(f'{n:,}' for n in s.checkpoints)} tokens" if s.checkpoints else ""
        return f"heap: {heap} | turns {s.turns}{saved}"

    def close(self) -> None:
        self.engine.stop()
        self.store.close()
        self._dir.cleanup()

    def _run(self, make_request, on_event) -> Finished:
        """Submit, pass events on until the job ends; Ctrl-C cancels the job (the session
        keeps what was read or said so far) and is raised again once it has ended."""
        events: queue.Queue = queue.Queue()
        job = self.engine.submit(make_request(events.put))
        interrupted = False
        while True:
            try:
                event = events.get(timeout=0.1)
            except queue.Empty:
                if job.done.is_set() and events.empty():   # cancelled before it started: no event
                    raise KeyboardInterrupt
                continue
            except KeyboardInterrupt:
                job.cancel()
                interrupted = True
                continue
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Finished):
                if interrupted:
                    raise KeyboardInterrupt
                return event
            on_event(event)
