"""OpenAI's Responses API in localheap's terms: request bodies (pydantic, unknown fields refused),
their conversion to the chat messages the chat route renders (so every API shares templates,
sessions, heap, recall and prefix reuse), and the reply as output items (reasoning, message,
function_call) and the Responses stream's events.

Codex and the Agents SDK send the whole conversation in `input` each time (`store: false`): the
session the prompt extends is found and reused, as for chat. A stored response (ResponseLog, in
memory) can be continued by `previous_response_id` instead: its chain's items come first."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, TypeAdapter, ValidationError,
                      field_validator)

from ..engine import Finished
from ..generation import TOP_LOGPROBS_MAX
from ..grammar import GrammarError, grammar_error, json_grammar
from ..larkformat import LarkInput, lark_regex, lark_rules
from .chat import ChatPlan
from .formats import InputStream, custom_input
from .ids import hex_id
from .errors import ApiError, BadRequest
from .jsonlines import FileBacked, JsonLines
from .logonce import warn_once
from .logprobs import chat_content
from .prompts import with_effort
from .schemas import EFFORT_VALUES, ChatMessage, Strict, object_schema
from .toolcalls import CallArgs, CallStart, Piece, Text
from .toolformats import ToolCall

MAX_METADATA = 16   # metadata keys, as OpenAI's (a response's, a conversation's)

log = logging.getLogger("localheap.server")


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: Optional[list[Any]] = None   # (an output_text sent back)
    logprobs: Optional[list[Any]] = None


class InputMedia(BaseModel):
    """Images, files and audio: recognised, so that they are refused by name."""
    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio", "refusal"]


ContentPart = Union[InputText, InputMedia]


class _Item(Strict):
    """What every input item may carry back from the output item it was (its id and status)."""
    id: Optional[str] = None
    status: Optional[str] = None


class MessageItem(_Item):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    phase: Optional[str] = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: Optional[str] = None              # (fields an SDK's output item carries, sent back)
    caller: Optional[dict[str, Any]] = None
    async_: Optional[bool] = Field(None, alias="async")


class _CallOutput(_Item):
    call_id: str
    output: Union[str, list[ContentPart]]


class FunctionCallOutputItem(_CallOutput):
    type: Literal["function_call_output"]


class ReasoningPart(Strict):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: Optional[list[ReasoningPart]] = None
    encrypted_content: Optional[str] = None


class CustomToolCallItem(_Item):
    """A call of a custom (freeform) tool: its input is plain text, not JSON arguments."""
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: Optional[str] = None


class CustomToolCallOutputItem(_CallOutput):
    type: Literal["custom_tool_call_output"]
    name: Optional[str] = None


class ItemReference(Strict):
    """An item of a kept response, by its id (the AI SDK's OpenAI provider sends its reasoning
    items back so): replaced by the item before anything else reads the input."""
    type: Literal["item_reference"]
    id: str


class OtherItem(BaseModel):
    """Items of hosted tools (web search, file search, computer use, ...): recognised, so that
    they are refused by name."""
    model_config = ConfigDict(extra="allow")
    type: str


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, CustomToolCallItem, CustomToolCallOutputItem,
             ReasoningItem, ItemReference, OtherItem]
_ITEM = TypeAdapter(Item)
_TYPED = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
          "custom_tool_call": CustomToolCallItem, "custom_tool_call_output": CustomToolCallOutputItem,
          "reasoning": ReasoningItem, "item_reference": ItemReference}


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    _object = field_validator("parameters")(object_schema)


class CustomTool(Strict):
    """A freeform tool: the model writes its input as text. Offered to the model as a function of
    one string argument, `input`; a `format` grammar (a regex, or a Lark grammar) holds that string
    once the model calls the tool."""
    type: Literal["custom"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    format: Optional[dict[str, Any]] = None

    def input_schema(self) -> Optional[dict]:
        """The schema of the call's `{"input": ...}` where `format` is a grammar this server can hold
        it to; None (free text) for `{"type": "text"}`, no format, or a grammar it cannot (logged once:
        a client's format is a hint it sends every turn, not a reason to refuse the request)."""
        fmt = self.format or {}
        if fmt.get("type") != "grammar":
            return None
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        readable = isinstance(definition, str) and syntax in ("regex", "lark")
        schema, error = _format_schema(syntax, definition) if readable else \
            (None, "a grammar format has a `syntax` regex or lark and a `definition` string")
        if error is not None:
            warn_once("custom tools' formats not enforced (their input is free text): %s", [f"{self.name}: {error}"])
        return schema


@lru_cache(maxsize=64)
def _format_schema(syntax: str, definition: str) -> tuple[Optional[dict], Optional[str]]:
    """(the input's schema, None) for a grammar format, or (None, why not): a regex, or a Lark grammar
    spelled out as one, as the string's `pattern`; a Lark grammar that cannot be (it recurses, or has
    %ignore) as its rules (LarkInput). Remembered, since a client (Codex) sends the same tools every
    turn and spelling out and compiling one takes milliseconds."""
    try:
        regex = definition if syntax == "regex" else lark_regex(definition)
    except GrammarError:
        return _lark_schema(definition)
    try:
        schema = {**CUSTOM_PARAMETERS, "properties": {"input": {"type": "string", "pattern": f"^(?:{regex})$"}}}
        json_grammar(schema)
    except GrammarError as e:
        return None, str(e)
    return schema, None


def _lark_schema(definition: str) -> tuple[Optional[dict], Optional[str]]:
    """A Lark grammar as rules, checked as llguidance compiles them: inside a JSON string, and as
    they are (the tagged families write a string argument raw)."""
    try:
        for json_string in (True, False):
            error = grammar_error('start: "\\"" g "\\""\n' + lark_rules(definition, "g", json_string))
            if error:
                return None, "the Lark grammar cannot be enforced: " + error.splitlines()[0][:200]
    except GrammarError as e:
        return None, str(e)
    return LarkInput(CUSTOM_PARAMETERS, definition), None


class NamespaceTool(Strict):
    """Tools grouped under a name (Codex's sub-agent and MCP tools): the model sees each as
    `<namespace>.<name>`; its calls come back with `name` and `namespace` apart, as OpenAI's do."""
    type: Literal["namespace"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    tools: list[Union[FunctionTool, CustomTool]]


class HostedTool(BaseModel):
    """web_search, file_search, code_interpreter, mcp, ...: tools OpenAI runs on its side. This
    server cannot run them: they are left out of the prompt (the model is not told of them)."""
    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(t: Any) -> str:
    kind = t.get("type") if isinstance(t, dict) else getattr(t, "type", None)
    return kind if kind in ("function", "custom", "namespace") else "hosted"


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[CustomTool, Tag("custom")],
                       Annotated[NamespaceTool, Tag("namespace")], Annotated[HostedTool, Tag("hosted")]],
                 Discriminator(_tool_kind)]


