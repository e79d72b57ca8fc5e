"""Ollama's API: POST /api/chat and /api/generate (NDJSON lines, or one object with stream
false), POST /api/embed and /api/embeddings, GET /api/tags, /api/ps and /api/version, POST
/api/show. The same sessions, heap, recall and prefix reuse as the other routes: the
conversation is rendered by the same chat template."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import AsyncIterator, Optional, Sequence

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, ValidationError

from ...embedding import finish
from ...engine import Delta, Finished, Job
from ..bridge import JobEvents, follow, watch_disconnect
from ..chat import start
from ..errors import BadRequest, UnknownModel, Unsupported
from ..fim import fim_format, fim_prompt
from ..formats import save_fields, saved_headers
from ..logprobs import chat_content
from ..logonce import warn_once
from ..embeddings import check_backend, embed, embedding_prompt, input_limit
from ..ollama import (OLLAMA_VERSION, ChatRequest, EmbedRequest, GenerateRequest, LegacyEmbeddingsRequest, ShowRequest,
                      call_dict, final_fields, model_entry, now_iso, tag)
from ..prompts import after_context, chat_prompt, completion_prompt, tokenize
from ..services import Services, services
from ..tokens import encode_plain
from ..toolcalls import OutputParser, Text
from ..toolformats import ToolCall, template_source
from . import api_router
from .openai import SESSION_HEADER, addressed_session

router = api_router()
NDJSON = "application/x-ndjson"


def _check_model(svc: Services, model: str) -> None:
    """Ollama's names carry a tag: the served model answers to its id and to id:latest."""
    svc.check_model(next((n for n in svc.model_names if model in answers_to(n)), model))


def answers_to(name: str) -> tuple[str, ...]:
    """A served name, as Ollama lists it (tag: "id:latest" for an id without a colon), and with
    ":latest" after it (an id with a colon of its own, random:llama:tiny, is listed as it is)."""
    return name, tag(name), f"{name}:latest"


@router.get("/api/version")
async def api_version() -> dict:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        ours = installed("localheap")
    except PackageNotFoundError:   # run from a checkout
        ours = None
    return {"version": OLLAMA_VERSION, "localheap": ours}


@router.get("/api/tags")
async def tags(svc: Services = Depends(services)) -> dict:
    return {"models": [model_entry(svc, name) for name in svc.model_names]}


@router.get("/api/ps")
async def ps(svc: Services = Depends(services)) -> dict:
    return {"models": [{**model_entry(svc), "expires_at": "2318-08-29T00:00:00Z", "size_vram": 0}]}


async def read_json(request: Request, cls):
    """The body as `cls`, whatever its Content-Type: Ollama's own examples post JSON with curl -d,
    which labels it a form. Fields it does not know are ignored, as Ollama (Go's JSON decoding)
    ignores them, each name logged once: Cline sends `tool_choice` to /api/chat."""
    raw = await request.body() or b"{}"
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    extras = [err["loc"] for err in errors if err["type"] == "extra_forbidden"]
    if extras:
        try:
            data = json.loads(raw)
            for loc in extras:
                node = data
                for step in loc[:-1]:
                    node = node[step]
                del node[loc[-1]]
            body = cls.model_validate(data)
        except ValidationError as again:
            errors = again.errors(include_url=False)
        except (ValueError, KeyError, IndexError, TypeError):   # not where the error said: report it as it was
            pass
        else:
            warn_once("fields Ollama's API does not have, ignored (as Ollama ignores them): %s",
                      sorted({".".join(map(str, loc)) for loc in extras}))
            return body
    raise RequestValidationError(errors)


@router.post("/api/show")
async def show(request: Request, svc: Services = Depends(services)) -> dict:
    body = await read_json(request, ShowRequest)
    model = body.model or body.name
    if not model:
        raise BadRequest("show needs the model's name", "model")
    _check_model(svc, model)
    entry = model_entry(svc)
    template = template_source(svc.tokenizer)
    capabilities = ["completion"]
    if template and "tool" in template:
        capabilities.append("tools")
    if "<think>" in template:
        capabilities.append("thinking")
    if fim_format(svc.tokenizer) is not None:   # a suffix is taken (editors turn fill in the middle on by it)
        capabilities.append("insert")
    shapes = svc.backend.model_shapes()
    family = entry["details"]["family"]
    return {"modelfile": "", "parameters": "", "template": template, "details": entry["details"],
            "model_info": {"general.architecture": family, f"{family}.block_count": shapes.layers,
                           f"{family}.embedding_length": shapes.hidden,
                           f"{family}.context_length": svc.settings.max_prompt_tokens},
            "capabilities": capabilities, "modified_at": entry["modified_at"]}


