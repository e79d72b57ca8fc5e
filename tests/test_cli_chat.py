"""`localheap chat` driven through a pseudo-terminal (pexpect) on the bundled demo model:
help, a document read with a progress bar, answers with a heap status line, multi-line input."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

from localheap.commands.chat import read_message  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STATUS = re.compile(r"\[heap: tokens seen ([\d,]+) .*?\| reply (\d+) tokens.*?"
                    r"\| prompt ([\d,]+) tokens, ([\d,]+) reused\]")


def number(text: str) -> int:
    return int(text.replace(",", ""))


def lines(*typed):
    it = iter(typed)

    def read_line(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read_line


def test_multi_line_input_rules():
    assert read_message(lines("hello")) == "hello"
    assert read_message(lines("first \\", "second \\", "third")) == "first \nsecond \nthird"
    assert read_message(lines('"""', "a", "", "b", '"""', "not read")) == "a\n\nb"
    assert read_message(lines()) is None
    assert read_message(lines('"""', "unterminated")) == "unterminated"
    # bytes that are not UTF-8 (Python reads them as lone surrogates): U+FFFD, which tokenizers encode
    assert read_message(lines(b"caf\xe9 \xff".decode("utf-8", "surrogateescape"))) == "caf\ufffd \ufffd"


def test_chat_reads_a_document_and_answers(tmp_path):
    doc = tmp_path / "rooms.txt"
    doc.write_text(" ".join(f"Room {i} keeps the code word blue{i}." for i in range(40)))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    child = pexpect.spawn(sys.executable, ["-m", "localheap.cli", "chat", "--temperature", "0", "--max-tokens", "12",
                                           "--budget", "64", "--recent", "16", "--slack", "32"],
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=180, dimensions=(40, 120))
    try:
        child.expect(r"localheap chat: demo on \w+")
        child.expect_exact(">>> ")
        child.sendline("/help")
        child.expect_exact("/doc FILE")
        child.expect_exact(">>> ")
        binary = tmp_path / "image.png"
        binary.write_bytes(bytes(range(256)) * 4)
        child.sendline(f"/doc {binary}")   # refused, as the web page's dialog refuses it
        child.expect_exact("does not look like plain text")
        child.expect_exact(">>> ")
        child.sendline(f"/doc {doc}")
        child.expect(r"reading rooms\.txt.*100%")
        child.expect(r"\[read ([\d,]+) tokens from rooms\.txt \| heap: tokens seen ([\d,]+) .*evicted ([\d,]+)")
        read, seen, evicted = (number(g) for g in child.match.groups())
        assert read == seen > 64 + 32 and evicted > 0     # the document streamed through a smaller heap
        child.expect_exact(">>> ")

        child.sendline("Which word is in room 7?")
        child.expect(STATUS)
        seen, reply_tokens, prompt, reused = (number(g) for g in child.match.groups())
        answer = child.before.split("room 7?", 1)[1].strip()
        assert answer and reply_tokens >= 1, child.before   # it answered, streamed before the status
        assert reused == read and seen >= prompt > read     # the document was not read again
        child.expect_exact(">>> ")

        child.sendline('"""')
        child.sendline("First line of a longer message,")
        child.sendline("and its second line.")
        child.sendline('"""')
        child.expect(STATUS)
        assert number(child.match.group(4)) >= seen       # the whole conversation so far was reused
        child.expect_exact(">>> ")
        child.sendline("one line \\")
        child.sendline("continued")
        child.expect(STATUS)
        child.expect_exact(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_the_system_prompt_opens_the_conversation_when_a_document_comes_first(torch_one_thread):
    """`chat --system S`: S is the session's first message whether the conversation opens with a
    question or with /doc (a document read first left S out for good)."""
    from localheap.commands.chat_engine import ChatEngine
    from localheap.generation import SamplingParams
    from localheap.heap import HeapConfig
    from localheap.models import demo_model_dir, load_backend

    backend = load_backend(str(demo_model_dir()), "torch")
    system = "You answer in exactly one word."
    for first in ("read", "ask"):
        chat = ChatEngine(backend, HeapConfig(budget=512, recent=16, slack=32), system=system)
        try:
            if first == "read":
                chat.read("Room 7 keeps the code word blue.", lambda done, total: None)
            chat.ask("Which word is in room 7?", SamplingParams(max_tokens=2, temperature=0.0), lambda _: None)
            text = backend.tokenizer.decode(list(chat.session.fed))
            assert text.count(system) == 1 and text.index(system) < text.index("Which word"), (first, text)
        finally:
            chat.close()