@dataclass
class Offered:
    """A tool as the model sees it: `name` (namespaced tools: "<namespace>.<name>") and chat's
    function shape; `inner` and `namespace` as the client named it; `custom`: a freeform tool."""
    name: str
    inner: str
    namespace: Optional[str]
    custom: bool
    description: Optional[str]
    parameters: dict
    enforce: Optional[dict] = None   # what its arguments are held to, where not `parameters` (a custom format)

    def chat(self) -> dict:
        """(in the order chat clients write it: the same tools render the same prompt on both routes)"""
        return {"type": "function", "function": {"name": self.name,
                                                 **({"description": self.description} if self.description else {}),
                                                 "parameters": self.parameters}}


CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                     "additionalProperties": False}


def offer(t: Union[FunctionTool, CustomTool], namespace: Optional[NamespaceTool] = None) -> Offered:
    ns = namespace.name if namespace is not None else None
    description = t.description
    if namespace is not None and namespace.description:
        description = f"{namespace.description}\n\n{description}" if description else namespace.description
    custom = isinstance(t, CustomTool)
    parameters = CUSTOM_PARAMETERS if custom else t.parameters or {"type": "object"}
    return Offered(qualified(t.name, ns), t.name, ns, custom, description, parameters,
                   t.input_schema() if custom else None)


def qualified(name: str, namespace: Optional[str]) -> str:
    return f"{namespace}.{name}" if namespace else name


class NamedFunction(Strict):
    """tool_choice naming one tool: a function or a custom tool (a namespaced one with its namespace)."""
    type: Literal["function", "custom"]
    name: str
    namespace: Optional[str] = None


class HostedChoice(Strict):
    """tool_choice forcing a hosted tool ({"type": "web_search"}, "file_search", "mcp", ...): read,
    to be refused by name (this server runs none of them)."""
    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _hosted(cls, v: str) -> str:
        if v in ("function", "custom", "allowed_tools"):
            raise ValueError(f"not a hosted tool's type: {v!r}")
        return v


class AllowedToolsChoice(Strict):
    """tool_choice {"type": "allowed_tools", "mode", "tools"}: every tool stays in the prompt, the
    model may call only these (held by the grammar). Hosted tools named here are not offered."""
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]] = Field(min_length=1)

    def names(self) -> list[str]:
        return [qualified(t["name"], t.get("namespace")) for t in self.tools
                if t.get("type") in ("function", "custom") and isinstance(t.get("name"), str)]


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None              # accepted, unused


