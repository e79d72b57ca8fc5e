"""llama.cpp's server API (llama-server): POST /completion (and /completions), /infill, /tokenize,
/detokenize and /apply-template, GET /props and /slots. Server-sent events for stream true (a data
line a piece, the last with stop true and the timings; no [DONE], as llama-server's), else one object
(an array for several prompts)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse

from ...engine import Delta, Feed, Finished, Job, Progress, slotstate
from ...engine.slots import InvalidSlot
from ...grammar import Grammar, GrammarError, json_grammar
from ...sessions import Prompt, slotfiles
from ..bridge import JobEvents, follow, merged, submit, watch_disconnect
from ..chat import check_slot, start
from ..errors import BadRequest, NoSlotFree, NotSupported, SlotFileUnwritable, to_response
from ..fim import fim_format
from ..formats import save_fields
from ..llamacpp import (Cut, LlamaRequest, infill_context, infill_prompt, mixed_prompt, pick_fields, piece_of,
                        probabilities, prompt_forms, prompt_progress, stop_type, timings)
from ..prompts import chat_prompt, tokenize, with_specials
from ..schemas import TOKENIZE_MAX_CHARS, ChatMessage
from ..services import Services, owner, services
from ..tokens import PIECE_CHARS, encode_bounded, encode_plain
from ..toolformats import template_source
from . import api_router
from .ollama import read_json
from .openai import SESSION_HEADER

router = api_router()


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None   # accepted, unused (SillyTavern sends it, "undefined" when none is picked)
    content: str = Field(max_length=TOKENIZE_MAX_CHARS)
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None   # accepted, unused
    tokens: list[int] = Field(default_factory=list)


class TemplateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")   # (the rest of a chat request: not needed to render it)
    messages: list[ChatMessage]


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request, svc: Services = Depends(services)):
    body = await read_json(request, LlamaRequest)
    prompts = [await tokenize(mixed_prompt, svc.tokenizer, p, svc.settings.max_prompt_tokens)
               for p in prompt_forms(body.prompt)]
    return await _answer(request, svc, body, prompts, stop_ids=())


@router.post("/infill")
async def infill(request: Request, svc: Services = Depends(services)):
    """n_predict 0 with input_extra (the editors' warm-up: "read these files for the next
    completion"): the part before <prefix> is read as a document and checkpointed, so every
    completion after it (whatever the cursor's prefix and suffix) forks from there. Both are
    scratch (engine.Generate.scratch): an editor keeps one session, not one a completion."""
    body = await read_json(request, LlamaRequest)
    limit = svc.settings.max_prompt_tokens
    if body.input_extra and body.limit(svc.settings.default_max_tokens) == 0:
        context = await tokenize(infill_context, svc.tokenizer, body, limit)
        began = time.monotonic()
        job, events, started = await submit(svc.engine, lambda emit: Feed(context, emit, None, owner(request),
                                                                          scratch=True))
        slot = Slot(0, job, events, started.session_id, started.prompt_tokens, started.cached_tokens, began,
                    Cut(0, 0))
        params = body.params(0, None, (), svc.tokenizer)
        return await _reply(request, svc, body, [slot], params)
    prompt = await tokenize(infill_prompt, svc.tokenizer, body, limit)
    return await _answer(request, svc, body, [prompt], stop_ids=fim_format(svc.tokenizer).ends, scratch=True)


@router.post("/tokenize")
async def tokenize_route(body: TokenizeBody, svc: Services = Depends(services)) -> dict:
    """The text in pieces (bounded memory, as every prompt), its special tokens' text read as those
    tokens; with parse_special false, as text (one call: at most PIECE_CHARS characters)."""
    tok = svc.tokenizer
    if body.parse_special:
        ids = await tokenize(lambda t, text: Prompt(encode_bounded(t, text, None, "content")), tok, body.content)
        got = list(ids.tokens)
        if body.add_special:
            got = list(with_specials(tok, body.content, got))
    elif len(body.content) > PIECE_CHARS:
        raise BadRequest(f"with parse_special false the content may have at most {PIECE_CHARS:,} characters",
                         "content")
    else:
        got = await asyncio.to_thread(lambda: encode_plain(tok, body.content, "content", specials=False))
        if body.add_special:
            got = list(with_specials(tok, body.content, got))
    if body.with_pieces:
        return {"tokens": [{"id": t, "piece": piece_of(svc.token_text, t)} for t in got]}
    return {"tokens": got}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, svc: Services = Depends(services)) -> dict:
    vocab = getattr(svc.backend, "vocab_size", None) or len(svc.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"token id {bad[0]} is not in this model's vocabulary (0..{vocab - 1})", "tokens")
    return {"content": await asyncio.to_thread(svc.tokenizer.decode, body.tokens)}


@router.post("/apply-template")
async def apply_template(body: TemplateBody, svc: Services = Depends(services)) -> dict:
    prompt = await tokenize(chat_prompt, svc.tokenizer, body.messages, limit=svc.settings.max_prompt_tokens)
    return {"prompt": prompt.text}


@router.get("/props")
async def props(svc: Services = Depends(services)) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("localheap")
    except PackageNotFoundError:
        ours = "checkout"
    defaults = LlamaRequest()
    params = defaults.params(svc.settings.default_max_tokens, None, (), svc.tokenizer)
    settings = defaults.settings(params, svc.settings.max_prompt_tokens, svc.model_id)
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": svc.settings.max_prompt_tokens,
                                            "speculative": False, "is_processing": svc.engine.in_flight > 0,
                                            "params": settings, "prompt": ""},
            "total_slots": svc.settings.max_active, "model_path": str(svc.backend.model_name),
            "model_alias": svc.model_id, "chat_template": template_source(svc.tokenizer), "chat_template_caps": {},
            "modalities": {"vision": False, "audio": False}, "build_info": f"localheap {ours}", "is_sleeping": False,
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "localheap": {"backend": svc.backend.name, "heap": svc.settings.heap.to_dict()}}


@router.get("/slots")
async def slots(request: Request, fail_on_no_slot: Optional[str] = None, svc: Services = Depends(services)) -> list:
    """llama-server's slots: the engine's max_active runs at once, each slot with the run on it (or
    the last one it held): is_processing, prompt and reply counts, sampling settings; a session id
    only to its owner, and another API key's request (its settings, stops, seed, counts) not at all: that
    slot shows only whether it runs. `fail_on_no_slot` (any value): a 503 while every slot runs (a
    balancer's probe)."""
    view = await asyncio.wrap_future(svc.engine.call(svc.engine.slots.view))
    if fail_on_no_slot and not any(not s["is_processing"] for s in view):
        raise NoSlotFree("no slot available")
    who = owner(request)
    out = []
    for s in view:
        mine = s.pop("owner", None) == who
        session_id = s.pop("session_id", None)
        if not mine:   # (without keys every request is the one user's: mine)
            s = {"id": s["id"], "is_processing": s["is_processing"]}
        out.append({**s, "n_ctx": svc.settings.max_prompt_tokens, "speculative": False,
                    **({"localheap": {"session_id": session_id}} if mine and session_id else {})})
    return out


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, request: Request, action: Optional[str] = None,
                      svc: Services = Depends(services)) -> dict:
    """llama-server's slot save, restore and erase (serve --slot-save-path DIR; without it a 501, as
    llama-server answers). save: the session the slot last ran, as one file in DIR; restore: that
    file read back as a new session of the caller's, which the next prompt extending its tokens
    continues; erase: the slot's session deleted. A busy slot is waited for (--admission-timeout)."""
    root = svc.settings.slot_save_path
    if root is None:
        raise NotSupported("This server does not support slots action. Start it with `--slot-save-path` "
                           "(sessions here are also saved after every turn: /v1/sessions checkpoints, "
                           "restores and deletes them)")
    try:
        slot = int(id_slot)
    except ValueError:
        raise BadRequest("Invalid slot ID", "id_slot") from None
    if action not in ("save", "restore", "erase"):
        raise BadRequest("Invalid action: save, restore or erase", "action")
    try:
        svc.engine.slots.check(slot)   # (a fixed list: read here, before any file work)
    except InvalidSlot as e:
        raise BadRequest(str(e), "id_slot") from None
    body = await read_json(request, SlotFileBody) if action != "erase" else None
    who = owner(request)
    began = time.perf_counter()
    try:
        if action == "erase":
            n = await _on_idle_slot(svc, lambda: slotstate.erase(svc.engine, slot, who))
            return {"id_slot": slot, "n_erased": n}
        filename = slotfiles.check_name(body.filename)
        if action == "save":
            n, staged = await _on_idle_slot(svc, lambda: slotstate.stage_save(svc.engine, slot, who))
            try:
                size = await asyncio.to_thread(slotfiles.write, root, filename, staged, n, svc.store.model_id,
                                               svc.backend.name, who)
            except OSError as e:
                raise SlotFileUnwritable(f"cannot write slot file {filename!r} in {root}: {e.strerror or e} "
                                         f"(a file of that name is as it was)") from e
            finally:
                slotstate.unstage(staged)
            return {"id_slot": slot, "filename": filename, "n_saved": n, "n_written": size,
                    "timings": {"save_ms": (time.perf_counter() - began) * 1000}}
        into = slotstate.restore_target(svc.engine)
        try:
            meta, size, heap, tokens = await asyncio.to_thread(
                slotfiles.read, root, filename, into, svc.store.model_id, svc.backend.name,
                getattr(svc.backend, "vocab_size", None), who)
            extra = {}
            if heap is None:   # an empty slot's file: the slot lets go of what it held, as llama-server's empties
                await _on_idle_slot(svc, lambda: slotstate.let_go(svc.engine, slot))
            else:
                session = await _on_idle_slot(svc, lambda: slotstate.restore(svc.engine, slot, who, heap, tokens,
                                                                             f"slot file {filename}"))
                extra = {"localheap": {"session_id": session.id}}
        finally:   # (a restore moved its files out; one still to run, its caller gone, then finds none and fails)
            await asyncio.to_thread(shutil.rmtree, into, True)
        return {"id_slot": slot, "filename": filename, "n_restored": meta.tokens, "n_read": size,
                "timings": {"restore_ms": (time.perf_counter() - began) * 1000}, **extra}
    except slotfiles.SlotFileError as e:
        raise BadRequest(str(e), "filename") from e


class SlotFileBody(BaseModel):
    """The body of a slot save or restore: the file's name inside --slot-save-path."""
    model_config = ConfigDict(extra="ignore")
    filename: Optional[str] = None


async def _on_idle_slot(svc: Services, fn):
    """fn() on the engine thread once the slot is idle (llama-server defers a slot task while its
    slot runs); a 503 when it stays busy past --admission-timeout."""
    deadline = time.monotonic() + svc.settings.admission_timeout
    while True:
        try:
            return await asyncio.wrap_future(svc.engine.call(fn))
        except slotstate.SlotBusy as e:
            if time.monotonic() >= deadline:
                raise NoSlotFree(f"{e}: it ran past --admission-timeout ({svc.settings.admission_timeout:g} s)") \
                    from None
            await asyncio.sleep(0.05)


def _constraint(svc: Services, body: LlamaRequest):
    """grammar (GBNF, or llguidance's Lark) or json_schema ({}: any JSON object); a test's forced tokens."""
    if body.grammar and body.json_schema is not None:
        raise BadRequest("send grammar or json_schema, not both", "grammar")
    if svc.force_tokens is not None:
        return svc.force_tokens()
    try:
        if body.grammar:
            import llguidance

            try:
                text = llguidance.grammar_from("gbnf", body.grammar)
            except Exception as e:   # the converter raises on text it cannot read
                raise GrammarError(f"the grammar cannot be read: {e}") from e
            error = llguidance.LLMatcher.validate_grammar(text)
            if error:
                raise GrammarError(f"the grammar cannot be enforced: {error}")
        elif body.json_schema is not None:
            text = json_grammar(body.json_schema or None)
        else:
            return None
        return Grammar(svc.tokenizer, svc.backend.eos_token_ids, text)
    except GrammarError as e:
        raise BadRequest(str(e), "grammar" if body.grammar else "json_schema") from e


@dataclass
class Slot:
    """One prompt's run and what its reply has been so far."""
    index: int
    job: Job
    events: JobEvents
    session_id: str
    prompt_tokens: int
    cached: int
    began: float
    cut: Cut
    first_at: Optional[float] = None
    content: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    probs: list[dict] = field(default_factory=list)
    cut_short: bool = False   # n_indent or t_max_predict_ms ended it
    done: Optional[Finished] = None
    slot: int = -1            # the engine's slot it ran on


async def _answer(request: Request, svc: Services, body: LlamaRequest, prompts: list, stop_ids,
                  scratch: bool = False) -> object:
    vocab = getattr(svc.backend, "vocab_size", None)
    default = min(svc.settings.default_max_tokens, svc.settings.max_tokens_limit)
    n = body.completions(len(prompts))
    slot = check_slot(svc, body.id_slot)
    slots: list[Slot] = []
    try:
        for k, prompt in enumerate(prompts):
            for j in range(n):   # n_cmpl: prompt k's j-th completion is index k * n + j, seeded seed + index
                i = k * n + j
                own = len(prompts) > 1 or not body.cache_prompt or j > 0   # a session of its own, not kept
                params = body.params(default, vocab, svc.backend.eos_token_ids, svc.tokenizer,
                                     _constraint(svc, body), stop_ids, seed_offset=i)
                began = time.monotonic()
                title = prompt.text if i == 0 else None
                job, events, started = await start(svc, request, prompt, params, None, title, own,
                                                   scratch and not own, body.n_cache_reuse,
                                                   slot=slot, limit_param="n_predict")
                slots.append(Slot(i, job, events, started.session_id, started.prompt_tokens, started.cached_tokens,
                                  began, Cut(body.n_indent, body.t_max_predict_ms), slot=started.slot))
    except BaseException:
        for s in slots:
            s.job.cancel()
        raise
    return await _reply(request, svc, body, slots, params)


async def _reply(request: Request, svc: Services, body: LlamaRequest, slots: list["Slot"], params) -> object:
    settings = body.settings(params, svc.settings.max_prompt_tokens, svc.model_id)
    reply = Reply(svc, body, settings)
    headers = {SESSION_HEADER: slots[0].session_id}
    if body.stream:
        return EventSourceResponse(reply.stream(request, slots), headers=headers, sep="\n")
    try:
        finals = await asyncio.gather(*(reply.whole(request, s) for s in slots))
    finally:
        for s in slots:
            s.job.cancel()
    return JSONResponse(finals[0] if len(finals) == 1 else finals, headers=headers)


class Reply:
    """A slot's events as llama-server's reply: stream pieces, and the final object."""

    def __init__(self, svc: Services, body: LlamaRequest, settings: dict):
        self.svc, self.body, self.settings = svc, body, settings

    async def events(self, s: Slot) -> AsyncIterator[tuple[bool, dict]]:
        """(last?, object): the slot's pieces ({"content", "tokens", ...}) as they come, then its final object."""
        if self.body.return_progress and self.body.stream:   # (llama-server's first piece: 0 read so far)
            yield False, self.progress_piece(s, Progress(0, 1))
        async for event in follow(s.job, s.events):
            if isinstance(event, Progress) and self.body.return_progress and self.body.stream:
                yield False, self.progress_piece(s, event)
            elif isinstance(event, Delta) and not s.cut_short:
                now = time.monotonic()
                s.first_at = s.first_at or now
                text, ended = s.cut.feed(event.text, (now - s.first_at) * 1e3)
                ids = list(event.ids or [])
                s.content.append(text)
                s.ids += ids
                probs = probabilities(self.svc.token_text, event.logprobs, self.body.post_sampling_probs) \
                    if self.body.n_probs else []
                s.probs += probs
                if ended:
                    s.cut_short = True
                    s.job.cancel()   # the engine ends it at its next step; the session keeps what it fed
                if text or ids:
                    piece = {"index": s.index, "content": text, "tokens": ids, "stop": False, "id_slot": s.slot,
                             "tokens_predicted": event.tokens, "tokens_evaluated": s.prompt_tokens}
                    if probs:
                        piece["completion_probabilities"] = probs
                    yield False, piece
            elif isinstance(event, Finished):
                s.done = event
                yield True, self.final(s)
                return

    def progress_piece(self, s: Slot, event: Progress) -> dict:
        return {"index": s.index, "content": "", "tokens": [], "stop": False, "id_slot": s.slot, "tokens_predicted": 0,
                "tokens_evaluated": s.prompt_tokens,
                "prompt_progress": prompt_progress(s.prompt_tokens, s.cached, event.done, event.total, s.began,
                                                   time.monotonic())}

    def final(self, s: Slot) -> dict:
        done, end = s.done, time.monotonic()
        first = s.first_at or end
        predicted = done.usage.completion_tokens
        content = "".join(s.content)
        out = {"index": s.index, "content": content if not self.body.stream else "",
               "tokens": s.ids if self.body.return_tokens and not self.body.stream else [], "id_slot": s.slot,
               "stop": True, "model": self.svc.model_id, "tokens_predicted": predicted,
               "tokens_evaluated": s.prompt_tokens, "generation_settings": self.settings,
               "has_new_line": "\n" in content, "truncated": False,
               "stop_type": stop_type(done.finish_reason, done.stop_word, s.cut_short),
               "stopping_word": done.stop_word or "", "tokens_cached": s.cached,
               "timings": timings(s.prompt_tokens - s.cached, first - s.began, predicted, end - first)}
        if self.body.n_probs and not self.body.stream:
            out["completion_probabilities"] = s.probs
        out = pick_fields(out, self.body.response_fields)
        out["localheap"] = {"session_id": done.session_id, "heap": done.session.get("heap"), **save_fields(done),
                            **({"ignored_options": self.body.ignored} if self.body.ignored else {})}
        return out

    async def whole(self, request: Request, s: Slot) -> dict:
        watcher = asyncio.create_task(watch_disconnect(request, s.job))
        try:
            async for last, piece in self.events(s):
                if last:
                    return piece
        finally:
            watcher.cancel()
        raise RuntimeError("the run ended without its final event")

    async def stream(self, request: Request, slots: list[Slot]) -> AsyncIterator[dict]:
        try:
            async with aclosing(merged([self.events(s) for s in slots])) as pieces:
                async for _, (_, piece) in pieces:
                    yield {"data": json.dumps(piece, separators=(",", ":"))}
        except Exception as e:   # the status is gone: an error event, as llama-server sends one
            yield {"data": to_response(e).body.decode()}
