"""The Anthropic Messages API in localheap's terms: request bodies (pydantic, unknown fields
refused), their conversion to the chat messages the OpenAI route renders (so both APIs share
templates, sessions, heap, recall and prefix reuse), and the reply as Anthropic's content blocks
and stream events."""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from ..engine import Finished
from .chat import ChatPlan
from .errors import BadRequest
from .schemas import ChatMessage, Strict, object_schema
from .toolcalls import Text
from .toolformats import ToolCall

CacheControl = Optional[dict[str, Any]]   # prompt-caching hints: accepted; prefix reuse is automatic here


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: Optional[list[Any]] = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None
    cache_control: CacheControl = None   # (Claude Code marks them)


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: Optional[dict[str, Any]] = None      # accepted, unused (the SDK's blocks dump it, as None)
    toolset_name: Optional[str] = None           # accepted, unused


class MediaBlock(Strict):
    """Images, documents and search results. A plain-text document (a `text` source, or a `content`
    source of text blocks) and a search result (text blocks) are read as text: their title, context
    or source URL, then their text. Images and other documents (PDF, URL) are refused by name."""
    type: Literal["image", "document", "search_result"]
    source: Any = None
    cache_control: CacheControl = None
    title: Optional[str] = None
    context: Optional[str] = None
    citations: Any = None
    content: Optional[list[TextBlock]] = None   # a search result's

    def text(self) -> Optional[str]:
        """The block as the model reads it, or None where this server cannot read it."""
        src = self.source if isinstance(self.source, dict) else {}
        if self.type == "search_result" and self.content is not None and isinstance(self.source, str):
            body, head = "".join(b.text for b in self.content), [self.title, self.source]
        elif self.type == "document" and src.get("type") == "text" and isinstance(src.get("data"), str):
            body, head = src["data"], [self.title, self.context]
        elif self.type == "document" and src.get("type") == "content":
            blocks = src.get("content")
            if isinstance(blocks, str):
                body = blocks
            elif isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                                  and isinstance(b.get("text"), str) for b in blocks):
                body = "".join(b["text"] for b in blocks)
            else:
                return None
            head = [self.title, self.context]
        else:
            return None
        return "\n".join([h for h in head if h] + [body])

    def refusal(self) -> str:
        kind = self.source.get("type") if isinstance(self.source, dict) else None
        if self.type == "document":
            return (f"document content blocks with a {kind!r} source are not supported: this server serves text "
                    f"models and reads documents with a 'text' or 'content' source")
        return f"{self.type} content blocks are not supported: this server serves text models"


def _text(blocks: list, where: str) -> str:
    """The text of a message's text blocks and readable media blocks, in order (a media block set off
    from its neighbours by a blank line); BadRequest for a media block this server cannot read."""
    out, after_media = "", False
    for b in blocks:
        if isinstance(b, MediaBlock):
            text = b.text()
            if text is None:
                raise BadRequest(b.refusal(), where)
            out += ("\n\n" if out else "") + text
            after_media = True
        elif isinstance(b, TextBlock):
            out += ("\n\n" if after_media and out else "") + b.text
            after_media = False
    return out


class ToolResultBlock(Strict):
    """A tool's result: text, or blocks (text, and the media blocks a message may hold: a search
    result or a plain-text document is read as text, an image is refused by name)."""
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Union[TextBlock, MediaBlock]], None] = None
    is_error: Optional[bool] = None
    cache_control: CacheControl = None
    toolset_name: Optional[str] = None           # accepted, unused

    def text(self, where: str) -> str:
        text = self.content if isinstance(self.content, str) else _text(self.content or [], where)
        return f"Error: {text}" if self.is_error else text


Block = Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock, MediaBlock]


class Message(Strict):
    role: Literal["user", "assistant", "system"]   # system: an instruction mid-conversation (Claude Code's)
    content: Union[str, list[Block]]


class ToolDef(Strict):
    """A client tool with its input_schema. Anthropic's own tool types (server tools such as
    web_search or code_execution, and the schema-less client tools bash, text_editor, computer,
    memory) are refused by their type: this server can run none and has no schema for them."""
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: CacheControl = None
    # Claude Code's: accepted, unused (every tool is in the prompt; its arguments are parsed, not constrained)
    defer_loading: Optional[bool] = None
    input_examples: Optional[list[Any]] = None
    strict: Optional[bool] = None
    eager_input_streaming: Optional[bool] = None

    _object = field_validator("input_schema")(object_schema)

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tools of type {kind!r} (Anthropic's own: its server tools and its schema-less client "
                             f"tools) are not supported: this server takes custom tools with an input_schema")
        return data


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(Strict):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: Optional[int] = None          # accepted; the template decides how long it thinks
    display: Optional[Literal["summarized", "omitted"]] = None   # accepted; thinking is returned as written


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Optional[str] = None                 # accepted, unused
    format: Optional[JsonOutputFormat] = None    # structured output: enforced by the grammar


