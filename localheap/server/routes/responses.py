"""OpenAI's Responses API: POST /v1/responses, whole or streamed with its typed events. The same
sessions, heap, recall and prefix reuse as the chat route: the conversation is rendered by the
same chat template into the same prompt."""

from __future__ import annotations

import asyncio
import json
from array import array
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, Optional

from fastapi import Depends, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ...engine import Delta, Finished, Job
from ...generation import LogprobRecorder, SamplingParams, TokenLogprob
from ...sessions import Prompt
from ..bridge import JobEvents, follow, watch_disconnect
from ..background import RUN_EVENTS, Run, sse
from ..ids import SOURCE
from ..chat import check_start, start
from ..errors import ApiError, BadRequest, Conflict, Unsupported, to_response
from ..formats import extension, saved_headers
from ..prompts import chat_prompt, tokenize
from ..logonce import warn_once
from ..conversations import cursor_page, item_finders, item_json
from ..responses import (SESSION_DELETED, STOPPED, STOPPING, Built, InputTokensRequest, MessageItem, ResponsesRequest,
                         output_item, resolve_references,
                         stalled_runs)
from ..services import Services, owner, services
from ..toolcalls import OutputParser
from . import api_router
from .openai import SESSION_HEADER, addressed_session

router = api_router()
LIMIT = "max_output_tokens"   # the reply limit, as a Responses request calls it (check_start's errors)
log = logging.getLogger("localheap.server")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, svc: Services = Depends(services),
                          x_session_id: Optional[str] = Depends(addressed_session)):
    who = owner(request)
    p = await _planned(svc, body, who)
    if body.background:
        check_start(svc, who, p.params, x_session_id, limit_param=LIMIT)   # refused now, not as a failed response later
        run = _launch(svc, p, who, x_session_id, runs=1)
        if body.stream:
            return EventSourceResponse(run.read(), sep="\n")
        return JSONResponse(run.snapshot())
    built, parser, keep, token_text = p.built, p.parser, p.keep, p.token_text
    job, events, started = await start(svc, request, p.prompt, p.params, x_session_id, p.title, limit_param=LIMIT)
    headers = {SESSION_HEADER: started.session_id}
    if not body.stream:
        watcher = asyncio.create_task(watch_disconnect(request, job))   # the client gone: the job stops
        try:
            async for event in follow(job, events):
                if isinstance(event, Delta):
                    built.read(parser, event.text, event.logprobs, token_text)
                elif isinstance(event, Finished):
                    built.read(parser, None, None, token_text)
                    whole, _ = built.finish(event, extension(event))
                    keep(whole)
                    return JSONResponse(whole, headers={**headers, **saved_headers(event)})
        finally:
            watcher.cancel()
        raise RuntimeError("job ended without a Finished event")
    return EventSourceResponse(_stream(built, parser, job, events, started.session_id, keep, token_text),
                               headers=headers, sep="\n")


@dataclass
class _Planned:
    """A response request made ready to run: its prompt, sampling, parser and what keeps it."""
    body: ResponsesRequest
    built: Built
    prompt: Prompt
    params: SamplingParams
    parser: OutputParser
    keep: Callable[..., None]
    token_text: Any
    title: Optional[str]
    begun: int = 0   # the prompt ends with this many tokens of the reply begun by an earlier run (_replay)
    resume: Optional[dict] = None   # a background response's: what runs it again (_launch)


def _built(svc: Services, body: ResponsesRequest) -> Built:
    return Built(body, svc.model_id, lambda text: len(svc.tokenizer.encode(text, add_special_tokens=False)))


