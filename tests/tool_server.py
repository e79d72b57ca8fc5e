"""What the server tests of tool calls share (the OpenAI, Responses and Anthropic routes): a tiny
torch model carrying a Qwen-style template, served in a thread. The `force` fixture (conftest.py)
forces a reply's tokens: a random model will not choose to call a tool."""

from __future__ import annotations

import re

from family_templates import QWEN, with_template
from localheap.heap import HeapConfig
from localheap.server import ServerSettings, create_app
from localheap.server.testing import ServerThread

HEAP = HeapConfig(budget=64, slack=32, recent=16)
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
        "required": ["city"], "additionalProperties": False}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


NEST_LARK = """
// two or three lines, each a word between quotes or a bracketed pair of such items
start: item (LF item)~1..2
item: "\\"" WORD "\\"" | "[" item ("," item)? "]"
WORD: /[a-z]{1,5}/
%import common.LF
"""


def nested(text: str) -> bool:
    """Whether `text` is in NEST_LARK's language (not a regular one: brackets are read innermost first)."""
    item = r'"[a-z]{1,5}"'
    while True:
        inner = re.sub(r"\[%s(?:,%s)?\]" % (item, item), '"x"', text)
        if inner == text:
            return re.fullmatch(r"%s(?:\n%s){1,2}" % (item, item), text) is not None
        text = inner


def serve(model_dir, heap=HEAP, **settings) -> ServerThread:
    from localheap.models import load_backend

    app = create_app(load_backend(str(model_dir), "torch"), ServerSettings(heap=heap, web_dir=None, **settings))
    return ServerThread(app)


def qwen_model(model_dirs, tmp_path_factory):
    """The tiny qwen2 model with the Qwen-style template."""
    return with_template(model_dirs("qwen2"), tmp_path_factory.mktemp("qwen") / "m", QWEN)
