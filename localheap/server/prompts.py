"""Requests -> Prompts: chat templates and tokenization (run off the event loop: a long
document takes a while to tokenize). Knows the tokenizer, never a tensor."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from starlette.concurrency import run_in_threadpool

from ..sessions import Prompt
from ..sessions.session import token_array
from .errors import BadRequest, PromptTooLong
from .schemas import ChatMessage, CompletionRequest
from .toolformats import Harmony, ToolFormat
from .tokens import (PIECE_CHARS, check_chars, encode_bounded, encode_plain,
                     leading_specials, release_freed_memory, special_head)

log = logging.getLogger("localheap.server")

_LONG_TEXTS = threading.Lock()

# A finished exchange rendered before new turns, so that the difference between the two
# renders is exactly what the template adds for the new turns (no BOS, no default system).
_PLACEHOLDER = [{"role": "user", "content": "\u2047"}, {"role": "assistant", "content": "\u2048"}]


# apply_chat_template's own arguments: not for a request's chat_template_kwargs to set
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                              "add_generation_prompt", "continue_final_message", "return_dict", "padding",
                              "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                              "tokenizer_kwargs"})


@dataclass
class ChatOptions:
    """What a chat request adds to its messages: tools (OpenAI shape) and the template's own
    keyword arguments (e.g. enable_thinking)."""
    tools: Optional[list[dict]] = None
    fmt: Optional[ToolFormat] = None          # the model's tool-call format (from its template)
    template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = sorted(set(self.template_kwargs) & _RESERVED_KWARGS)
        if bad:
            raise BadRequest(f"chat_template_kwargs cannot set {', '.join(bad)}", "chat_template_kwargs")

    @property
    def prompted(self) -> bool:
        """Tools and past calls written by the format (into a system message or its `tools` field,
        and the assistant's text): the template does not take `tools` and `tool_calls`."""
        return self.fmt is not None and not self.fmt.in_template

    def template_args(self) -> dict:
        if self.tools and not self.prompted:
            return {"tools": self.tools, **self.template_kwargs}
        return dict(self.template_kwargs)


EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}   # (EFFORT_VALUES)


def with_effort(kwargs: Optional[dict], effort: Optional[str]) -> Optional[dict]:
    """Template arguments with a request's reasoning effort as `reasoning_effort` (gpt-oss's
    template writes it into its system message: low, medium or high; OpenAI's "minimal" is low).
    Templates that do not read it ignore it; chat_template_kwargs that set it win."""
    if effort not in EFFORTS or (kwargs and "reasoning_effort" in kwargs):
        return kwargs
    return {**(kwargs or {}), "reasoning_effort": EFFORTS[effort]}


def _messages(messages: list[ChatMessage], opts: Optional[ChatOptions] = None, tools: bool = True) -> list[dict]:
    """Messages as chat templates take them (Hugging Face's conventions: tool call arguments as
    objects). Where the template cannot render tools, calls and results are written as text, and
    (`tools`) the tools into the system message (_with_tools)."""
    opts = opts or ChatOptions()
    out: list[dict] = []
    for m in messages:
        # "developer" is OpenAI's newer name for the system role; templates know "system"
        d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls and opts.fmt is not None and opts.fmt.metadata_calls:   # GLM-4: a turn a call
            out.extend(opts.fmt.call_turns(d["content"], [(c.function.name, c.function.arguments)
                                                          for c in m.tool_calls]))
            continue
        if m.role == "tool" and opts.fmt is not None and opts.fmt.metadata_calls:
            out.append({"role": "observation", "content": d["content"]})
            continue
        if m.tool_calls and opts.prompted:
            d["content"] = opts.fmt.written_calls(d["content"], [(c.function.name, c.function.arguments)
                                                                 for c in m.tool_calls])
        elif m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.role == "tool" and opts.prompted and opts.fmt.results_as_user:
            result = f"<tool_response>\n{d['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):   # results of one turn's calls: one message
                out[-1]["content"] += "\n" + result
                continue
            d = {"role": "user", "content": result, "tool_results": True}
        elif m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        if m.role == "assistant" and m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
            if isinstance(opts.fmt, Harmony):   # gpt-oss's template reads an assistant's analysis as `thinking`
                d["thinking"] = m.reasoning_content
        if d["role"] == "user" and out and out[-1].get("tool_results"):   # roles alternate (Gemma's template)
            out[-1]["content"] += "\n\n" + d["content"]
            continue
        out.append(d)
    for d in out:
        d.pop("tool_results", None)
    return _with_tools(out, opts) if tools else out


def _with_tools(messages: list[dict], opts: Optional[ChatOptions]) -> list[dict]:
    """The tools written into the messages' system message where the template cannot render them."""
    if opts is not None and opts.prompted and opts.tools:
        return opts.fmt.with_tools(messages, opts.tools)
    return messages


