"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Sequence, Union

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ...engine import Delta, Finished, Job, Progress, Started
from ...generation import LogprobRecorder, SamplingParams, check_logit_bias
from ...sessions import Prompt
from ...sessions.disk import valid_id
from ..bridge import JobEvents, collect, follow, merged
from ..chat import ChatPlan, check_slot, start
from ..errors import BadRequest, Unsupported, to_response
from ..embeddings import backend_label
from ..fim import fim_format, fim_prompt
from ..logonce import warn_once
from ..llamacpp import cut_fields, dry_fields, penalties_on, prompt_progress, switched
from ..formats import (Echo, InputStream, Out, Reply, add_call_errors, custom_input, extension, finish_reason, saved_headers,
                       stop_reason, tool_call_dict, total_usage)
from ..prompts import chat_prompt, completion_prompt, tokenize, with_effort
from ..responses import CustomTool, offer
from ..schemas import AllowedTools, ChatCompletionRequest, CompletionRequest, SamplingFields
from ..services import Services, services
from ..toolcalls import CallArgs, CallStart, OutputParser, Piece
from ..toolformats import ToolCall
from . import api_router

router = api_router()
SESSION_HEADER = "X-Session-Id"


def addressed_session(x_session_id: Optional[str] = Header(None)) -> Optional[str]:
    """The session an X-Session-Id header addresses. Only this server's ids (sess_...) address
    one: some clients send a header of that name carrying their own conversation id (opencode
    sends "ses_..." on every request, for a provider's cache affinity; its title request and its
    agent's share it). Such an id is ignored (logged once): the prompt finds its session by its
    prefix, as without the header. An id of this server's form that names no session is a 404."""
    if x_session_id is None or valid_id(x_session_id):
        return x_session_id
    warn_once("%s values that are not this server's session ids (sess_...) are taken for clients' own "
              "conversation ids and ignored; prompts find their sessions by prefix", [SESSION_HEADER])
    return None


@router.get("/v1/models")
async def list_models(svc: Services = Depends(services)) -> dict:
    return {"object": "list", "data": [_model_card(svc, name) for name in svc.model_names]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, svc: Services = Depends(services)) -> dict:
    svc.check_model(model)
    return _model_card(svc, model)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, svc: Services = Depends(services),
                           x_session_id: Optional[str] = Depends(addressed_session)):
    _check(body, svc)
    plan = _plan(body)
    opts = plan.options(svc)
    prompt = await tokenize(chat_prompt, svc.tokenizer, body.messages, limit=svc.settings.max_prompt_tokens,
                            opts=opts)
    first_user = next((m.text() for m in body.messages if m.role == "user"), None)
    default = min(svc.settings.default_max_tokens, svc.settings.max_tokens_limit)
    top = body.top_logprobs or 0 if body.logprobs else None
    reply = Reply("chat", svc.model_id, token_text=svc.token_text if body.logprobs else None,
                  post=bool(body.post_sampling_probs),
                  custom=frozenset(t.name for t in body.tools or () if t.type == "custom"), forced=plan.forced)
    return await _respond(reply, body, prompt, request, svc, x_session_id, first_user,
                          lambda i: _params(body, svc, body.limit(default), i, plan.constraint(svc, opts, prompt), top),
                          lambda: plan.parser(opts, prompt))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, svc: Services = Depends(services),
                      x_session_id: Optional[str] = Depends(addressed_session)):
    _check(body, svc)
    scored = body.echo and body.logprobs is not None   # the prompt's logprobs: read by prefill_scored
    if scored and getattr(svc.backend, "prefill_scored", None) is None:
        raise Unsupported(f"echo with logprobs (the prompt's logprobs) is not supported by "
                          f"{backend_label(svc.backend)}", "echo")
    if scored and x_session_id is not None:
        raise BadRequest("echo with logprobs scores the whole prompt in a session of its own: it cannot continue "
                         f"session {x_session_id!r} (drop X-Session-Id)", "echo")
    sent = body.prompts()
    if len(sent) > 1 and x_session_id is not None:
        raise BadRequest(f"{len(sent)} prompts run each in a session of its own: they cannot continue session "
                         f"{x_session_id!r} (drop X-Session-Id or send one prompt)", "prompt")
    if body.suffix is not None:   # fill in the middle: each prompt is the text before the reply
        prompts = [await tokenize(fim_prompt, svc.tokenizer, p, body.suffix, svc.settings.max_prompt_tokens)
                   for p in sent]
    else:
        prompts = [await tokenize(completion_prompt, svc.tokenizer, p, limit=svc.settings.max_prompt_tokens)
                   for p in sent]
    ends = fim_format(svc.tokenizer).ends if body.suffix is not None else ()
    title = sent[0] if isinstance(sent[0], str) else None
    reply = Reply("text", svc.model_id, token_text=svc.token_text if body.logprobs is not None else None)

    def echo(params: SamplingParams, k: int) -> Optional[Echo]:
        if not body.echo:
            return None
        tokens = list(prompts[k].tokens)
        if not isinstance(sent[k], str):   # ids: their text, specials and all
            return Echo(svc.tokenizer.decode(tokens), tokens, params.prompt_logprobs)
        plain = list(prompts[k].continuation)
        hidden = len(tokens) - len(plain) if tokens[len(tokens) - len(plain):] == plain else 0
        return Echo(sent[k], tokens, params.prompt_logprobs, hidden)

    return await _respond(reply, body, prompts, request, svc, x_session_id, title,
                          lambda i: _params(body, svc, body.max_tokens, i, top_logprobs=body.logprobs, scored=scored,
                                            stop_ids=ends),
                          own_sessions=scored or len(prompts) > 1, make_echo=echo,
                          scratch=body.suffix is not None and x_session_id is None)