class _Named(BaseModel):
    model_config = ConfigDict(extra="ignore")   # (insecure, stream, and create's many fields: answered by name alone)
    model: Optional[str] = None
    name: Optional[str] = None      # (older clients)
    stream: bool = True


def _served(svc: Services, body: "_Named", what: str) -> bool:
    name = body.model or body.name
    if not name:
        raise BadRequest(f"{what} needs the model's name", "model")
    return any(name in answers_to(n) for n in svc.model_names)


@router.post("/api/pull")
async def pull(request: Request, svc: Services = Depends(services)):
    """The served model is here already: success at once (Open WebUI and editors pull before use).
    Another name is a 404 saying which model this server serves: it downloads nothing."""
    body = await read_json(request, _Named)
    if not _served(svc, body, "pull"):
        raise UnknownModel(f"model {body.model or body.name!r} is not served here and this server downloads no "
                           f"models: it serves {svc.model_id!r}, chosen at start (localheap serve --model NAME)",
                           "model")
    line = {"status": "success"}
    if body.stream:
        return StreamingResponse(iter([json.dumps(line) + "\n"]), media_type=NDJSON)
    return line


@router.delete("/api/delete")
async def delete_model(request: Request, svc: Services = Depends(services)):
    body = await read_json(request, _Named)
    if not _served(svc, body, "delete"):
        raise UnknownModel(f"model {body.model or body.name!r} not found: this server serves {svc.model_id!r}",
                           "model")
    raise BadRequest(f"{svc.model_id!r} is the model this server was started with; it is not deleted through the "
                     f"API (stop the server, or start it with another --model)", "model")


@router.post("/api/copy")
@router.post("/api/create")
@router.post("/api/push")
async def manage(request: Request):
    name = request.url.path.rsplit("/", 1)[-1]
    raise Unsupported(f"/api/{name} is not supported: this server serves the one model it was started with "
                      f"(localheap serve --model NAME); it makes, copies and uploads no models", None)


@router.post("/api/chat")
async def chat(request: Request, svc: Services = Depends(services), x_session_id: Optional[str] = Depends(addressed_session)):
    body = await read_json(request, ChatRequest)
    _check_model(svc, body.model)
    if not body.messages:   # Ollama's way to load a model: done at once
        return _loaded(svc, body, {"message": {"role": "assistant", "content": ""}})
    plan = body.plan()
    opts = plan.options(svc)
    msgs = body.chat_messages()
    prompt = await tokenize(chat_prompt, svc.tokenizer, msgs, limit=svc.settings.max_prompt_tokens, opts=opts)
    return await _run(request, svc, body, prompt, plan.parser(opts, prompt), plan.constraint(svc, opts, prompt),
                      x_session_id, next((m.text() for m in msgs if m.role == "user"), None), chat=True)


@router.post("/api/generate")
async def generate(request: Request, svc: Services = Depends(services), x_session_id: Optional[str] = Depends(addressed_session)):
    body = await read_json(request, GenerateRequest)
    _check_model(svc, body.model)
    bad = body.unsupported()
    if bad is not None:
        raise Unsupported(bad[1], bad[0])
    if not body.prompt:   # loads the model
        return _loaded(svc, body, {"response": ""})
    plan = body.plan()
    opts = plan.options(svc)
    ends = ()
    if body.suffix:   # fill in the middle: the prompt is the text before the reply, the suffix the text after
        prompt = await tokenize(fim_prompt, svc.tokenizer, body.prompt, body.suffix, svc.settings.max_prompt_tokens)
        ends = fim_format(svc.tokenizer).ends
    elif body.raw:
        prompt = await tokenize(completion_prompt, svc.tokenizer, body.prompt, limit=svc.settings.max_prompt_tokens)
    else:
        prompt = await tokenize(chat_prompt, svc.tokenizer, body.chat_messages(), limit=svc.settings.max_prompt_tokens,
                                opts=opts)
    if body.context:   # an earlier reply's ids, this prompt after them (as Ollama: deprecated there, still sent)
        prompt = after_context(svc.tokenizer, body.context, prompt, svc.settings.max_prompt_tokens)
    return await _run(request, svc, body, prompt, plan.parser(opts, prompt), plan.constraint(svc, opts, prompt),
                      x_session_id, body.prompt, chat=False, stop_ids=ends,
                      scratch=bool(body.suffix) and x_session_id is None,
                      context=None if body.raw or body.suffix else prompt.tokens)