# OpenAI's `include` values: what each asks for is there where this server has it (logprobs), else nothing
INCLUDE_VALUES = ("message.output_text.logprobs", "reasoning.encrypted_content", "web_search_call.action.sources",
                  "web_search_call.results", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                  "file_search_call.results", "message.input_image.image_url")


class ReasoningConfig(Strict):
    effort: Optional[Literal[EFFORT_VALUES]] = None   # "none" turns a thinking template's thinking off
    summary: Optional[str] = None                # accepted: reasoning comes back as written
    generate_summary: Optional[str] = None


class StreamOptions(Strict):
    include_obfuscation: Optional[bool] = None


class ConversationRef(Strict):
    id: str


class ResponsesRequest(Strict):
    model: str
    input: Union[str, list[Item]]
    _message: Optional[MessageItem] = PrivateAttr(None)   # a text input's item (input_items)
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedFunction, AllowedToolsChoice, HostedChoice,
                       None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    store: Optional[bool] = None                 # false: a session of its own, not kept (as chat's)
    metadata: Optional[dict[str, str]] = None    # accepted, returned
    user: Optional[str] = None                   # accepted, unused
    safety_identifier: Optional[str] = None      # accepted, unused
    prompt_cache_key: Optional[str] = None       # accepted: prefix reuse is automatic here
    prompt_cache_retention: Optional[str] = None
    service_tier: Optional[str] = None           # accepted, unused
    client_metadata: Optional[dict[str, Any]] = None   # Codex's thread and turn ids: accepted, unused
    truncation: Optional[Literal["auto", "disabled"]] = None   # the heap keeps any length: nothing to truncate
    include: Optional[list[Literal[INCLUDE_VALUES]]] = None   # "message.output_text.logprobs"; the rest accepted
                                                 # (reasoning comes back as text; nothing encrypted)
    previous_response_id: Optional[str] = None   # continue a response kept in memory (ResponseLog)
    conversation: Union[str, ConversationRef, None] = None   # /v1/conversations: its items come first
    background: Optional[bool] = None            # answered at once (queued), polled, cancelled (background.py)
    top_logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS_MAX)   # with logprobs: alternatives per token
    max_tool_calls: Optional[int] = Field(None, ge=0)   # accepted, returned: it bounds hosted tools' calls,
                                                       # and none is ever made here (they are not offered)

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for the first field set to something this server cannot do."""
        if self.conversation is not None and self.previous_response_id is not None:
            return "conversation", "conversation and previous_response_id cannot be used together"
        if self.previous_response_id is not None and self.store is False:
            return "store", "previous_response_id continues a stored response; this request has store: false"
        if self.background and self.store is False:
            return "store", ("a background response is kept to be polled (GET /v1/responses/ID): it cannot "
                             "have store: false")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA:
            return "metadata", f"metadata is at most {MAX_METADATA} keys (this request has {len(self.metadata)})"
        names = [o.name for o in self.offered]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            return "tools", f"two tools are named {dup!r}"
        items = [] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            if isinstance(item, OtherItem) and item.type in _TYPED:   # a known item, malformed: its model says how
                try:
                    _TYPED[item.type].model_validate(item.model_dump())
                except ValidationError as e:
                    first = e.errors()[0]
                    where = ".".join([f"input.{i}", *(str(p) for p in first["loc"])])
                    return where, f"invalid {where}: {first['msg']}"
            if isinstance(item, OtherItem):
                return f"input.{i}", f"{item.type!r} input items are not supported (messages, function_call, " \
                    "function_call_output, custom_tool_call, custom_tool_call_output and reasoning are)"
            parts = item.content if isinstance(item, MessageItem) else \
                item.output if isinstance(item, _CallOutput) else None
            for j, p in enumerate(parts if isinstance(parts, list) else []):
                if isinstance(p, InputMedia):
                    return f"input.{i}.content.{j}", f"this model reads text only: {p.type!r} parts are not supported"
        offered = {o.name for o in self.offered}
        if isinstance(self.tool_choice, NamedFunction):
            name = qualified(self.tool_choice.name, self.tool_choice.namespace)
            if name not in offered:
                return "tool_choice", f"tool_choice names {name!r}, which is not in tools"
        if isinstance(self.tool_choice, AllowedToolsChoice):
            for name in self.tool_choice.names():
                if name not in offered:
                    return "tool_choice", f"tool_choice allows {name!r}, which is not in tools"
            if not self.tool_choice.names() and self.tool_choice.mode == "required":
                return "tool_choice", "tool_choice requires a call of the tools it allows, and none of them " \
                    "is a function or custom tool this server can offer"
        if isinstance(self.tool_choice, HostedChoice):
            return "tool_choice", (f"tool_choice forces the hosted tool {self.tool_choice.type!r}; this server runs "
                                   "no hosted tools (they are left out of the prompt)")
        if self.tool_choice in ("required",) and not self.offered:
            if self.tools:
                return "tool_choice", ("tool_choice requires a call, and none of the tools is a function or custom "
                                       "tool this server can offer (hosted tools are not run here)")
            return "tool_choice", "tool_choice needs tools"
        return None

    @property
    def conversation_id(self) -> Optional[str]:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c

    @property
    def logprobs(self) -> Optional[int]:
        """Alternatives per token where the output text's logprobs are asked for (include
        "message.output_text.logprobs", or top_logprobs over 0), else None."""
        if LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    @cached_property
    def offered(self) -> list[Offered]:
        """The tools the model is offered: function and custom tools, each namespace's spelled
        out; hosted tools are not among them."""
        out: list[Offered] = []
        for t in self.tools or []:
            if isinstance(t, NamespaceTool):
                out += [offer(inner, t) for inner in t.tools]
            elif isinstance(t, (FunctionTool, CustomTool)):
                out.append(offer(t))
        return out

    @property
    def hosted_tools(self) -> list[str]:
        """The types of the hosted tools asked for (left out: this server cannot run them)."""
        return [t.type for t in self.tools or [] if isinstance(t, HostedTool)]

    @property
    def input_items(self) -> list:
        if isinstance(self.input, str):   # one message item, made once: the response and its conversation
            if self._message is None:     # list it by the one id
                self._message = MessageItem(role="user", content=self.input)
            return [self._message]
        return list(self.input)

    def chat_messages(self, before: list = ()) -> list[ChatMessage]:
        """The conversation (the items `before` this request's: a previous response's chain) as chat
        messages: instructions a system message; an assistant's message, reasoning and function
        calls one assistant message; each call's output a tool message."""
        out: list[ChatMessage] = []
        if self.instructions:
            out.append(ChatMessage(role="system", content=self.instructions))
        items = list(before) + self.input_items
        turn: Optional[dict] = None   # the assistant message being gathered

        def close() -> None:
            nonlocal turn
            if turn is not None:
                out.append(ChatMessage(role="assistant", content=turn["content"] or (None if turn["calls"] else ""),
                                       tool_calls=turn["calls"] or None, reasoning_content=turn["reasoning"] or None))
                turn = None

        def assistant() -> dict:
            nonlocal turn
            if turn is None:
                turn = {"content": "", "calls": [], "reasoning": ""}
            return turn

        for item in items:
            if isinstance(item, ReasoningItem):
                t = assistant()
                if t["content"] or t["calls"]:   # a new step of the reply: reasoning opens it
                    close()
                    t = assistant()
                t["reasoning"] += "".join(p.text for p in item.content or item.summary)
            elif isinstance(item, FunctionCallItem):
                assistant()["calls"].append({"id": item.call_id, "type": "function", "function": {
                    "name": qualified(item.name, item.namespace), "arguments": item.arguments}})
            elif isinstance(item, CustomToolCallItem):
                assistant()["calls"].append({"id": item.call_id, "type": "function", "function": {
                    "name": qualified(item.name, item.namespace),
                    "arguments": json.dumps({"input": item.input}, ensure_ascii=False)}})
            elif isinstance(item, MessageItem) and item.role == "assistant":
                t = assistant()
                if t["calls"]:
                    close()
                    t = assistant()
                t["content"] += _text(item.content)
            else:
                close()
                if isinstance(item, _CallOutput):
                    out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
                else:
                    out.append(ChatMessage(role=item.role, content=_text(item.content)))
        close()
        return out

    def plan(self) -> ChatPlan:
        tools = [o.chat() for o in self.offered] or None
        choice, allowed = self.tool_choice or "auto", None
        if isinstance(choice, NamedFunction):
            choice = qualified(choice.name, choice.namespace)
        elif isinstance(choice, AllowedToolsChoice):
            choice, allowed = choice.mode, choice.names()
        fmt = self.text.format if self.text is not None else None
        schema = None
        if fmt is not None and fmt.type == "json_object":
            schema = {}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise BadRequest("text.format of type json_schema needs a schema", "text.format")
            schema = fmt.schema_
        if schema is not None and choice not in ("auto", "none"):
            raise BadRequest("text.format and a forced tool_choice cannot be combined", "text.format")
        kwargs = None
        if self.reasoning is not None and self.reasoning.effort is not None:
            kwargs = with_effort({"enable_thinking": self.reasoning.effort != "none"}, self.reasoning.effort)
        arguments = {o.name: o.enforce for o in self.offered if o.enforce is not None}
        return ChatPlan(tools, choice, self.parallel_tool_calls is not False, schema, kwargs, arguments or None,
                        allowed, schema_param="text.format")


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a response's request, to count its prompt's tokens."""
    model: Optional[str] = None
    input: Union[str, list[Item]] = ""
    personality: Optional[str] = None   # accepted, unused


UNFINISHED = ("queued", "in_progress")   # a background response's statuses before it ends
RUNS = 3   # a background response the server stopped in runs on at its restart, but not after RUNS
#            runs in a row that kept no reply token
STOPPED = {"code": "server_error", "message": "the server stopped before this background response ended (its "
           "session keeps what was generated: send the conversation again)"}
STOPPING = {"code": "server_error", "message": "the server is stopping: this background response goes on from "
            "where it is when it restarts (GET it then)"}
SESSION_DELETED = {"code": "session_deleted", "message": "its session was deleted (DELETE /v1/sessions/ID) while "
                                                      "this response ran: nothing of it is kept"}
STOPPED_EACH_RUN = {"code": "server_error", "message": f"the server stopped during this background response in "
                    f"{RUNS} runs in a row that wrote nothing more of it (it is not run again: send the conversation "
                    f"again)"}


class ResponseNotFound(ApiError):
    status, code = 404, "response_not_found"


@dataclass
class Kept:
    """A stored response: its body as returned, the items it added to the conversation (its own
    input, then its output; each with an id: with_ids) and the response it continued."""
    body: dict
    items: list
    previous: Optional[str]
    owner: Optional[str]
    chars: int
    resume: Optional[dict] = None   # a background response not ended: its request (JSON), X-Session-Id, runs so far

    def record(self) -> dict:
        return {"body": self.body, "items": [i.model_dump(mode="json", by_alias=True, exclude_none=True)
                                             for i in self.items],
                "previous": self.previous, "owner": self.owner, "chars": self.chars,
                **({"resume": self.resume} if self.resume is not None else {})}

    @classmethod
    def from_record(cls, r: dict) -> "Kept":
        return cls(r["body"], with_ids([_ITEM.validate_python(i) for i in r["items"]]), r["previous"], r["owner"],
                   r["chars"], r.get("resume"))

    @property
    def input_items(self) -> list:
        """The items of its request (the rest are its output)."""
        return self.items[:len(self.items) - len(self.body.get("output") or [])]


def resolve_references(items: list, finders: list[Callable[[str], Any]], param: str) -> list:
    """`items` with each item_reference replaced by the item it names, from the first of `finders`
    (an id -> the item, or None) that has it; a 404 where none has (its response was not stored, or
    was dropped or deleted, or it is another key's)."""
    if not any(isinstance(i, ItemReference) for i in items):
        return items
    out = []
    for n, item in enumerate(items):
        if isinstance(item, ItemReference):
            found = next((f for f in (find(item.id) for find in finders) if f is not None), None)
            if found is None:
                raise ResponseNotFound(f"no item {item.id!r} is kept here (it belongs to a response that was not "
                                       f"stored, or was dropped or deleted: send the item itself)", f"{param}.{n}")
            item = _ITEM.validate_python(found) if isinstance(found, dict) else found
        out.append(item)
    return out


ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
             "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}


def with_ids(items: list) -> list:
    """`items`, each given an id where it came without one (a client's message; a call's output)."""
    for item in items:
        if getattr(item, "id", "") is None:
            item.id = new_id(ID_PREFIX[getattr(item, "type", None) or "message"])
    return items


class ResponseLog(FileBacked):
    """The responses kept for previous_response_id and GET /v1/responses/{id}, the oldest dropped
    past `max_kept` responses or `max_chars` characters. Each keeps only what it added, so a long
    conversation costs its length once; a chain whose start was dropped says so. Event loop only.

    With `path` (the sessions directory's responses.jsonl, a JsonLines) they outlive a restart or a
    crash: each added or deleted response is a line appended, read back at start; a line a crash
    cut short is dropped (that response alone is lost), and the file is rewritten once it holds
    twice what is kept. Reads are not written: after a restart the oldest added are the first
    dropped.

    A background response is kept queued with its request (`resume`), and again when it ends. One
    the server stopped in (queued or running) is read back to run on (`resumable`; from what its
    background.Progress kept), unless the server stopped in it in RUNS runs in a row that kept no
    reply token (a response that brings the server down would otherwise at each start): then it
    reads back failed. (`resume`: its request, session, `runs` so far, and `stalled`: stalled_runs.)"""

    def __init__(self, max_kept: int = 4096, max_chars: int = 16_000_000, path: Optional[Path] = None):
        self.max_kept, self.max_chars = max_kept, max_chars
        self._resumable: list[str] = []   # read back unfinished, to run again
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._items: dict[str, dict[str, Any]] = {}   # item id -> {id of a kept response holding it: the item}
        self.chars = 0
        self.path = path
        self._file = JsonLines(path, "responses") if path is not None else None
        if path is not None:
            self._load()

    def add(self, body: dict, request: ResponsesRequest, owner: Optional[str], resume: Optional[dict] = None) -> None:
        """Keep a response (again: a background one, queued with `resume`, then ended)."""
        items = with_ids(request.input_items) + [output_item(i) for i in body["output"]]
        resume = resume if body.get("status") in UNFINISHED else None
        text = json.dumps(body)
        if resume is not None:   # (a running response's output goes on growing: this moment's is kept)
            body = json.loads(text)
        chars = len(text) + sum(len(i.model_dump_json()) for i in request.input_items) + \
            (len(json.dumps(resume)) if resume is not None else 0)
        kept = Kept(body, items, request.previous_response_id, owner, chars, resume)
        self._keep(body["id"], kept)
        self._write({"add": body["id"], **kept.record()})

    def _keep(self, response_id: str, kept: Kept) -> None:
        self._drop(response_id)   # a background response is added queued, then again once it ends
        self._kept[response_id] = kept
        self.chars += kept.chars
        for item in kept.items:
            if getattr(item, "id", None):
                self._items.setdefault(item.id, {})[response_id] = item
        while self._kept and (len(self._kept) > self.max_kept or self.chars > self.max_chars):
            self._drop(next(iter(self._kept)))

    def _drop(self, response_id: str) -> None:
        kept = self._kept.pop(response_id, None)
        if kept is None:
            return
        self.chars -= kept.chars
        for item in kept.items:
            holders = self._items.get(getattr(item, "id", None) or "")
            if holders is not None:
                holders.pop(response_id, None)
                if not holders:
                    del self._items[item.id]

    def find_item(self, item_id: str, owner: Optional[str]) -> Any:
        """The item of that id in `owner`'s kept responses (the latest holding it), or None."""
        found = [item for rid, item in self._items.get(item_id, {}).items() if self._kept[rid].owner == owner]
        return found[-1] if found else None

    def get(self, response_id: str, owner: Optional[str], param: str = "response_id") -> Kept:
        kept = self._kept.get(response_id)
        if kept is None or kept.owner != owner:
            where = "kept with the sessions" if self.path is not None else "kept in memory, until the server restarts"
            raise ResponseNotFound(f"no response {response_id!r} is kept here (responses are {where}, the latest "
                                   f"{self.max_kept}; the conversation's session is not lost: send the whole "
                                   f"conversation in input)", param)
        self._kept.move_to_end(response_id)
        return kept

    def conversation(self, response_id: str, owner: Optional[str]) -> list:
        """The items of the chain that ends with `response_id`, oldest first."""
        chain, at = [], response_id
        while at is not None:
            kept = self.get(at, owner, "previous_response_id")
            if kept.body.get("status") in UNFINISHED:
                raise BadRequest(f"response {at!r} is still {kept.body['status']} (a background response): "
                                 f"continue it once it has ended", "previous_response_id")
            chain.append(kept.items)
            at = kept.previous
        return [item for items in reversed(chain) for item in items]

    def resumable(self) -> list[tuple[str, Kept]]:
        """The background responses read back unfinished that run again (each once: taken)."""
        out = [(rid, self._kept[rid]) for rid in self._resumable if rid in self._kept]
        self._resumable = []
        return out

    def fail(self, response_id: str, error: dict) -> None:
        """A kept background response ended failed without running (`error`: code and message)."""
        kept = self._kept[response_id]
        kept.body.update(status="failed", error=error)
        kept.resume = None
        self._write({"add": response_id, **kept.record()})

    def delete(self, response_id: str, owner: Optional[str]) -> None:
        self.get(response_id, owner)
        self._drop(response_id)
        self._write({"delete": response_id})

    # -- the file --

    def _live(self) -> int:
        return len(self._kept)

    def _records(self) -> list[dict]:
        return [{"add": rid, **k.record()} for rid, k in self._kept.items()]

    def _load(self) -> None:
        """The kept responses from the file: records in order, deletions applied; a line that
        does not read (the tail a crash cut short) ends the reading, and the file is rewritten."""
        def apply(r: dict) -> None:
            if "delete" in r:
                self._drop(r["delete"])
            else:
                self._keep(r["add"], Kept.from_record(r))

        whole = self._file.load(apply)
        for rid, kept in self._kept.items():
            if kept.body.get("status") not in UNFINISHED:
                continue
            if kept.resume is not None and stalled_runs(kept.resume) < RUNS:   # the server stopped in it
                self._resumable.append(rid)
            else:   # kept before resuming was (no request), or stopped in each time it ran
                kept.body.update(status="failed", error=STOPPED_EACH_RUN if kept.resume is not None else STOPPED)
                kept.resume = None
        if not whole:
            self._file.rewrite(self._records(), now=True)
        log.info("%d kept responses read from %s", len(self._kept), self.path)


def stalled_runs(resume: dict) -> int:
    """The runs in a row, the last one's included, that kept no reply token: the last one counts
    until it keeps one (it is then kept 0). (Kept by a server before this count: all its runs.)"""
    return resume.get("stalled", resume.get("runs", RUNS))


_OUTPUT_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "custom_tool_call": CustomToolCallItem,
                 "reasoning": ReasoningItem}