def _check(body, svc: Services) -> None:
    svc.check_model(body.model)
    bad = body.unsupported()
    if bad is not None:
        raise Unsupported(bad[1], bad[0])


def _plan(body: ChatCompletionRequest) -> ChatPlan:
    choice, allowed = body.tool_choice, None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, AllowedTools):
        choice, allowed = choice.allowed_tools.mode, [t.name for t in choice.allowed_tools.tools]
    elif not isinstance(choice, str):
        choice = choice.name
    fmt = body.response_format
    schema = None
    if fmt is not None and fmt.type == "json_object":
        schema = {}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ or {}
    tools, arguments = None, {}
    if body.tools:   # a custom tool as the Responses API offers one: a function of `input`, held to its format
        tools = []
        for t in body.tools:
            if t.type == "custom":
                o = offer(CustomTool(type="custom", name=t.name, description=t.custom.description,
                                     format=t.responses_format()))
                tools.append(o.chat())
                if o.enforce is not None:
                    arguments[o.name] = o.enforce
            else:
                tools.append(t.model_dump(exclude_none=True))
    return ChatPlan(tools, choice, body.parallel_tool_calls is not False, schema,
                    with_effort(body.chat_template_kwargs, body.reasoning_effort),
                    arguments or None, allowed=allowed)


def _params(body: SamplingFields, svc: Services, max_tokens: int, choice: int = 0, constraint=None,
            top_logprobs: Optional[int] = None, scored: bool = False, stop_ids: Sequence[int] = ()) -> SamplingParams:
    """Choice `choice`'s sampling (its seed: the request's plus its index); `top_logprobs` not
    None: each token's logprobs recorded, with that many alternatives (`scored`: the prompt's too)."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    vocab = getattr(svc.backend, "vocab_size", None)
    if vocab is not None:
        try:
            check_logit_bias(bias, vocab)
        except ValueError as e:   # here, not once the reply has begun (the sampler checks it too)
            raise BadRequest(str(e), "logit_bias") from e
        if any(t >= vocab for t in body.stop_token_ids or ()):
            raise BadRequest(f"stop_token_ids names token id {max(body.stop_token_ids)}; this model's ids are "
                             f"0..{vocab - 1}", "stop_token_ids")
    seed = None if body.seed is None else body.seed + choice
    temperature, top_k, top_p, min_p = switched(body.samplers, body.temperature, body.top_k, body.top_p, body.min_p)
    extra = {"presence_penalty": body.presence_penalty or 0.0, "frequency_penalty": body.frequency_penalty or 0.0,
             **body.repetition()} if penalties_on(body.samplers) else {}
    extra.update(dry_fields(body, svc.tokenizer, body.samplers), **cut_fields(body, body.samplers))
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed, stop=list(body.stop or []), constraint=constraint,
                          min_p=min_p, **extra, logit_bias=bias,
                          logprobs=None if top_logprobs is None else LogprobRecorder(top_logprobs,
                                                                                     bool(body.post_sampling_probs)),
                          prompt_logprobs=LogprobRecorder(top_logprobs or 0) if scored else None,
                          stop_token_ids=list(body.stop_token_ids or []) + list(stop_ids))


@dataclass
class Choice:
    """One of a request's n choices: its job and the state of its stream."""
    index: int
    job: Job
    events: JobEvents
    parser: Optional[OutputParser] = None
    calls: int = 0
    custom_input: Optional[InputStream] = None      # the call being written is a custom tool's: its input read
    logprobs: list = field(default_factory=list)   # chat: entries whose tokens' text the parser holds back
    first_token_at: Optional[float] = None
    echo: Optional[Echo] = None                     # completions' echo: the prompt, sent before the reply
    started: Optional[Started] = None               # (its prompt's counts: return_progress)
    began: float = field(default_factory=time.monotonic)