async def _planned(svc: Services, body: ResponsesRequest, who: Optional[str]) -> _Planned:
    plan, opts, messages, prompt = await _prompt(svc, body, who)
    default = min(svc.settings.default_max_tokens, svc.settings.max_tokens_limit)
    top = body.logprobs
    params = SamplingParams(max_tokens=body.max_output_tokens or default, temperature=body.temperature,
                            top_p=body.top_p, constraint=plan.constraint(svc, opts, prompt),
                            logprobs=None if top is None else LogprobRecorder(top))
    built = _built(svc, body)
    return _Planned(body, built, prompt, params, plan.parser(opts, prompt), _keeper(svc, body, who),
                    svc.token_text if top is not None else None,
                    next((m.text() for m in messages if m.role == "user"), None))


def _launch(svc: Services, p: _Planned, who: Optional[str], session_id: Optional[str], runs: int,
            run: Optional[Run] = None, stalled: int = 1) -> Run:
    """A background response queued: kept queued with its request (a server stopped before it ends
    runs it again at its restart), its reply run on a task of its own. `run`: the earlier runs'
    events kept, its reply read again (_replay). `stalled`: the runs in a row, this one included,
    that kept no reply token (responses.stalled_runs: kept 0 once this one keeps one)."""
    p.built.sequence = (runs - 1) * RUN_EVENTS   # (a reader of an earlier run's events not kept can be told)
    fresh = run is None
    if fresh:
        run = Run(p.built, who)
    svc.backgrounds.add(run)   # (before its first events: their syncs are told to the runs it holds)
    if fresh:
        _push(svc, run, [p.built.event("response.created", response=p.built.response("queued")),
                         p.built.event("response.queued", response=p.built.response("queued"))])
    run.first = p.built.sequence
    p.resume = {"request": p.body.model_dump(mode="json", by_alias=True, exclude_unset=True),
                "session_id": session_id, "runs": runs, "stalled": stalled}
    p.keep(run.snapshot(), p.resume)
    run.task = asyncio.create_task(_background(svc, who, run, p, session_id))
    return run


def resumable_backgrounds(svc: Services) -> list:
    """At start, before any request: the background responses to run on (ResponseLog.resumable),
    the progress files of any other deleted (left by one that ended as the server stopped)."""
    resumable = svc.responses.resumable()
    if svc.backgrounds.progress is not None:
        svc.backgrounds.progress.stale({rid for rid, _ in resumable})
    return resumable


async def resume_backgrounds(svc: Services, resumable: list) -> None:
    """At start: the background responses a server stopped in (queued or running) run on under the
    same id, each its request as it was sent: its events kept are sent again as they were, and
    its reply goes on from the last piece kept (_replay; events numbered on from RUN_EVENTS times
    the runs before), or, where none was kept or what was kept does not read again, from its
    start. One that cannot run (its X-Session-Id or the response it continues gone) ends failed.
    `resumable`: resumable_backgrounds'."""
    progress = svc.backgrounds.progress
    for rid, kept in resumable:
        resume = kept.resume
        runs = resume["runs"] + 1
        stalled = stalled_runs(resume) + 1   # (this run too, until it keeps a token)
        records = progress.read(rid) if progress is not None else []

        async def planned() -> _Planned:
            p = await _planned(svc, body, kept.owner)
            p.built.id, p.built.created = rid, kept.body.get("created_at", p.built.created)
            return p

        try:
            body = ResponsesRequest.model_validate(resume["request"])
            first = kept.input_items[0] if kept.input_items else None
            if isinstance(body.input, str) and isinstance(first, MessageItem):   # its input keeps the id it was
                body._message = first                                            # listed by before the restart
            if records and "end" in records[-1]:
                _ended_before(svc, rid, kept, body, records)
                continue
            p = await planned()
            check_start(svc, kept.owner, p.params, resume["session_id"], limit_param=LIMIT)
        except Exception as e:   # noqa: BLE001 - what a request would be refused for, as its failure
            err = json.loads(to_response(e).body)["error"]
            svc.responses.fail(rid, {"code": err["code"] or err["type"], "message": err["message"]})
            if progress is not None:
                progress.drop(rid)
            log.warning("background response %s was not run again after the restart: %s", rid, err["message"])
            continue
        run = _replay(p, kept.owner, records) if records else None
        if records and run is None:
            progress.reset(rid)
            p = await planned()
        _launch(svc, p, kept.owner, resume["session_id"], runs=runs, run=run, stalled=stalled)
        how = "from its start" if run is None else f"after the {p.begun} reply tokens kept ({len(run.events)} events)"
        log.info("background response %s runs on after the restart (run %d) %s", rid, runs, how)