def output_item(item: dict):
    """An output item as the input item a client would send back."""
    return _OUTPUT_ITEMS[item["type"]].model_validate(item)


def _text(content: Union[str, list]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, InputText))


def new_id(prefix: str) -> str:
    return f"{prefix}_{hex_id(12)}"


class Built:
    """A response's output items as the reply's pieces arrive, and the events that tell a stream
    about them (each with its sequence number): an item is added, its text or arguments grow,
    it is done."""

    def __init__(self, request: ResponsesRequest, model: str, count: Callable[[str], int]):
        self.request, self.model = request, model
        self.count = count                    # tokens of a text (the reasoning's, for usage)
        self.id, self.created = new_id("resp"), int(time.time())
        self.items: list[dict] = []
        self.open: Optional[dict] = None      # the item still being written
        self.sequence = 0
        self.calls = 0
        self.call_errors: list[dict] = []     # calls whose arguments are not JSON
        self.pending: list = []               # TokenLogprob entries read since the last message text (read)
        self.tools = {o.name: o for o in request.offered}   # the names the model calls them by
        self.custom_args = InputStream()      # a custom tool call's arguments as written ({"input": ...}), read
        self.background = bool(request.background)

    def event(self, type_: str, **data) -> dict:
        body = {"type": type_, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return body

    def response(self, status: str, done: Optional[Finished] = None, extension: Optional[dict] = None) -> dict:
        r = self.request
        fmt = {"type": "text"}
        if r.text is not None and r.text.format is not None:
            fmt = r.text.format.model_dump(by_alias=True, exclude_none=True)
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": self.background, "error": None, "incomplete_details": None, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "max_tool_calls": r.max_tool_calls,
                "model": self.model, "output": self.items,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id,
                "conversation": {"id": r.conversation_id} if r.conversation_id else None,
                "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
                "store": r.store is not False, "temperature": r.temperature, "text": {"format": fmt},
                "tool_choice": r.tool_choice.model_dump(exclude_none=True) if isinstance(r.tool_choice, BaseModel)
                else r.tool_choice or "auto",
                "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in r.tools or []], "top_p": r.top_p,
                "truncation": r.truncation or "disabled", "usage": None, "user": r.user, "metadata": r.metadata or {}}
        if done is not None:
            u = done.usage
            reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
            body["usage"] = {"input_tokens": u.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": u.cached_tokens},
                             "output_tokens": u.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": self.count(reasoning) if reasoning else 0},
                             "total_tokens": u.total_tokens}
            if done.finish_reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            elif done.interrupted == "stopped":   # POST /v1/sessions/{id}/stop (localheap's own reason)
                body["incomplete_details"] = {"reason": "stopped"}
        if extension is not None:
            body["localheap"] = {**extension, **({"tool_call_errors": self.call_errors} if self.call_errors else {})}
            if r.hosted_tools:   # left out of the prompt: the model was not told of them
                body["localheap"]["ignored_tools"] = r.hosted_tools
        return body

    def feed(self, piece: Piece, logprobs: Optional[list[dict]] = None, last: bool = False) -> list[dict]:
        """The events of one piece of the reply; a message's text comes with `logprobs` (entries as
        chat's logprobs.content), if asked for. `last`: the reply has ended (a call at its end whose
        arguments do not read is left open: finish closes it, incomplete where the limit cut it)."""
        out: list[dict] = []
        if isinstance(piece, Text):
            kind = "message" if piece.kind == "content" else "reasoning"
            if self.open is None or self.open["type"] != kind:
                out += self.close()
                out += self._add(kind)
            item = self.open
            part = item["content"][0]
            part["text"] += piece.text
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": list(logprobs or [])} if kind == "message" else {}
            if logprobs:
                part["logprobs"] += logprobs
            out.append(self.event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                                  delta=piece.text, **extra))
        elif isinstance(piece, CallStart):
            out += self.close()
            out += self._call(piece.id, piece.name)
        elif isinstance(piece, CallArgs):
            item = self.open
            if item["type"] == "custom_tool_call":   # its input as it is read from the arguments
                out += self._input_delta(item, self.custom_args.feed(piece.text))
            else:
                item["arguments"] += piece.text
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.items) - 1, delta=piece.text))
        elif isinstance(piece, ToolCall):
            if not piece.streamed:   # a call that comes out whole: added, its arguments in one delta
                out += self.close()
                out += self._call(piece.id, piece.name)
                out += self.feed(CallArgs(piece.arguments))
            item = self.open
            error = piece.error
            if item["type"] == "custom_tool_call":
                whole, error = custom_input(piece)
                out += self._input_delta(item, self.custom_args.rest(whole) or "")
                item["input"] = whole   # (arguments that did not read: its done event says what it is)
            else:
                item["arguments"] = piece.arguments
            if error is not None:   # returned as written, named in the response's `localheap`
                self.call_errors.append({"index": self.calls, "call_id": piece.id, "error": error})
            self.calls += 1
            if not (last and error is not None):
                out += self.close()
        return out

    def _input_delta(self, item: dict, text: str, index: Optional[int] = None) -> list[dict]:
        """A custom tool call's input goes on by `text`."""
        if not text:
            return []
        item["input"] += text
        index = len(self.items) - 1 if index is None else index
        return [self.event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                           delta=text)]

    def _call(self, call_id: str, name: str) -> list[dict]:
        """A call's item added: a function_call, or a custom tool's custom_tool_call; a namespaced
        tool's by its own name and its namespace."""
        tool = self.tools.get(name)
        fields = {"call_id": call_id, "name": tool.inner if tool else name}
        if tool is not None and tool.namespace:
            fields["namespace"] = tool.namespace
        if tool is not None and tool.custom:
            self.custom_args = InputStream()
            return self._add("custom_tool_call", **fields)
        return self._add("function_call", **fields)

    def _add(self, kind: str, **fields) -> list[dict]:
        if kind == "function_call":
            item = {"type": "function_call", "id": new_id("fc"), "status": "in_progress", "arguments": "", **fields}
        elif kind == "custom_tool_call":
            item = {"type": "custom_tool_call", "id": new_id("ctc"), "status": "in_progress", "input": "", **fields}
        elif kind == "message":
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        else:
            item = {"type": "reasoning", "id": new_id("rs"), "status": "in_progress", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        calls = ("function_call", "custom_tool_call")
        added = {**item, "content": []} if kind not in calls else dict(item)
        out = [self.event("response.output_item.added", output_index=index, item=added)]
        if kind not in calls:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={**item["content"][0], "text": ""}))
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """The open item's done events (none open: nothing)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        elif item["type"] == "custom_tool_call":
            if status != "completed" and self.custom_args.at is None and not item["input"]:   # cut before its input
                out += self._input_delta(item, self.custom_args.args, index)
            out.append(self.event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                  input=item["input"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=list(part["logprobs"])))
            else:
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        out.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def read(self, parser, text: Optional[str], entries: Optional[list], token_text=None) -> list[dict]:
        """The events of a Delta's `text` (None: the reply ended) through `parser`. With
        `token_text` (logprobs asked for), the entries of the tokens read since the last message
        text go with the next message text; those read for reasoning or a tool call alone are
        not listed (a Delta whose text ends the reasoning and starts the message gives its tokens
        to the message)."""
        self.pending += entries or []
        pieces = parser.feed(text) if text is not None else parser.finish()
        content = [p for p in pieces if isinstance(p, Text) and p.kind == "content"]
        out: list[dict] = []
        for piece in pieces:
            logprobs = None
            if token_text is not None and content and piece is content[0]:
                logprobs, self.pending = chat_content(token_text, self.pending), []
            out += self.feed(piece, logprobs, last=text is None)
        if pieces and not content:
            self.pending = []
        return out

    def finish(self, done: Finished, extension: dict) -> tuple[dict, list[dict]]:
        """(the whole response, the events that end its stream): the open item closed (incomplete
        where max_output_tokens cut it), then response.completed or response.incomplete."""
        cut = done.finish_reason == "length" or done.interrupted == "stopped"   # (its session's stop)
        events = self.close("incomplete" if cut else "completed")
        status = "incomplete" if cut else "completed"
        body = self.response(status, done, extension)
        events.append(self.event("response.incomplete" if cut else "response.completed", response=body))
        return body, events

    def stop(self, status: str, error: Optional[dict] = None, done: Optional[Finished] = None,
             extension: Optional[dict] = None) -> tuple[dict, list[dict]]:
        """(the whole response, the events that end its stream) for a reply that did not run to its
        end: "cancelled" (its open item incomplete; no event says so, the stream just ends) or
        "failed" with `error` ({"code", "message"}; response.failed)."""
        events = self.close("incomplete")
        body = self.response(status, done, extension)
        body["error"] = error
        if status == "failed":
            events.append(self.event("response.failed", response=body))
        return body, events