def _limit_param(body: SamplingFields) -> str:
    """The field the request gave its reply limit in (its error names it): the first that limit() reads."""
    for name in ("max_completion_tokens", "max_tokens", "n_predict"):
        if getattr(body, name, None) is not None and (name != "n_predict" or body.n_predict >= 0):
            return name
    return "max_tokens"


async def _respond(reply: Reply, body: SamplingFields, prompts: Union[Prompt, list[Prompt]], request: Request,
                   svc: Services, session_id: Optional[str], title: Optional[str],
                   make_params: Callable[[int], SamplingParams],
                   make_parser: Callable[[], Optional[OutputParser]] = lambda: None, own_sessions: bool = False,
                   make_echo: Callable[[SamplingParams, int], Optional[Echo]] = lambda params, k: None,
                   scratch: bool = False):
    """Start the request's n choices of each prompt and answer with them (choice k * n + j: prompt
    k's j-th, seeded as j): the first on the session its prompt extends (or `session_id`), the
    others (`own_sessions`: all) each in a session of its own that is not kept; they decode
    together in the engine's batch. `scratch`: an editor's completion (engine.Generate.scratch)."""
    prompts = prompts if isinstance(prompts, list) else [prompts]
    ephemeral = body.store is False or own_sessions   # absent: kept, so the next turn reuses this one (see README)
    slot = check_slot(svc, body.id_slot)
    choices: list[Choice] = []
    starts: list[Started] = []
    try:
        for k, prompt in enumerate(prompts):
            for j in range(body.n):
                i = k * body.n + j
                params = make_params(j)
                job, events, started = await start(svc, request, prompt, params, session_id if i == 0 else None,
                                                   title if i == 0 else None, ephemeral or i > 0,
                                                   scratch and not (ephemeral or i > 0), body.n_cache_reuse,
                                                   slot=slot if i == 0 else None, limit_param=_limit_param(body))
                choices.append(Choice(i, job, events, make_parser(), echo=make_echo(params, k), started=started))
                starts.append(started)
    except BaseException:
        for c in choices:   # one choice refused (the queue, the budget): none runs
            c.job.cancel()
        raise
    first = starts[0]
    headers = {SESSION_HEADER: first.session_id}
    if not body.stream:
        try:
            got = await asyncio.gather(*(collect(request, c.job, c.events) for c in choices))
        finally:
            for c in choices:
                c.job.cancel()   # (a choice that failed: the others stop too; ended ones ignore it)
        outs = []
        for c, (text, done, logprobs) in zip(choices, got):
            pieces = c.parser.feed(text) + c.parser.finish() if c.parser is not None else None
            outs.append(Out(text, done, pieces, logprobs, c.echo))
        return JSONResponse(reply.full(outs, body.n), headers={**headers, **saved_headers(outs[0].done)})
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventSourceResponse(_stream(reply, choices, first, usage, body.n, bool(body.return_progress)),
                               headers=headers, sep="\n")


async def _stream(reply: Reply, choices: list[Choice], started: Started, usage: bool,
                  n: Optional[int] = None, progress: bool = False) -> AsyncIterator[dict]:
    """The choices' chunks as their events come (each chunk names its choice's index); the last
    chunk of each has its finish_reason, then (include_usage) one usage chunk for them all.
    `progress` (llama-server's return_progress): an empty chunk with prompt_progress as each
    choice's prompt is read, from 0 (chat: a delta of the role and null content, as llama-server's)."""
    first_ext = {"session_id": started.session_id}
    try:
        if reply.kind == "chat":
            for c in choices:
                yield _data(reply.chunk("", first=True, extension=first_ext, with_usage_field=usage, index=c.index))
                first_ext = None
        for c in choices if progress else ():
            yield _progress_chunk(reply, c, Progress(0, 1), usage)
        ended: dict[int, Finished] = {}
        exts: dict[int, dict] = {}
        async with aclosing(merged([follow(c.job, c.events) for c in choices])) as events:
            async for i, event in events:
                c = choices[i]
                if isinstance(event, Progress):
                    if progress:
                        yield _progress_chunk(reply, c, event, usage)
                    continue
                if c.echo is not None and isinstance(event, (Delta, Finished)):   # the prompt is read: it goes first
                    yield _data(reply.echo_chunk(c.echo, extension=first_ext, with_usage_field=usage, index=c.index))
                    first_ext, c.echo = None, None
                if isinstance(event, Delta):
                    c.first_token_at = c.first_token_at or time.monotonic()
                    if c.parser is None:
                        yield _data(reply.chunk(event.text, extension=first_ext, with_usage_field=usage,
                                                logprobs=event.logprobs, index=c.index))
                        first_ext = None
                        continue
                    c.logprobs += event.logprobs or []
                if c.parser is not None and isinstance(event, (Delta, Finished)):   # chat: the reply in its parts
                    for piece in c.parser.feed(event.text) if isinstance(event, Delta) else c.parser.finish():
                        chunk = _piece_chunk(reply, piece, c, usage)
                        if chunk is not None:
                            yield chunk
                            c.logprobs = []   # they went with it
                        c.calls += isinstance(piece, ToolCall)
                if isinstance(event, Finished):
                    ended[c.index] = event
                    decode_s = time.monotonic() - c.first_token_at if c.first_token_at is not None else None
                    ext = exts[c.index] = extension(event, decode_s)
                    last = reply.chunk(None, finish_reason(event, c.calls > 0), extension=ext,
                                       with_usage_field=usage, logprobs=c.logprobs, index=c.index)
                    last["choices"][0]["stop_reason"] = stop_reason(event)
                    yield _data(last)
        if usage:
            dones = [ended[i] for i in range(len(choices))]
            yield _data(reply.usage_chunk(total_usage(dones, n), exts[0]))   # (the first choice's session and speed)
    except Exception as e:   # headers are gone: report in the stream, as OpenAI does
        yield {"data": to_response(e).body.decode()}
    yield {"data": "[DONE]"}


