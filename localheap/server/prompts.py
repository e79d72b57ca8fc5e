"""Requests -> Prompts: chat templates and tokenization (run off the event loop: a long
document takes a while to tokenize). Knows the tokenizer, never a tensor."""

from __future__ import annotations

import re
from typing import Any, Optional

from ..sessions import Prompt
from .errors import BadRequest
from .schemas import ChatMessage, CompletionRequest

_SURROGATE = re.compile("[\ud800-\udfff]")
# A finished exchange rendered before new turns, so that the difference between the two
# renders is exactly what the template adds for the new turns (no BOS, no default system).
_PLACEHOLDER = [{"role": "user", "content": "\u2047"}, {"role": "assistant", "content": "\u2048"}]


def _messages(messages: list[ChatMessage]) -> list[dict]:
    # "developer" is OpenAI's newer name for the system role; templates know "system"
    return [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.text(), "messages")}
            for m in messages]


def _text(text: str, param: str) -> str:
    r"""JSON may carry lone surrogates ("\ud800") that no tokenizer encodes: 400, not 500.
    A search, not an encode: no copy of a large document."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise BadRequest(f"{param} holds invalid unicode (a lone surrogate at character {bad.start()})", param)
    return text


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) is None and not _has_template(tokenizer):
        raise BadRequest("this model has no chat template; use /v1/completions", "messages", "no_chat_template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises its own error types from inside the template
        raise BadRequest(f"the model's chat template refused these messages: {e}", "messages") from e


def _has_template(tokenizer: Any) -> bool:
    inner = getattr(tokenizer, "_tokenizer", None)
    return getattr(inner, "chat_template", None) is not None


def render_continuation(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> Optional[str]:
    """What the template adds for `messages` after an earlier exchange, or None."""
    try:
        base = tokenizer.apply_chat_template(_PLACEHOLDER, tokenize=False)
        full = tokenizer.apply_chat_template(_PLACEHOLDER + messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception:
        return None
    return full[len(base):] if full.startswith(base) else None


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def chat_prompt(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True) -> Prompt:
    """The full conversation, plus its continuation for an explicit session that holds
    earlier turns (only the new messages are sent)."""
    msgs = _messages(messages)
    text = render(tokenizer, msgs, add_generation_prompt)
    cont = render_continuation(tokenizer, msgs, add_generation_prompt)
    return Prompt(encode(tokenizer, text), text, encode(tokenizer, cont) if cont is not None else None)


def completion_prompt(tokenizer: Any, req: CompletionRequest) -> Prompt:
    p = req.prompt
    if isinstance(p, list) and not p:
        raise BadRequest("the prompt is empty", "prompt")
    if isinstance(p, list) and isinstance(p[0], int):
        return Prompt(list(p), None, list(p))   # ids are checked against the vocabulary by the engine
    text = _text(p[0] if isinstance(p, list) else p, "prompt")
    if not text:
        raise BadRequest("the prompt is empty", "prompt")
    return Prompt(encode(tokenizer, text, special=True), None, encode(tokenizer, text))


def document_prompt(tokenizer: Any, text: str, role: str, raw: bool) -> Prompt:
    _text(text, "text")
    if raw:
        return Prompt(encode(tokenizer, text, special=True), None, encode(tokenizer, text))
    return chat_prompt(tokenizer, [ChatMessage(role=role, content=text)], add_generation_prompt=False)
