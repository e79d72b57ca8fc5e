"""Requests into the engine and the events it sends back, as plain data.

Events go out through the request's `emit` callable, which is called on the engine
thread and must not block (the server's emit hands events to the event loop).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..embedding import Pooler
from ..generation import SamplingParams
from ..sessions import Prompt


@dataclass
class Started:
    session_id: str
    prompt_tokens: int   # tokens the session holds once the prompt is fed
    cached_tokens: int   # of those, reused from the session
    slot: int = -1       # the engine's slot the run holds (slots.py)


@dataclass
class Progress:
    done: int            # new prompt tokens fed so far
    total: int


@dataclass
class Delta:
    text: str
    tokens: int          # completion tokens so far
    logprobs: Optional[list] = None   # a request with a logprobs recorder: TokenLogprob of each reply token
                                      # since the last Delta (the text may be "" then: a last one, or a stop's)
    ids: Optional[list] = None        # the reply's ids since the last Delta (an ending EOS or stop_token_ids id not)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# Finished.interrupted: "shutdown" (SIGTERM: the session keeps what the run read and wrote, saved);
# "deleted" (DELETE of its session: the reply ends, nothing is kept); "stopped" (POST
# /v1/sessions/{id}/stop: the reply ends at its next step, its client still reading, the session keeps it)
INTERRUPTIONS = ("shutdown", "deleted", "stopped")
LISTENING = ("stopped",)   # cancels whose client reads the reply to its end, held-back text too (a shutdown's
                          # reply goes on at the restart: a character cut there is finished then)


@dataclass
class Finished:
    session_id: str
    finish_reason: str   # "stop" | "length" | "cancelled" | "fed" (documents)
    usage: Usage
    session: dict        # the session's snapshot, heap stats included
    prompt_read: int = 0                 # of the new prompt tokens, those the session now holds
    saved: Optional[bool] = None         # the turn is on disk (None: this store keeps nothing on disk)
    save_error: Optional[str] = None     # why it is not (it stays in memory and is saved when it can be)
    interrupted: Optional[str] = None    # why the server stopped the run, not the client: INTERRUPTIONS
    stop_word: Optional[str] = None      # the stop sequence that ended the reply (finish_reason "stop")
    stop_id: Optional[int] = None        # the stop_token_ids id that ended it (EOS is neither)
    end_id: Optional[int] = None         # the id that ended it, an EOS or a stop_token_ids one (in no Delta's ids)


@dataclass
class Failed:
    error: Exception


Event = Union[Started, Progress, Delta, Finished, Failed]
Emit = Callable[[Event], None]


@dataclass
class Generate:
    """Continue a session with `prompt` and sample a reply. session_id None: the session
    whose history the prompt extends, else a new one."""
    prompt: Prompt
    params: SamplingParams
    emit: Emit
    session_id: Optional[str] = None
    owner: Optional[str] = None   # the API key's owner id: only its sessions are matched or continued
    ephemeral: bool = False       # a session of its own, never saved, deleted with its files when the reply ends
    scratch: bool = False         # an editor's completion (/infill, a suffix): its session is a cache for the next
                                  # one: never saved nor in the index, matched only by scratch requests, at most
                                  # SCRATCH_KEEP an owner, and the one a fork of its checkpoint replaces is dropped
    cache_reuse: Optional[int] = None   # a trimmed history's fewest tokens a run (n_cache_reuse; None: the server's)
    slot: Optional[int] = None    # llama-server's id_slot: run on this slot, once it is free (None: the lowest free)
    reply_begun: int = 0          # the prompt's last n tokens are a reply begun before (a background response run on
                                  # after a restart): read as prompt, but counted as the reply's (usage), and its text
                                  # goes on from theirs; params.max_tokens is what is left of the reply's limit


@dataclass
class Feed:
    """Append `prompt` (a document) to a session without generating. With `pool`, its chunks
    are read by Backend.prefill_pooled, their last hidden states going to the Pooler (an
    embedding), each on its own (not in the decode batch)."""
    prompt: Prompt
    emit: Emit
    session_id: Optional[str] = None
    owner: Optional[str] = None
    ephemeral: bool = False       # a session of its own, never saved, deleted with its files when the feed ends
    pool: Optional[Pooler] = None
    scratch: bool = False         # an editor's context (/infill's warm-up): matched like a Generate (see there)


_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    """A submitted request. cancel() is safe from any thread; the engine stops it at its
    next step (one decode token or one prefill chunk)."""
    request: Union[Generate, Feed]
    id: int = field(default_factory=lambda: next(_ids))
    _cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    cancel_reason: Optional[str] = None
    ended: bool = False   # the engine ended it (Engine._end, once)

    def cancel(self, reason: str = "client") -> None:
        """reason: "client" (gone, or a stop sequence), "shutdown" (the server is stopping), "deleted"
        (its session is) or "stopped" (a stop asked for its session: Engine.stop_session)."""
        if self.cancel_reason is None or reason == "deleted":   # (a delete after a stop: nothing is kept)
            self.cancel_reason = reason
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