@router.post("/api/embed")
async def embed_route(request: Request, svc: Services = Depends(services)) -> Response:
    """Each input's vector at unit length (the mean of the last hidden states: --embed-pooling);
    an input past the heap's size is cut to it unless `truncate` is false."""
    began = time.monotonic()
    body = await read_json(request, EmbedRequest)
    _check_model(svc, body.model)
    check_backend(svc)
    hidden = svc.backend.model_shapes().hidden
    if body.dimensions is not None and body.dimensions > hidden:
        raise BadRequest(f"dimensions must be at most {hidden} for this model (its hidden size)", "dimensions")
    texts = [] if body.input == "" else body.inputs()   # none: the model is loaded, as Ollama's
    if not all(texts):
        raise BadRequest(f"input {[bool(t) for t in texts].index(False)} is empty", "input")
    limit = input_limit(svc)
    prompts = [await tokenize(embedding_prompt, svc.tokenizer, text, i, limit, body.truncate)
               for i, text in enumerate(texts)]
    vectors = await embed(svc, request, prompts) if prompts else []

    def answer() -> bytes:   # off the event loop (many long vectors take seconds to write)
        out = [finish(v, body.dimensions).tolist() for v in vectors]
        return json.dumps({"model": tag(svc.model_id), "embeddings": out, "load_duration": 0,
                           "total_duration": int((time.monotonic() - began) * 1e9),
                           "prompt_eval_count": sum(len(p.tokens) for p in prompts)}).encode()

    return Response(await run_in_threadpool(answer), media_type="application/json")


@router.post("/api/embeddings")
async def embeddings_route(request: Request, svc: Services = Depends(services)) -> dict:
    """Ollama's older route: one prompt's vector as the model gives it (not scaled to unit length);
    an empty prompt loads the model and embeds nothing."""
    body = await read_json(request, LegacyEmbeddingsRequest)
    _check_model(svc, body.model)
    check_backend(svc)
    if not body.prompt:
        return {"embedding": []}
    prompt = await tokenize(embedding_prompt, svc.tokenizer, body.prompt, 0, input_limit(svc), truncate=True,
                            param="prompt")
    vector, = await embed(svc, request, [prompt])
    return {"embedding": finish(vector, normalize=False).tolist()}


def _loaded(svc: Services, body, reply: dict):
    """The answer to a request with nothing to run: Ollama's load, or with keep_alive 0 its unload (the
    model stays: it is the one this server serves)."""
    done = "unload" if _zero_duration(body.keep_alive) else "load"
    line = {"model": tag(svc.model_id), "created_at": now_iso(), **reply, "done": True, "done_reason": done}
    if body.stream:
        return StreamingResponse(iter([json.dumps(line) + "\n"]), media_type=NDJSON)
    return JSONResponse(line)


