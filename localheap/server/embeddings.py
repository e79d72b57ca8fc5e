"""Embeddings for /v1/embeddings and Ollama's /api/embed: short inputs are read in padded batches
(Backend.embed_rows, one forward on the engine's thread), longer ones by the engine in a session
of their own (never kept, never matched), their chunks through Backend.prefill_pooled; each
vector is pooled from the model's last hidden states (embedding.py). An input may hold at most
the heap's size (sinks + the smallest layer budget), so nothing is evicted and the vector is the
stock model's."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Optional, Union

import numpy as np
from fastapi import Request

from ..embedding import Pooler, split, take_group
from ..engine import EngineStopped, Feed, Finished, InvalidTokens
from ..sessions import Prompt
from .bridge import DISCONNECT_POLL_S, follow, submit
from .errors import ApiError, BadRequest, PromptTooLong, Unsupported
from .services import Services, owner
from .tokens import encode_bounded

IN_FLIGHT = 2   # a request's inputs in the engine at once: the next is admitted while one is read


class InputTooLong(ApiError):
    """An input past what one heap holds whole (OpenAI's code for it)."""
    code = "context_length_exceeded"

    def __init__(self, index: int, limit: int, at_least: int, param: str = "input"):
        super().__init__(f"input {index} has at least {at_least:,} tokens; this server embeds at most {limit:,} "
                         f"tokens per input (what one session's heap holds whole: --budget and --sinks). Split "
                         f"the text, or send it shorter", param)


def input_limit(svc: Services) -> int:
    """Tokens an input may hold: what a heap keeps without evicting (sinks + the smallest layer
    budget: a pyramid profile's top layer), and no more than --max-prompt-tokens."""
    cfg = svc.store.cfg
    limit = cfg.sinks + min(cfg.layer_budgets(svc.backend.model_shapes().layers))
    if svc.settings.max_prompt_tokens is not None:
        limit = min(limit, svc.settings.max_prompt_tokens)
    return limit


def backend_label(backend) -> str:
    """What serves: "the mlx backend", or "--distributed tensor (mlx)" across ranks (a single MLX
    process may do what the ranks do not)."""
    mode = getattr(getattr(backend, "backend", None), "mode", None)   # (a Leader: rank 0 of --distributed)
    return f"--distributed {mode} ({backend.name})" if mode else f"the {backend.name} backend"


def check_backend(svc: Services) -> None:
    if getattr(svc.backend, "prefill_pooled", None) is None:
        raise Unsupported(f"embeddings are not supported by {backend_label(svc.backend)}", "input")


def embedding_prompt(tokenizer, item: Union[str, list[int]], index: int, limit: int, truncate: bool = False,
                     param: str = "input") -> Prompt:
    """One input as the engine reads it: a text's ids with the special tokens its tokenizer adds
    (a BOS), or ids as sent. Past `limit` tokens: cut to it with `truncate`, else InputTooLong."""
    from .prompts import with_specials

    if isinstance(item, list):
        tokens = list(item)
    else:
        if not item:
            raise BadRequest(f"input {index} is empty", param)
        try:   # (a long text is read in pieces, and stops at the limit unless truncating)
            plain = encode_bounded(tokenizer, item, None if truncate else limit, param)
        except PromptTooLong:
            raise InputTooLong(index, limit, limit + 1, param) from None
        tokens = list(with_specials(tokenizer, item, plain))
    if not tokens:
        raise BadRequest(f"input {index} is empty", param)
    if len(tokens) > limit:
        if not truncate:
            raise InputTooLong(index, limit, len(tokens), param)
        tokens = tokens[:limit]
    return Prompt(tokens)


async def embed(svc: Services, request: Request, prompts: list[Prompt], pooling: Optional[str] = None) -> list[np.ndarray]:
    """Each prompt's pooled vector (not normalized), in order. Short inputs are read in padded
    batches of at most a prefill chunk's tokens (a riding chunk's while runs decode), each one
    forward on the engine's thread beside a step of the decode batch (embedding.split and
    take_group, Engine.call_in_turn); longer ones each as a Feed
    in a session of its own, in prefill chunks. IN_FLIGHT at a time; a client that leaves cancels
    what is left."""
    who = owner(request)
    mode = pooling or svc.settings.embed_pooling
    vectors: list = [None] * len(prompts)
    slots = asyncio.Semaphore(IN_FLIGHT)
    lengths = [len(p.tokens) for p in prompts]
    if getattr(svc.backend, "embed_rows", None) is not None:
        short, alone = split(lengths, svc.store.cfg.chunk)
    else:
        short, alone = [], list(range(len(prompts)))
    pending = deque(short)
    for i, p in enumerate(prompts):   # ids past the vocabulary: a 400 naming the input, before any work
        try:
            svc.engine.admission.check_tokens(p.tokens)
        except InvalidTokens as e:
            raise BadRequest(f"input {i}: {e}", "input", "invalid_token_id") from None

    def next_rows() -> tuple[list[int], list]:
        """(On the engine thread, in turn.) The next padded group of short inputs and its rows: a
        prefill chunk's tokens, a riding chunk's while runs decode (a chat waits one small forward)."""
        tokens = svc.engine.mixed_chunk if svc.engine.decoding else svc.store.cfg.chunk
        group = take_group(pending, lengths, tokens)
        return group, (svc.backend.embed_rows([prompts[i].tokens for i in group]) if group else [])

    async def rows() -> None:
        while pending:
            async with slots:
                group, got = await asyncio.wrap_future(svc.engine.call_in_turn(next_rows))
            for i, (total, n, last) in zip(group, got):
                pool = Pooler(mode)
                pool.add(total, n, last)
                vectors[i] = pool.vector()

    async def one(i: int) -> None:
        async with slots:
            pool = Pooler(mode)
            job, events, _ = await submit(svc.engine, lambda emit: Feed(prompts[i], emit, owner=who, ephemeral=True,
                                                                        pool=pool))
            async for event in follow(job, events):
                if isinstance(event, Finished) and event.finish_reason != "fed":   # the server is stopping
                    raise EngineStopped()
            vectors[i] = pool.vector()

    tasks = [asyncio.create_task(rows()) for _ in range(min(IN_FLIGHT, len(short)))] + \
        [asyncio.create_task(one(i)) for i in alone]
    watcher = asyncio.create_task(_watch(request, tasks))
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        if not (watcher.done() and not watcher.cancelled() and watcher.result()):
            raise   # (the route itself cancelled: the server is stopping)
        # the client left and its inputs were cancelled: nobody to answer, nothing to log as an error
        raise BadRequest("the client closed the connection before its embeddings were made") from None
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()   # (after a failure: the others stop; each cancels its job)
        await asyncio.gather(*tasks, return_exceptions=True)
    return vectors


async def _watch(request: Request, tasks: list) -> bool:
    """Cancel the inputs' tasks (and so their jobs) when the client leaves (True: it did)."""
    while not all(t.done() for t in tasks):
        if await request.is_disconnected():
            for t in tasks:
                t.cancel()
            return True
        await asyncio.sleep(DISCONNECT_POLL_S)
    return False
