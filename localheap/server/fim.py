"""Fill in the middle: a completion's `suffix` (OpenAI's /v1/completions, Ollama's /api/generate).

Code models trained to fill a gap carry three special tokens, and read the text before the
cursor and the text after it in the order prefix, suffix, middle (PSM); the reply is the middle.
The server recognises the models by those tokens in their vocabulary, as llama.cpp does; a model
without them answers 400, as Ollama does for a model whose template has no suffix."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Optional

from ..sessions import Prompt
from .errors import BadRequest, PromptTooLong
from .tokens import encode_bounded, leading_specials, token_array

# (prefix, suffix, middle) spellings, each family's own
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),      # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),            # StarCoder, StarCoder2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),          # DeepSeek-Coder
)
# tokens such models write when the middle is done (besides their EOS): the reply stops there
FIM_ENDS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<fim_pad>", "<file_sep>",
            "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|file_separator|>")   # (the last: CodeGemma's)


@dataclass(frozen=True)
class FimFormat:
    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]   # FIM_ENDS the vocabulary has


def fim_format(tokenizer: Any) -> Optional[FimFormat]:
    """The model's fill-in-the-middle tokens (cached on the tokenizer), None when it has none."""
    cached = getattr(tokenizer, "_localheap_fim", False)
    if cached is not False:
        return cached
    try:
        vocab = tokenizer.get_vocab()
    except Exception:   # a tokenizer that cannot list its vocabulary: no FIM
        vocab = {}
    found = None
    for names in FIM_TOKENS:
        if all(n in vocab for n in names):
            found = FimFormat(*(int(vocab[n]) for n in names), tuple(int(vocab[n]) for n in FIM_ENDS if n in vocab))
            break
    try:
        tokenizer._localheap_fim = found
    except AttributeError:
        pass
    return found


def require_fim(tokenizer: Any, param: str, instead: str) -> FimFormat:
    """The model's FIM tokens; a 400 naming `param` for a model without them (`instead`: what to send)."""
    fmt = fim_format(tokenizer)
    if fmt is None:
        raise BadRequest("this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <fim_prefix> or "
                         f"<｜fim▁begin｜>): {instead}", param)
    return fmt


def fim_ids(tokenizer: Any, fmt: FimFormat, prefix: str, suffix: str, limit: Optional[int],
            params: tuple[str, str] = ("prompt", "suffix"), specials: bool = True) -> array:
    """<prefix> PREFIX <suffix> SUFFIX <middle> (PSM): the model writes what goes between
    (`specials` False: a special token's text in PREFIX or SUFFIX is text)."""
    before = encode_bounded(tokenizer, prefix, limit, params[0], specials)
    after = encode_bounded(tokenizer, suffix, limit, params[1], specials)
    return token_array([fmt.prefix]) + before + token_array([fmt.suffix]) + after + token_array([fmt.middle])


def fim_prompt(tokenizer: Any, prefix: str, suffix: str, limit: Optional[int], param: str = "suffix") -> Prompt:
    """[BOS] <prefix> PREFIX <suffix> SUFFIX <middle>. A 400 for a model without FIM tokens."""
    fmt = require_fim(tokenizer, param, "it cannot complete with a suffix; send the prompt alone")
    body = fim_ids(tokenizer, fmt, prefix, suffix, limit, ("prompt", param))
    if limit is not None and len(body) > limit:
        raise PromptTooLong(limit, len(body), "prompt")
    return Prompt(token_array(leading_specials(tokenizer)) + body, None, body)
