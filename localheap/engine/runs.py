"""A job once admitted: its session and the work left, done one step at a time.

A step is one prefill chunk or one decode token. With a backend that batches (`step_rows`),
the engine advances every decoding run in one forward pass (a prefill chunk riding along), and
a run holds a decode row (`begin`, then `take` per token); otherwise the engine round-robins
`step` between runs and a run pulls tokens from the backend's generator.
The session's `fed` list always matches what the cache holds once a run ends.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

from ..sessions import Session
from .detok import TextStream
from .events import INTERRUPTIONS, LISTENING, Delta, Feed, Finished, Generate, Job, Progress, Usage

STATS_INTERVAL_S = 0.1   # how often a busy session republishes its heap stats


def question_tokens(backend: Any, cache: Any, n: int) -> int:
    """Backend.question_tokens (the session's heap is resident once its run starts), 1 for a
    backend without it."""
    ask = getattr(backend, "question_tokens", None)
    return 1 if ask is None else ask(cache, n)


class Run:
    """The work left on one admitted job; step() advances it by one unit."""

    def __init__(self, job: Job, session: Session, new_tokens: list[int], cached: int, backend: Any):
        assert new_tokens, "a run feeds at least one token"
        self.job, self.session, self.backend = job, session, backend
        self.cached = cached                            # tokens the session held before this run
        self.created = False                            # the session was made for this run
        self.slot = -1                                  # the engine's slot it holds (slots.Slots)
        self.prompt_tokens = cached + len(new_tokens)
        self.begun = 0 if isinstance(job.request, Feed) else job.request.reply_begun   # (Generate.reply_begun)
        self.chunk = session.cfg.chunk                 # prefill chunk (the heap evicts before each)
        # prompt logprobs (an echo): every token but the last is read by prefill_scored, on its own
        self.scored = None if isinstance(job.request, Feed) else job.request.params.prompt_logprobs
        self.pooled = job.request.pool if isinstance(job.request, Feed) else None   # an embedding: prefill_pooled
        if isinstance(job.request, Feed):
            self.to_prefill, self.last = new_tokens, None
        else:   # the turn's first step feeds its question (a recall probes with it), else its last token
            held = 1 if self.scored is not None else question_tokens(backend, session.cache, len(new_tokens))
            self.to_prefill = new_tokens[: len(new_tokens) - held]
            self.last = [int(t) for t in new_tokens[len(new_tokens) - held:]]
        self.prefilled = 0
        self.gen: Optional[Iterator[int]] = None
        self.row: Any = None                            # the backend's decode row (batched engine)
        self.advanced_at = 0                            # engine step of its last token (batch fairness)
        self.seated_at: Optional[int] = None            # engine step it took its seat in the batch
        self.completion: list[int] = []
        self.logprobs_sent = 0                          # reply tokens whose logprobs went out in a Delta
        self.ids_sent = 0                               # reply tokens whose ids went out in a Delta
        self.stream: Optional[TextStream] = None
        self.finish_reason: Optional[str] = None
        self.stop_token: Optional[int] = None           # the EOS or stop_token_ids id that ended the reply
        self._stats_at = 0.0
        self.last_step = ("prefill", 0)   # (kind, tokens) of the latest step, for throughput

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.to_prefill)

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.to_prefill) - self.prefilled

    @property
    def request(self):
        return self.job.request

    def step(self) -> bool:
        """Do one unit of work; True once the run is finished (finish_reason set)."""
        if self.prefilling:
            self._prefill_chunk()
        else:
            self._decode_one()
            self._publish_stats(force=self.finish_reason is not None)
        return self.finish_reason is not None

    @property
    def rides(self) -> bool:
        """Whether its prompt's chunks may ride in the decode batch or be read on the lane (a
        scored prompt's are read on their own, by prefill_scored; an embedding's by prefill_pooled)."""
        return self.scored is None and self.pooled is None

    def _prefill_chunk(self) -> None:
        chunk = self.next_chunk(self.chunk)
        if self.scored is not None:   # each token's logprob of the next: after the chunk's last, the next chunk's first
            end = self.prefilled + len(chunk)
            following = self.to_prefill[end] if end < len(self.to_prefill) else self.last[0]
            self.backend.prefill_scored(self.session.cache, chunk, int(following), self.scored)
        elif self.pooled is not None:
            self.backend.prefill_pooled(self.session.cache, chunk, self.pooled)
        else:
            self.backend.prefill(self.session.cache, chunk)
        self.chunk_fed(chunk)

    def next_chunk(self, size: int) -> list[int]:
        """The next prefill chunk, at most `size` tokens (ids may be an int32 array)."""
        return list(self.to_prefill[self.prefilled:self.prefilled + min(size, self.chunk)])

    def chunk_fed(self, chunk: list[int]) -> None:
        """`chunk` (from next_chunk) is in the cache now."""
        self.session.extend(chunk)
        self.prefilled += len(chunk)
        self.last_step = ("prefill", len(chunk))
        self.request.emit(Progress(self.prefilled, len(self.to_prefill)))
        if self.last is None and not self.prefilling:
            self.finish_reason = "fed"
        self._publish_stats(force=self.finish_reason is not None)

    def begin(self) -> None:
        """Batched engine: a decode row whose first batch step feeds the turn's held-back tokens
        (its question, alone first where a recall is due; else its last token); every token then
        comes from the batch (`take`)."""
        req: Generate = self.request
        defer = req.params.max_tokens > 0   # the first step feeds it, in the batch where it can
        self._mark()
        self.row = self.backend.start_row(self.session.cache, self.last, self._params(), defer=defer)
        self.stream = self._text_stream()
        if not defer:
            self.finish_reason = "length"   # sampled but not taken: the token is not fed either
            self._publish_stats(force=True)

    def _mark(self) -> None:
        """The prompt is read but for its held-back tokens: the point the next turn rolls back to
        where the template rewrites this reply (a cache with sliding layers keeps their state here;
        heap layers rewind to it when the reply evicted: backends/slots.HeapRollback)."""
        mark = getattr(self.session.cache, "mark", None)
        if mark is not None:
            mark()

    def _text_stream(self) -> TextStream:
        """The reply's detokenizer; a reply begun before (Generate.reply_begun) read into it first, its
        text not sent again (what it held back, an incomplete character, comes with the next token)."""
        stream = TextStream(self.backend.tokenizer.decode, self.request.params.stop)
        if self.begun:
            for token in self.request.prompt.tokens[-self.begun:]:
                stream.add(int(token))
        return stream

    def _params(self):
        """The request's sampling params for the backend: with the context the repetition penalty
        and DRY look back over (the session's tokens and the turn's held-back ones), where on."""
        return self.request.params.with_context(self.session.fed, self.last)

    def _decode_one(self) -> None:
        if self.gen is None:
            self._mark()
            self.gen = self.backend.generate(self.session.cache, self.last, self._params())
            self.stream = self._text_stream()
        token = next(self.gen, None)
        if token is None:
            self.finish_reason = "length"
            return
        self._take(token)

    def take(self, token: int) -> None:
        """A sampled token: stream its text, and finish on EOS, a stop string or max_tokens."""
        self._take(token)
        self._publish_stats(force=self.finish_reason is not None)

    def _take(self, token: int) -> None:
        req: Generate = self.request
        self.completion.append(token)
        self.last_step = ("decode", 1)
        if token in self.backend.eos_token_ids or token in req.params.stop_token_ids:
            self.stop_token = token
            self._finish_text("stop")
            return
        text, stopped = self.stream.add(token)
        self._delta(text, last=stopped)
        if stopped:
            self.finish_reason = "stop"
        elif len(self.completion) >= req.params.max_tokens:
            self._finish_text("length")

    def _finish_text(self, reason: str) -> None:
        text, stopped = self.stream.flush()
        self._delta(text, last=True)
        self.finish_reason = "stop" if stopped else reason

    def _delta(self, text: str, last: bool) -> None:
        """Send `text` with the logprobs of the tokens taken since the last Delta (their text may
        be held back still: they go with the next); the `last` one goes out for its logprobs alone.
        The tokens of a stop sequence have logprobs, though their text is cut (as vLLM's)."""
        recorder = self.request.params.logprobs
        entries = None
        due = len(self.completion) - (self.stop_token is not None)   # an ending EOS has no logprobs, no text
        if recorder is not None and (text or last):
            entries = [recorder.get(i) for i in range(self.logprobs_sent, due)] or None
            self.logprobs_sent = due
        if text or entries:
            ids, self.ids_sent = self.completion[self.ids_sent:due], due
            self.request.emit(Delta(text, self.begun + len(self.completion), entries, ids))

    def close(self) -> None:
        """Stop generating and bring the session's history in line with its cache."""
        if self.row is not None:
            self.backend.end_row(self.row)   # the last sampled token is not fed
            self.row = None
            self._reconcile()
        if self.gen is not None:
            self.gen.close()   # pipelined: the last yielded token may or may not be fed
            sync = getattr(self.backend, "synchronize", None)
            if sync is not None:
                sync()         # let the step in flight land before the thread moves on
            self.gen = None
            self._reconcile()
        if self.finish_reason is None and self.stream is not None and self.job.cancel_reason in LISTENING:
            self._delta(self.stream.flush()[0], last=True)   # its client still reads: the text held back
        self._publish_stats(force=True)

    def _reconcile(self) -> None:
        """Extend the session's history by the tokens of this run the cache holds."""
        in_cache = self.backend.tokens_in_cache(self.session.cache)
        fed_here = in_cache - len(self.session.fed)
        candidates = self.last + self.completion
        assert 0 <= fed_here <= len(candidates), (in_cache, len(self.session.fed), len(candidates))
        self.session.extend(candidates[:fed_here])
        cut = self.finish_reason in ("length", None) or (self.finish_reason == "stop" and self.stop_token is None)
        if cut and fed_here >= len(self.last):
            # the reply's last tokens, sampled and never read (max_tokens, a stop string or a stop cut it after
            # them; one decoding alone may have read them on a step run ahead): what a named session sent only
            # new messages reads first (sessions/match.continue_session), so its tokens are the same either way
            self.session.unfed_reply = tuple(candidates[fed_here:])

    def finished_event(self) -> Finished:
        prompt = self.prompt_tokens - self.begun   # a reply begun before counts as the reply's
        usage = Usage(prompt, self.begun + len(self.completion), min(self.cached, prompt))
        read = max(0, min(self.prompt_tokens, len(self.session.fed)) - self.cached)
        interrupted = self.job.cancel_reason if self.finish_reason is None and self.job.cancel_reason in INTERRUPTIONS \
            else None
        word = self.stream.stops.matched if self.stream is not None else None
        stop_id = self.stop_token if self.stop_token is not None and self.stop_token not in self.backend.eos_token_ids \
            else None
        return Finished(self.session.id, self.finish_reason or "cancelled", usage, self.session.snapshot,
                        prompt_read=read, interrupted=interrupted, stop_word=word, stop_id=stop_id,
                        end_id=self.stop_token)

    def _publish_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= STATS_INTERVAL_S:
            self._stats_at = now
            self.session.refresh(self.backend.stats(self.session.cache))