def _ended_before(svc: Services, rid: str, kept, body: ResponsesRequest, records: list[dict]) -> None:
    """A background response whose end reached its progress file but not the kept responses (a
    crash in between): its end kept now, its events readable again as those of a run ended."""
    whole = records[-1]["end"]
    built = _built(svc, body)
    built.id, built.created = rid, whole.get("created_at", built.created)
    run = Run(built, kept.owner)
    for r in records:
        run.push(r.get("e", []))
    run.first = run.numbers[-1] + 1 if run.numbers else 0   # (all it sent was kept)
    run.end(whole, [])
    svc.backgrounds.add(run)
    svc.backgrounds.ended(run)
    _keeper(svc, body, kept.owner)(whole)
    svc.backgrounds.progress.drop(rid)
    log.info("background response %s had ended (%s) as the server stopped: its end is kept now", rid,
             whole.get("status"))


def _replay(p: _Planned, who: Optional[str], records: list[dict]) -> Optional[Run]:
    """The run of a response an earlier run began, from what that kept (background.Progress): its
    events as they were sent, its reply's pieces read again into p.built and p.parser (which must
    give those events again, ids and all: ids.SOURCE seeded as then), and p made to go on from
    them (the reply's ids after the prompt, max_output_tokens less them, the constraint past
    them). None where they do not read again (p is then spent)."""
    run = Run(p.built, who)
    built, reply = p.built, []
    source = SOURCE.set(run.ids)
    try:
        for r in records:
            events = r.get("e", [])
            if "x" in r:
                run.extra = dict(r["x"])
            if "d" in r:
                text, ids, entries = r["d"]
                if events:
                    built.sequence = events[0]["sequence_number"]
                logprobs = None if entries is None else [TokenLogprob(t, lp, [tuple(x) for x in top])
                                                         for t, lp, top in entries]
                again = json.loads(json.dumps(built.read(p.parser, text, logprobs, p.token_text)))
                if again != events:
                    log.warning("background response %s: its kept reply does not read again as it was sent "
                                "(event %s): it runs again from its start", built.id,
                                events[0]["sequence_number"] if events else built.sequence)
                    return None
                reply += [int(t) for t in ids]
            elif events:
                built.sequence = events[-1]["sequence_number"] + 1
            run.push(events)
        constraint = p.params.constraint
        for token in reply if constraint is not None else ():
            constraint.advance(token)
        refused = getattr(constraint, "error", None) or getattr(constraint, "broken", None)
        if refused:   # (its grammar did not take the reply: a guess at where it stands would be worse)
            log.warning("background response %s: its grammar does not take its kept reply again (%s): it runs "
                        "again from its start", built.id, refused)
            return None
    except Exception:   # noqa: BLE001 - a record that does not read: from the start rather than not at all
        log.exception("background response %s: what was kept of it does not read again: it runs again from "
                      "its start", built.id)
        return None
    finally:
        SOURCE.reset(source)
    if reply:
        def then(pair):
            return tuple(None if ids is None else _then(ids, reply) for ids in pair)

        anew = p.prompt.tools_anew
        p.prompt = Prompt(_then(p.prompt.tokens, reply), None, *then((p.prompt.continuation, p.prompt.after_reply)),
                          tools_ids=p.prompt.tools_ids, tools_anew=None if anew is None else then(anew))
        p.params.max_tokens = max(0, p.params.max_tokens - len(reply))
        p.begun = len(reply)
    return run