def _arguments(text: str) -> Any:
    """A call's arguments as an object for the template; as sent when they are not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, **template_args) -> str:
    if getattr(tokenizer, "chat_template", None) is None and not _has_template(tokenizer):
        raise BadRequest("this model has no chat template; use /v1/completions", "messages", "no_chat_template")
    try:
        return _templating(tokenizer).apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt, **template_args)
    except Exception as e:  # jinja raises its own error types from inside the template
        raise BadRequest(f"the model's chat template refused these messages: {e}", "messages") from e


def check_template(tokenizer: Any) -> None:
    """At start: a chat template that does not compile is refused (ValueError: every chat would fail, each
    blamed on its client); one that fails on a plain user message is warned of."""
    if getattr(tokenizer, "chat_template", None) is None and not _has_template(tokenizer):
        return
    try:
        _templating(tokenizer).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                   add_generation_prompt=True)
    except Exception as e:   # noqa: BLE001 - jinja's own error types
        if type(e).__name__ == "TemplateSyntaxError":
            raise ValueError(f"the model's chat template does not compile: {e} (fix tokenizer_config.json's "
                             f"chat_template, or serve it for /v1/completions alone by removing it)") from e
        log.warning("the model's chat template fails on a plain user message (%s: %s): chat requests will be "
                    "refused with its error; /v1/completions works", type(e).__name__, e)


def _templating(tokenizer: Any) -> Any:
    """The tokenizer whose template renders: MLX's wrapper's Hugging Face tokenizer (the wrapper adds
    enable_thinking=<its vocabulary has <think>> to every render, so one model directory rendered
    otherwise on MLX than on torch), unless mlx-lm gave the wrapper a template function of its own."""
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is not None and getattr(tokenizer, "_chat_template", None) is None \
            and hasattr(inner, "apply_chat_template") and getattr(inner, "chat_template", None) is not None:
        return inner
    return tokenizer


def _has_template(tokenizer: Any) -> bool:
    inner = getattr(tokenizer, "_tokenizer", None)
    return getattr(inner, "chat_template", None) is not None


def render_continuation(tokenizer: Any, messages: list[dict], add_generation_prompt: bool,
                        wrap: Callable[[list[dict]], list[dict]] = lambda ms: ms,
                        **template_args) -> tuple[Optional[str], Optional[str]]:
    """What the template adds for `messages` after an earlier exchange, or None; and the same after
    that exchange's reply's text, its end of turn first (what follows a reply a session holds as it
    was generated: the model sampled its end-of-turn token and never read it), or None. One render of
    the whole: the second is what follows the placeholder reply's text in it (Qwen3's and Phi-4-mini's
    templates render the placeholder alone otherwise than before new turns). `wrap`: what goes around the
    whole conversation (tools written into its system message: the session has them, before the
    placeholder, not again before the new messages)."""
    try:
        closed = {k: v for k, v in template_args.items() if k != "continue_final_message"}   # (a prefill's)
        base = _templating(tokenizer).apply_chat_template(wrap(list(_PLACEHOLDER)), tokenize=False, **closed)
        full = _templating(tokenizer).apply_chat_template(wrap(_PLACEHOLDER + messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_args)
    except Exception:
        return None, None
    reply = full.find(_PLACEHOLDER[1]["content"])
    return (full[len(base):] if full.startswith(base) else None,
            full[reply + len(_PLACEHOLDER[1]["content"]):] if reply >= 0 else None)


async def tokenize(fn: Callable[..., Prompt], *args, **kwargs) -> Prompt:
    """Run a prompt builder off the event loop (a long document takes a while); long texts
    one at a time, so their tokenizer transients never add up; their freed memory is
    handed back to the system afterwards (the 30 MB message case)."""
    return await run_in_threadpool(_bounded, fn, args, kwargs)


def _chars(arg: Any) -> int:
    """Characters of text a prompt builder's argument carries (a text, messages, a request)."""
    if isinstance(arg, str):
        return len(arg)
    if isinstance(arg, list):
        return sum(_chars(m.text() if isinstance(m, ChatMessage) else m) for m in arg)
    return _chars(arg.prompt) if isinstance(arg, CompletionRequest) else 0


def _bounded(fn: Callable[..., Prompt], args: tuple, kwargs: dict) -> Prompt:
    if sum(_chars(a) for a in args) < PIECE_CHARS:
        return fn(*args, **kwargs)
    try:
        with _LONG_TEXTS:
            return fn(*args, **kwargs)
    finally:
        release_freed_memory()