def _zero_duration(value) -> bool:
    """Whether keep_alive is 0 (a number of seconds, or Ollama's duration text: "0", "0s", "0m")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    m = re.fullmatch(r"\s*(\d*\.?\d*)\s*(ns|us|µs|ms|s|m|h)?\s*", value) if isinstance(value, str) else None
    return m is not None and m.group(1) not in ("", ".") and float(m.group(1)) == 0


async def _run(request: Request, svc: Services, body, prompt, parser: OutputParser, constraint,
               session_id: Optional[str], title: Optional[str], chat: bool, stop_ids: Sequence[int] = (),
               scratch: bool = False, context: Optional[Sequence[int]] = None):
    """context: the prompt's ids, for the final line's `context` (generate, not raw)."""
    began = time.monotonic()
    default = min(svc.settings.default_max_tokens, svc.settings.max_tokens_limit)
    params = body.params(default, constraint)
    params.stop_token_ids += list(stop_ids)
    job, events, started = await start(svc, request, prompt, params, session_id, title, scratch=scratch,
                                       limit_param="options.num_predict")
    reply = Reply(svc, parser, chat, began, svc.token_text if params.logprobs is not None else None, context)
    headers = {SESSION_HEADER: started.session_id}
    if body.stream:
        return StreamingResponse(_lines(reply, job, events), media_type=NDJSON, headers=headers)
    watcher = asyncio.create_task(watch_disconnect(request, job))
    parts: list[dict] = []
    try:
        async for line in reply.lines(job, events):
            parts.append(line)
    finally:
        watcher.cancel()
    whole = reply.merged(parts)
    return JSONResponse(whole, headers={**headers, **saved_headers(reply.done)})


async def _lines(reply: "Reply", job: Job, events: JobEvents) -> AsyncIterator[str]:
    try:
        async for line in reply.lines(job, events):
            yield json.dumps(line, separators=(",", ":")) + "\n"
    except Exception as e:   # noqa: BLE001 - the status is gone: an error line, as Ollama sends one
        from ..errors import to_response

        yield json.dumps({"error": json.loads(to_response(e).body)["error"]["message"]}) + "\n"


class Reply:
    """A job's Deltas as Ollama's lines: text (chat: message.content; generate: response),
    thinking, tool calls (chat: each whole, once written), then the final line: with `context` given
    (the prompt's ids), the prompt's and reply's ids under "context", the id that ended it included
    (a reply a stop sequence ended: its text as returned, tokenized, as Ollama's; the sequence's
    tokens are not the conversation's)."""

    def __init__(self, svc: Services, parser: OutputParser, chat: bool, began: float, token_text=None,
                 context: Optional[Sequence[int]] = None):
        self.svc, self.parser, self.chat, self.began = svc, parser, chat, began
        self.token_text = token_text          # logprobs asked for: a token's text and bytes
        self.context = list(context) if context is not None else None
        self.asked = len(self.context) if context is not None else 0   # of those, the prompt's
        self.text = ""                                                # the reply's text (context only)
        self.pending: list = []               # TokenLogprob entries not yet in a line
        self.first_token: Optional[float] = None
        self.done: Optional[Finished] = None
        self.calls = 0
        self.call_errors: list[dict] = []

    async def lines(self, job: Job, events: JobEvents) -> AsyncIterator[dict]:
        async for event in follow(job, events):
            if isinstance(event, Delta):
                self.first_token = self.first_token or time.monotonic()
                self.pending += event.logprobs or []
                if self.context is not None:
                    self.context += event.ids or []
                    self.text += event.text
                for line in self._pieces(self.parser.feed(event.text)):
                    yield self._with_logprobs(line)
            elif isinstance(event, Finished):
                for line in self._pieces(self.parser.finish()):
                    yield self._with_logprobs(line)
                self.done = event
                yield self._with_logprobs(self._final(event))
                return

    def _with_logprobs(self, line: dict) -> dict:
        """The entries of the tokens read since the last line go with this one (a token the parser
        holds back, as the start of a tag, goes with the line its text comes out in): in order,
        every generated token once, thinking and calls included, as Ollama lists them."""
        if self.token_text is not None and self.pending:   # (none: no field, as Ollama omits it)
            line["logprobs"], self.pending = chat_content(self.token_text, self.pending), []
        return line

    def _line(self, content: str = "", thinking: Optional[str] = None, calls: Optional[list] = None) -> dict:
        head = {"model": tag(self.svc.model_id), "created_at": now_iso()}
        if self.chat:
            message = {"role": "assistant", "content": content}
            if thinking is not None:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {**head, "message": message, "done": False}
        line = {**head, "response": content, "done": False}
        if thinking is not None:
            line["thinking"] = thinking
        return line

    def _pieces(self, pieces) -> list[dict]:
        out = []
        for p in pieces:
            if isinstance(p, Text):
                out.append(self._line(p.text) if p.kind == "content" else self._line("", thinking=p.text))
            elif isinstance(p, ToolCall):
                if p.error is not None:
                    self.call_errors.append({"index": self.calls, "id": p.id, "error": p.error})
                out.append(self._line(calls=[call_dict(p, self.calls)]))
                self.calls += 1
            # a call's parts as they are written (CallStart, CallArgs): it goes out whole
        return out

    def _final(self, done: Finished) -> dict:
        line = {**self._line(), **final_fields(done, self.began, self.first_token, time.monotonic())}
        if self.context is not None and done.stop_word is not None:
            line["context"] = self.context[:self.asked] + encode_plain(self.svc.tokenizer, self.text)
        elif self.context is not None:
            line["context"] = self.context + ([done.end_id] if done.end_id is not None else [])
        ext = {"session_id": done.session_id, "heap": done.session.get("heap"), **save_fields(done)}
        if self.call_errors:
            ext["tool_call_errors"] = self.call_errors
        line["localheap"] = ext
        return line

    def merged(self, lines: list[dict]) -> dict:
        """stream false: one object, the lines' text, thinking and calls joined into the last one's."""
        last = dict(lines[-1])
        text = "".join(self._text(line) for line in lines)
        thinking = "".join(self._thinking(line) for line in lines)
        if self.chat:
            calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
            message = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            last["message"] = message
        else:
            last["response"] = text
            if thinking:
                last["thinking"] = thinking
        entries = [e for line in lines for e in line.get("logprobs", [])]
        if entries:
            last["logprobs"] = entries
        return last

    def _text(self, line: dict) -> str:
        return line["message"]["content"] if self.chat else line["response"]

    def _thinking(self, line: dict) -> str:
        return (line["message"] if self.chat else line).get("thinking") or ""