def _progress_chunk(reply: Reply, c: Choice, event: Progress, usage: bool) -> dict:
    body = reply.chunk(None, delta={"role": "assistant", "content": None} if reply.kind == "chat" else None,
                       with_usage_field=usage, index=c.index)
    body["prompt_progress"] = prompt_progress(c.started.prompt_tokens, c.started.cached_tokens, event.done,
                                              event.total, c.began, time.monotonic())
    return _data(body)


def _piece_chunk(reply: Reply, piece: Piece, c: Choice, usage: bool) -> Optional[dict]:
    """A reply piece of choice `c` as a chunk: content, reasoning_content, or a tool call (its index:
    its place in the reply), whole or as it is written (its id and name, then its arguments in
    parts); it carries the choice's logprobs (the entries of the tokens read since its last chunk)."""
    index, logprobs = c.calls, c.logprobs
    errors = _call_errors(piece, index, reply.custom)
    if isinstance(piece, ToolCall) and piece.streamed and piece.name in reply.custom:
        rest = c.custom_input.rest(custom_input(piece)[0]) if c.custom_input is not None else None
        if not rest and not errors:
            return None
        delta = {"tool_calls": [{"index": index, "custom": {"input": rest}}]} if rest else {}
    elif isinstance(piece, ToolCall) and piece.streamed:
        if not errors:
            return None
        return _data(reply.chunk(None, delta={}, with_usage_field=usage, extension=errors, logprobs=logprobs,
                                 index=c.index))
    elif isinstance(piece, ToolCall):
        delta = {"tool_calls": [tool_call_dict(piece, index, reply.custom)]}
    elif isinstance(piece, CallStart) and piece.name in reply.custom:
        c.custom_input = InputStream()
        delta = {"tool_calls": [{"index": index, "id": piece.id, "type": "custom",
                                 "custom": {"name": piece.name, "input": ""}}]}
    elif isinstance(piece, CallStart):
        c.custom_input = None
        delta = {"tool_calls": [{"index": index, "id": piece.id, "type": "function",
                                 "function": {"name": piece.name, "arguments": ""}}]}
    elif isinstance(piece, CallArgs):
        if c.custom_input is not None:   # a custom call's input as it is read from its arguments
            text = c.custom_input.feed(piece.text)
            if not text:
                return None
            delta = {"tool_calls": [{"index": index, "custom": {"input": text}}]}
        else:
            delta = {"tool_calls": [{"index": index, "function": {"arguments": piece.text}}]}
    else:
        delta = {"content" if piece.kind == "content" else "reasoning_content": piece.text}
    return _data(reply.chunk(None, delta=delta, with_usage_field=usage, extension=errors, logprobs=logprobs,
                             index=c.index))


def _call_errors(piece: Piece, index: int, custom: frozenset) -> Optional[dict]:
    if not isinstance(piece, ToolCall):
        return None
    ext: dict = {}
    add_call_errors(ext, [piece], index, custom)
    return ext or None


def _data(body: dict) -> dict:
    return {"data": json.dumps(body, separators=(",", ":"))}


def _model_card(svc: Services, name: str) -> dict:
    b = svc.backend
    return {"id": name, "object": "model", "created": int(svc.started), "owned_by": "localheap",
            "localheap": {"backend": b.name, "weights_bytes": b.weights_bytes,
                          "heap": svc.settings.heap.to_dict(),
                          "heap_bytes_per_session": b.heap_bytes(svc.settings.heap)}}