def chat_prompt(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                limit: Optional[int] = None, opts: Optional[ChatOptions] = None,
                continue_final: bool = False) -> Prompt:
    """The full conversation, plus its continuation for an explicit session that holds
    earlier turns (only the new messages are sent). Tokenized once: the continuation's ids
    are the tail of the conversation's when the template renders it as the text's tail.
    `continue_final`: the last message (the assistant's, a prefill) is left open for the reply
    to go on from (transformers' continue_final_message), no generation prompt after it."""
    check_chars(tokenizer, sum(len(m.text()) for m in messages), limit, "messages")
    msgs = _messages(messages, opts)
    args = opts.template_args() if opts is not None else {}
    if continue_final:
        args, add_generation_prompt = {**args, "continue_final_message": True}, False
    text = render(tokenizer, msgs, add_generation_prompt, **args)
    tokens = encode_bounded(tokenizer, text, limit)
    if opts is not None and opts.prompted and opts.tools:   # (a session that holds the tools' text, and one that does not)
        plain = _messages(messages, opts, tools=False)
        held = _continuations(tokenizer, text, tokens, limit, render_continuation(
            tokenizer, plain, add_generation_prompt, lambda ms: _with_tools(ms, opts), **args))
        anew = _continuations(tokenizer, text, tokens, limit,
                              render_continuation(tokenizer, msgs, add_generation_prompt, **args))
        listing = encode_plain(tokenizer, opts.fmt.listing(opts.tools))
        return Prompt(tokens, text, *held, tools_ids=listing[2:-2] or listing, tools_anew=anew)
    return Prompt(tokens, text, *_continuations(tokenizer, text, tokens, limit,
                                                render_continuation(tokenizer, msgs, add_generation_prompt, **args)))


def _continuations(tokenizer: Any, text: str, tokens: Sequence[int], limit: Optional[int],
                   rendered: tuple[Optional[str], Optional[str]]) -> tuple:
    """render_continuation's two texts as ids (continuation, after_reply): the continuation's a slice of the
    prompt's where the template renders it as the prompt's tail."""
    cont, after = rendered
    cont_ids = _tail_ids(tokenizer, text, tokens, cont) if cont is not None else None
    if after is not None and cont_ids is not None and after.endswith(cont):   # the end of turn, then the same ids
        after_ids = token_array(encode_plain(tokenizer, after[:len(after) - len(cont)])) + token_array(cont_ids)
    else:   # (read in pieces, bounded, as the prompt is: a long message is long here too)
        after_ids = token_array(encode_bounded(tokenizer, after, limit)) if after is not None else None
    return cont_ids, after_ids


def _tail_ids(tokenizer: Any, text: str, tokens: Sequence[int], tail: str) -> Sequence[int]:
    """The ids of `tail`, a suffix of `text`: a slice of `tokens` when the text before it
    (a short head: BOS, a default system prompt) tokenizes to their first ids."""
    if text.endswith(tail):
        head = encode_plain(tokenizer, text[:len(text) - len(tail)])
        if list(tokens[:len(head)]) == head:
            return tokens[len(head):]
    return encode_plain(tokenizer, tail)


def with_specials(tokenizer: Any, text: str, ids: Sequence[int]) -> Sequence[int]:
    """`ids` with the special tokens the tokenizer adds to a text (BOS), without tokenizing
    the text again; a second call only for a tokenizer that adds them elsewhere."""
    head = special_head(tokenizer)
    if head is not None:
        return token_array(head) + token_array(ids)
    return list(tokenizer.encode(text, add_special_tokens=True))


def completion_prompt(tokenizer: Any, p: Union[str, list[int]], limit: Optional[int] = None) -> Prompt:
    """One of a completion request's prompts (CompletionRequest.prompts): text, or token ids."""
    if isinstance(p, list) and not p:
        raise BadRequest("the prompt is empty", "prompt")
    if isinstance(p, list) and isinstance(p[0], int):
        if limit is not None and len(p) > limit:
            raise PromptTooLong(limit, len(p), "prompt")
        return Prompt(list(p), None, list(p))   # ids are checked against the vocabulary by the engine
    text = p
    if not text:
        raise BadRequest("the prompt is empty", "prompt")
    plain = encode_bounded(tokenizer, text, limit, "prompt")
    return Prompt(with_specials(tokenizer, text, plain), None, plain)


def after_context(tokenizer: Any, context: Sequence[int], prompt: Prompt, limit: Optional[int] = None) -> Prompt:
    """Ollama's `context` (the ids an earlier /api/generate reply returned) with `prompt` after it: the
    prompt's ids without the BOS it starts with (the context has its own). Token ids, not text read
    again, so the session that reply ended extends as it is."""
    head, ids = leading_specials(tokenizer), list(prompt.tokens)
    if head and ids[:len(head)] == head:
        ids = ids[len(head):]
    tokens = list(context) + ids
    if limit is not None and len(tokens) > limit:
        raise PromptTooLong(limit, len(tokens), "context")
    return Prompt(tokens, None, None)   # ids are checked against the vocabulary by the engine


def document_prompt(tokenizer: Any, text: str, role: str, raw: bool, limit: Optional[int] = None) -> Prompt:
    if raw:
        plain = encode_bounded(tokenizer, text, limit, "text")
        return Prompt(with_specials(tokenizer, text, plain), None, plain)
    return chat_prompt(tokenizer, [ChatMessage(role=role, content=text)], add_generation_prompt=False, limit=limit)