def _then(tokens, more: list[int]):
    """`tokens` (a list, or an int32 array: a long prompt's) followed by `more`, as the same kind."""
    if isinstance(tokens, array):
        out = array("i", tokens)
        out.extend(more)
        return out
    return list(tokens) + more


def _push(svc: Services, run: Run, events: list[dict], status: Optional[str] = None, **record) -> None:
    """Events of a background run kept (its progress file: what a restart goes on from), with what
    else `record` holds (the Delta they came of: `d`), then sent to its readers once on the disk:
    none sees an event a crash loses."""
    progress = svc.backgrounds.progress
    written = progress is not None and progress.add(run.id, {"e": events, **record}, len(run.events) + len(events))
    run.push(events, status, synced=not written)


async def _prompt(svc: Services, body: ResponsesRequest, who: Optional[str]) -> tuple:
    """(plan, chat options, messages, prompt) of a request: what it refuses, refused; its input after
    the items of the response it continues or of the conversation it names, rendered as chat."""
    svc.check_model(body.model)
    if not isinstance(body.input, str):   # each item_reference, the item it names
        body.input = resolve_references(body.input, item_finders(svc, who), "input")
    bad = body.unsupported()
    if bad is not None:
        raise Unsupported(bad[1], bad[0])
    warn_once("hosted tools this server cannot run, left out of the prompt: %s", sorted(body.hosted_tools))
    plan = body.plan()
    opts = plan.options(svc)
    before = svc.responses.conversation(body.previous_response_id, who) if body.previous_response_id else \
        svc.conversations.inputs(body.conversation_id, who) if body.conversation_id else []
    messages = body.chat_messages(before)
    prompt = await tokenize(chat_prompt, svc.tokenizer, messages, limit=svc.settings.max_prompt_tokens, opts=opts)
    return plan, opts, messages, prompt


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: InputTokensRequest, request: Request, svc: Services = Depends(services)) -> dict:
    """The tokens of the prompt a response to `body` would read (its whole conversation rendered),
    before any is reused from a session."""
    _, _, _, prompt = await _prompt(svc, body, owner(request))
    return {"object": "response.input_tokens", "input_tokens": len(prompt.tokens)}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: Optional[str] = None,
                           limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                           svc: Services = Depends(services)) -> dict:
    """A page of the items a kept response was asked with (its continued chain's are its own)."""
    kept = svc.responses.get(response_id, owner(request))
    return cursor_page([item_json(i) for i in kept.input_items], after, limit, order, f"response {response_id!r}")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False, starting_after: int = -1,
                       svc: Services = Depends(services)):
    """A kept response (a background one as it stands: its output so far while it runs); with
    `stream`, a background response's events after `starting_after`, then each as it comes."""
    who = owner(request)
    run = svc.backgrounds.get(response_id, who)
    if stream:
        if run is None:
            kept = svc.responses.get(response_id, who)   # (404 where none is kept)
            why = "ended a while ago: its events are no longer kept (GET it without stream)" \
                if kept.body.get("background") else "was not a background response: only those stream again"
            raise BadRequest(f"response {response_id!r} {why}", "stream")
        if run.lost(starting_after):
            raise Conflict(f"response {response_id!r} runs on since a server restart from what was kept of it: "
                           f"event {starting_after} was an earlier run's and was not kept (the events after it "
                           f"are not the ones sent then; this run's are numbered from {run.first}); read it "
                           f"again from its start, without starting_after", "starting_after", "response_restarted")
        return EventSourceResponse(run.read(starting_after), sep="\n")
    if run is not None:
        return run.snapshot()
    return svc.responses.get(response_id, who).body