class Metadata(Strict):
    user_id: Optional[str] = None


class CountTokensRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    cache_control: CacheControl = None
    # context editing (Claude Code sends it): accepted, and no edits are applied: the heap bounds
    # what the model attends to instead (by score, not by clearing old tool results)
    context_management: Optional[dict[str, Any]] = None

    @property
    def prefilled(self) -> bool:
        """Whether the conversation ends with the assistant's own text (a prefill: no tool use), which
        the reply goes on from rather than a new turn, as Anthropic's API does; like it, a 400 when
        that text ends in whitespace."""
        last, at = self.messages[-1], f"messages.{len(self.messages) - 1}.content"
        if last.role != "assistant":
            return False
        blocks = [TextBlock(type="text", text=last.content)] if isinstance(last.content, str) else last.content
        text = _text(blocks, at)
        if not text or any(isinstance(b, ToolUseBlock) for b in blocks):
            return False
        if text != text.rstrip():
            raise BadRequest("final assistant content cannot end with trailing whitespace", at)
        return True

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as OpenAI-shaped chat messages: tool_result blocks become tool messages,
        tool_use blocks tool calls, thinking blocks reasoning_content."""
        out: list[ChatMessage] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append(ChatMessage(role="system", content=system))
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            text = _text(blocks, f"messages.{i}.content")
            if m.role == "system":   # where it stands, as a system message (the OpenAI routes take one there too)
                out.append(ChatMessage(role="system", content=text))
                continue
            if m.role == "user":
                for j, b in enumerate(blocks):
                    if isinstance(b, ToolResultBlock):
                        out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                               content=b.text(f"messages.{i}.content.{j}.content")))
                if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    out.append(ChatMessage(role="user", content=text))
                continue
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            out.append(ChatMessage(role="assistant", content=text if text or not calls else None,
                                   tool_calls=calls or None, reasoning_content=thinking or None))
        return out

    def plan(self) -> ChatPlan:
        tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                   **({"description": t.description} if t.description else {})}}
                 for t in self.tools or []] or None
        names = [t.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise BadRequest(f"two tools are named {next(n for n in names if names.count(n) > 1)!r}", "tools")
        choice, parallel = "auto", True
        if self.tool_choice is not None:
            tc = self.tool_choice
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type, tc.name)
            parallel = not tc.disable_parallel_tool_use
            if tc.type == "tool" and (not tc.name or tc.name not in {t.name for t in self.tools or []}):
                raise BadRequest(f"tool_choice names {tc.name!r}, which is not in tools", "tool_choice")
            if tc.type in ("any", "tool") and not tools:
                raise BadRequest("tool_choice needs tools", "tool_choice")
        kwargs = None
        if self.thinking is not None:
            kwargs = {"enable_thinking": self.thinking.type != "disabled"}
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None and choice not in ("auto", "none"):
            raise BadRequest("output_config.format and a forced tool_choice cannot be combined", "output_config")
        return ChatPlan(tools, choice, parallel, fmt.schema_ if fmt is not None else None, kwargs,
                        schema_param="output_config.format")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = Field(None, max_length=16)
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None   # accepted, unused


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_input(call: ToolCall) -> dict:
    """A call's input object; {} for arguments that are not a JSON object (flagged in `localheap`)."""
    if call.error is None:
        value = json.loads(call.arguments)
        if isinstance(value, dict):
            return value
    return {}


def call_error(call: ToolCall, index: int) -> Optional[dict]:
    if call.error is None and isinstance(json.loads(call.arguments), dict):
        return None
    return {"index": index, "id": call.id, "error": call.error or "the arguments are not a JSON object",
            "arguments": call.arguments}


def content_block(piece) -> dict:
    if isinstance(piece, ToolCall):
        return {"type": "tool_use", "id": piece.id, "name": piece.name, "input": tool_input(piece)}
    if piece.kind == "reasoning":
        return {"type": "thinking", "thinking": piece.text, "signature": ""}
    return {"type": "text", "text": piece.text}


def usage(done: Finished) -> dict:
    u = done.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(done: Finished, tool_calls: bool, stop_sequence: Optional[str]) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    if tool_calls and done.finish_reason == "stop":
        return "tool_use"
    return STOP_REASONS.get(done.finish_reason, "end_turn")


def merged(pieces: list) -> list:
    """Adjacent text of one kind as one block."""
    out: list = []
    for p in pieces:
        if isinstance(p, Text) and out and isinstance(out[-1], Text) and out[-1].kind == p.kind:
            out[-1] = Text(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out
