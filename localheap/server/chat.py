"""What the OpenAI and Anthropic chat routes share: a request's tools, template arguments and
constraint; starting its job on a session; reading its reply as content, reasoning and tool calls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request

from ..engine import Generate, Job, Started
from ..generation import SamplingParams
from ..grammar import Grammar, GrammarError, json_grammar, json_rule
from ..sessions import Prompt
from .bridge import JobEvents, submit
from .errors import BadRequest
from .prompts import ChatOptions
from .services import Services, owner
from .toolcalls import THINK, OutputParser
from .toolformats import Hermes, Llama, Mistral, ToolFormat, tool_format


@dataclass
class ChatPlan:
    """A chat request in the terms both APIs share. tools: OpenAI's shape. choice: "auto",
    "none", "required" or a function's name. json_schema: {} for any JSON object."""
    tools: Optional[list[dict]] = None
    choice: str = "auto"
    parallel: bool = True
    json_schema: Optional[dict] = None
    template_kwargs: Optional[dict] = None

    def options(self, svc: Services) -> ChatOptions:
        """The format is known even without tools: a history may hold calls and results to render."""
        fmt = tool_format(svc.tokenizer, svc.settings.tool_format)
        return ChatOptions(self.tools or None, fmt, dict(self.template_kwargs or {}))

    def parser(self, opts: ChatOptions, prompt: Prompt) -> OutputParser:
        """Tool calls are looked for when there are tools and tool_choice is not none; reasoning
        always (only a reply that opens with <think>, or a prompt that ends inside one, has any).
        A forced choice (the grammar's calls) has no content."""
        in_think = prompt.text is not None and prompt.text.rstrip().endswith(THINK)
        fmt = opts.fmt if self.tools and self.choice != "none" else None
        return OutputParser(fmt, reasoning=True, in_think=in_think, forced=self.forced)

    @property
    def forced(self) -> bool:
        """Whether the reply is held to tool calls by the grammar (tool_choice required or a name)."""
        return bool(self.tools) and self.choice not in ("auto", "none")

    def constraint(self, svc: Services, opts: ChatOptions) -> Any:
        """The request's grammar: the JSON it must answer with, or the call it must make; a test's
        forced tokens where the server has that hook."""
        if svc.force_tokens is not None:
            return svc.force_tokens()
        if self.json_schema is not None:
            grammar = json_grammar(self.json_schema or None)
        elif self.forced:
            grammar = call_grammar(opts.fmt, self.tools, self.choice, self.parallel, svc.tokenizer)
        else:
            return None
        try:
            return Grammar(svc.tokenizer, svc.backend.eos_token_ids, grammar)
        except GrammarError as e:
            raise BadRequest(str(e), "response_format" if self.json_schema is not None else "tool_choice") from e


def call_grammar(fmt: ToolFormat, tools: list[dict], choice: str, parallel: bool, tokenizer: Any) -> str:
    """A Lark grammar (llguidance's dialect) for tool calls in the family's own syntax: one call of
    the named function, or one or more (`parallel`) of any of the tools for "required"."""
    chosen = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
    args_key = "parameters" if isinstance(fmt, Llama) else "arguments"
    schemas = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
                "properties": {"name": {"const": t["function"]["name"]},
                               args_key: t["function"].get("parameters") or {"type": "object"}}}
               for t in chosen]
    call = json_rule(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    many = parallel and choice == "required"
    if isinstance(fmt, Mistral):
        more = ' ("," " " call)*' if many else ""
        return f'start: {_token_ref(tokenizer, "[TOOL_CALLS]")} "[" call{more} "]"\ncall: {call}\n'
    if isinstance(fmt, Llama):
        more = ' ("; " call)*' if many else ""
        return f"start: call{more}\ncall: {call}\n"
    assert isinstance(fmt, Hermes)
    more = ' ("\\n" block)*' if many else ""
    return f'start: block{more}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}\n'


def _token_ref(tokenizer: Any, text: str) -> str:
    """A special token in a grammar: by id where the tokenizer has it as one token, else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


async def start(svc: Services, request: Request, prompt: Prompt, params: SamplingParams,
                session_id: Optional[str], title: Optional[str],
                ephemeral: bool = False, scratch: bool = False) -> tuple[Job, JobEvents, Started]:
    """Queue a generation on the session the prompt extends (or `session_id`); returns once admitted.
    `ephemeral`: a session of its own, never matched or saved, deleted when the reply ends.
    `scratch`: an editor's completion (engine.Generate.scratch)."""
    who = owner(request)
    if session_id is not None:
        if ephemeral:
            raise BadRequest(f"\"store\": false runs in a session of its own that is not kept; it cannot continue "
                             f"session {session_id!r} (drop X-Session-Id or \"store\": false)", "store")
        svc.store.info(session_id, who)   # unknown id, or another key's: 404 before queueing
    if params.max_tokens > svc.settings.max_tokens_limit:   # one request must not hold the engine forever
        raise BadRequest(f"max_tokens {params.max_tokens} is over this server's limit of "
                         f"{svc.settings.max_tokens_limit}", "max_tokens", "max_tokens_too_large")
    job, events, started = await submit(svc.engine, lambda emit: Generate(prompt, params, emit, session_id, who,
                                                                               ephemeral=ephemeral,
                                                                               scratch=scratch))
    await svc.name_session(started.session_id, title)
    return job, events, started