CANCEL_WAIT_S = 30.0   # a cancel waits this long for the engine to end the run (its next step)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, who: Optional[str] = Depends(owner),
                          svc: Services = Depends(services)) -> dict:
    """Stop a background response that is queued or running: it ends "cancelled", with the output
    it had (its session keeps the tokens generated, as for a client gone). One already cancelled
    comes back as it is; any other that ended, or a response not run in the background, is a 400."""
    run = svc.backgrounds.get(response_id, who)
    if run is not None and not run.ended:
        run.cancel()
        await run.wait_end(CANCEL_WAIT_S)
        return run.snapshot()
    body = run.snapshot() if run is not None else svc.responses.get(response_id, who).body
    if not body.get("background"):
        raise BadRequest(f"response {response_id!r} was not run in the background: only background responses "
                         f"can be cancelled", "response_id")
    if body["status"] != "cancelled":
        raise BadRequest(f"response {response_id!r} has ended ({body['status']}): it cannot be cancelled",
                         "response_id")
    return body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, who: Optional[str] = Depends(owner),
                          svc: Services = Depends(services)) -> dict:
    """Forget a kept response (its conversation's session stays: DELETE /v1/sessions/{id} for that)."""
    svc.responses.delete(response_id, who)
    return {"id": response_id, "object": "response", "deleted": True}


async def _stream(built: Built, parser: OutputParser, job: Job, events: JobEvents, session_id: str,
                  keep: Callable[[dict], None], token_text=None) -> AsyncIterator[dict]:
    """response.created and .in_progress; per output item: added, its content part, its text or
    arguments in deltas, done; then response.completed (or .incomplete: max_output_tokens)."""
    yield sse(built.event("response.created", response={**built.response("in_progress"),
                                                         "localheap": {"session_id": session_id}}))
    yield sse(built.event("response.in_progress", response=built.response("in_progress")))
    first_token_at: Optional[float] = None
    try:
        async for event in follow(job, events):
            if isinstance(event, Delta):
                first_token_at = first_token_at or time.monotonic()
                for e in built.read(parser, event.text, event.logprobs, token_text):
                    yield sse(e)
            elif isinstance(event, Finished):
                for e in built.read(parser, None, None, token_text):
                    yield sse(e)
                decode_s = time.monotonic() - first_token_at if first_token_at is not None else None
                whole, ending = built.finish(event, extension(event, decode_s))
                keep(whole)
                for e in ending:
                    yield sse(e)
    except Exception as e:   # headers are gone: an error event, as OpenAI sends one
        err = json.loads(to_response(e).body)["error"]
        yield sse(built.event("error", code=err["code"], message=err["message"], param=err["param"]))


def _keeper(svc: Services, body: ResponsesRequest, who: Optional[str]) -> Callable[..., None]:
    """What is kept of a response as it stands (a background one is kept queued too, with what runs
    it again: `resume`): the response (unless `store: false`, which Codex sends every turn: that
    keeps the session all the same, the conversation's prompt cache); once it has completed (or
    incomplete), its input and output added to the conversation it names."""
    def keep(whole: dict, resume: Optional[dict] = None) -> None:
        if body.store is not False:
            svc.responses.add(whole, body, who, resume)
        if body.conversation_id and whole["status"] in ("completed", "incomplete"):
            try:
                svc.conversations.add_items(body.conversation_id,
                                            body.input_items + [output_item(i) for i in whole["output"]], who)
            except ApiError as e:   # deleted while the response ran: the reply still goes out
                log.warning("response %s: its conversation was not extended: %s", whole["id"], e)

    return keep


async def _background(svc: Services, who: Optional[str], run: Run, p: _Planned, session_id: Optional[str]) -> None:
    """A background response's reply, with nobody waiting on it: its events into the run, its
    end kept (completed or incomplete as any response; cancelled; failed, with the error). The
    server stopping under it ends it failed here, and keeps nothing: what is kept is the response
    queued, which runs again at the restart."""
    built, parser, keep, token_text = run.built, p.parser, p.keep, p.token_text
    SOURCE.set(run.ids)   # (this task's context: its items' ids are the ones a restart reads again)
    begun_before = any(m["event"] == "response.in_progress" for m in run.events)   # (an earlier run's)
    try:
        try:
            job, events, started = await start(svc, None, p.prompt, p.params, session_id, p.title, who=who,
                                               reply_begun=p.begun, limit_param=LIMIT)
        except asyncio.CancelledError:
            if not run.cancel_asked:   # the server is stopping
                raise
            _ended(svc, run, keep, *built.stop("cancelled"))
            return
        run.job = job
        if run.cancel_asked:
            job.cancel()
        run.extra = {"session_id": started.session_id}
        run.status = "in_progress"
        if begun_before:
            _push(svc, run, [], x=run.extra)
        else:
            _push(svc, run, [built.event("response.in_progress", response=run.snapshot())], x=run.extra)
        first_token_at: Optional[float] = None
        async for event in follow(job, events):
            if isinstance(event, Delta):
                first_token_at = first_token_at or time.monotonic()
                entries = None if event.logprobs is None else [[e.token, e.logprob, [list(x) for x in e.top]]
                                                               for e in event.logprobs]
                _push(svc, run, built.read(parser, event.text, event.logprobs, token_text),
                      d=[event.text, list(event.ids or []), entries])
                if p.resume["stalled"] and event.ids:   # (this run goes on: the count of runs stopped in begins again)
                    p.resume = {**p.resume, "stalled": 0}
                    source = SOURCE.set(None)   # (what it kept takes no id of the reply's source)
                    try:
                        keep(run.snapshot(), p.resume)
                    finally:
                        SOURCE.reset(source)
            elif isinstance(event, Finished):
                events_ = built.read(parser, None, None, token_text)
                decode_s = time.monotonic() - first_token_at if first_token_at is not None else None
                ext = extension(event, decode_s)
                if event.finish_reason == "cancelled" and (run.cancel_asked or event.interrupted == "stopped"):
                    whole, ending = built.stop("cancelled", done=event, extension=ext)
                elif event.finish_reason == "cancelled" and event.interrupted == "deleted":
                    whole, ending = built.stop("failed", SESSION_DELETED, event, ext)
                elif event.finish_reason == "cancelled":   # the server stopping (SIGTERM): it runs again at the restart
                    kept = svc.responses.path is not None   # (in memory: nothing runs it again)
                    whole, ending = built.stop("failed", STOPPING if kept else STOPPED, event, ext)
                    _ended(svc, run, None, whole, events_ + ending)
                    return
                else:
                    whole, ending = built.finish(event, ext)
                _ended(svc, run, keep, whole, events_ + ending)
    except asyncio.CancelledError:
        raise
    except Exception as e:   # refused by the engine (over the budget, the queue full), or failed in it
        err = json.loads(to_response(e).body)["error"]
        _ended(svc, run, keep, *built.stop("failed", {"code": err["code"] or err["type"], "message": err["message"]}))


def _ended(svc: Services, run: Run, keep: Optional[Callable[..., None]], whole: dict, events: list[dict]) -> None:
    """The run ended with `whole`; kept unless `keep` is None (the server stopping)."""
    if run.extra and "localheap" not in whole:
        whole["localheap"] = dict(run.extra)
    written = keep is not None and svc.backgrounds.progress is not None and \
        svc.backgrounds.progress.add(run.id, {"e": events, "end": whole}, len(run.events) + len(events))
    run.end(whole, events, synced=not written)   # (a reader sees the end once it is on the disk)
    svc.backgrounds.ended(run)
    if keep is None:   # (its progress stays: the restart goes on from it)
        return
    try:
        keep(whole)
    except Exception:   # (in memory, GET still has it from the run while it is among the latest)
        log.exception("background response %s: its end was not kept", whole["id"])
    if svc.backgrounds.progress is not None:   # (after its end, on the same writer)
        svc.backgrounds.progress.drop(whole["id"])
