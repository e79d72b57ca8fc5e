"""`localheap chat`: a terminal chat on the server's engine, one heap session, streamed replies.

Input: one line is one message. A line ending in a backslash continues on the next line;
a line holding only \"\"\" opens a block that the next such line closes. Commands start with /.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..engine.errors import RankLost
from ..generation import SamplingParams
from .common import (add_compile_arg, at_least, add_decode_arg, add_distributed_arg, add_graphs_arg, add_heap_args, add_model_args,
                     add_penalty_args, apply_decode_attention, check_heap_fits, freeze_startup_objects, heap_config,
                     load_model_backend, penalty_params, with_backend_chunk)
from .progress import ProgressBar

PROMPT, MORE = ">>> ", "... "
BLOCK = '"""'
HELP = f"""Type a message and press Enter; the reply streams in, then a one-line heap status.
  a line ending in \\       continues the message on the next line
  {BLOCK} on its own line    starts a multi-line message; another {BLOCK} line sends it
  /doc FILE               read a text file into the conversation (a progress bar shows the prefill)
  /status                 the heap status again
  /help                   this help
  /quit                   leave (also /exit, /bye, Ctrl-D)
Ctrl-C stops a reply or a document read; the conversation keeps what was read or said so far."""


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal on the heap, like `ollama run`",
                       description=__doc__)
    add_model_args(p)
    add_heap_args(p, recall=True)
    add_decode_arg(p)
    add_compile_arg(p)
    add_graphs_arg(p)
    p.add_argument("--system", default=None, help="system prompt of the conversation (default: none)")
    p.add_argument("--max-tokens", type=at_least(1), default=512, help="longest reply in tokens")
    p.add_argument("--temperature", type=float, default=0.7, help="0 samples greedily")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    add_penalty_args(p)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    add_distributed_arg(p, watched=True)
    p.set_defaults(func=run)


def read_message(read_line=input) -> str | None:
    """One message from the terminal (None at end of input); see the module docstring. Bytes that
    are not UTF-8 (Python reads them as lone surrogates) come as U+FFFD, as /doc reads a file."""
    text = _message(read_line)
    return None if text is None else text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _message(read_line) -> str | None:
    try:
        line = read_line(PROMPT)
    except EOFError:
        return None
    if line.strip() == BLOCK:
        lines = []
        while (line := _more(read_line)) is not None and line.strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = _more(read_line)
        if line is None:
            return "\n".join(lines)
    lines.append(line)
    return "\n".join(lines)


def _more(read_line) -> str | None:
    try:
        return read_line(MORE)
    except EOFError:
        return None


def run(args) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    cfg = heap_config(args)   # bad flags fail before the model loads
    SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if sys.stdin is None or sys.stdin.closed:   # (`<&-`: Python starts without one)
        raise ValueError("chat reads its messages from standard input, which is closed; give it a terminal or "
                         "a file (localheap chat < messages.txt)")
    print("loading the model...", file=sys.stderr, flush=True)
    if args.distributed:   # rank 0 chats on a Leader; the other ranks follow its heap calls
        from ..backends.mlx.leader import Leader
        from . import ranks

        backend = ranks.load_rank(args)
        apply_decode_attention(backend, args)
        beat = ranks.heartbeat(backend, args.rank_timeout, args.step_timeout)
        if backend.rank != 0:
            return ranks.follower(backend, None, beat)
        backend = Leader(backend, heartbeat=beat)
        ranks.lead(backend, beat, args.step_timeout)   # a rank gone or stuck mid-reply: rank 0 says so, exits
    else:
        backend = load_model_backend(args)
        apply_decode_attention(backend, args, batched=True)
    cfg = with_backend_chunk(cfg, args, backend)
    check_heap_fits(backend, cfg)
    try:
        return chat_on(backend, cfg, args)
    finally:
        if args.distributed:
            backend.stop()


def chat_on(backend, cfg, args) -> int:
    from .chat_engine import ChatEngine

    chat = ChatEngine(backend, cfg, system=args.system)
    if args.distributed:
        backend.root = chat.store.spill_dir   # the followers keep their pages under their own temp dir
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, **penalty_params(args, getattr(backend, "tokenizer", None)))
    print(f"localheap chat: {backend.model_name} on {backend.name} | heap {cfg.sinks} sinks + {cfg.budget} "
          f"budget + {cfg.slack} slack, policy {cfg.policy} | /help for commands, /quit to leave", flush=True)
    freeze_startup_objects()
    try:
        while True:
            try:
                text = read_message()
            except KeyboardInterrupt:   # Ctrl-C at the prompt: a fresh prompt, like a shell
                print()
                continue
            if text is None:
                print()
                return 0
            if not text.strip():
                continue
            try:
                if not _handle(chat, text.strip(), params):
                    return 0
            except KeyboardInterrupt:
                print("\n[stopped]", flush=True)
                print(chat.status(), flush=True)
            except RankLost as e:   # --distributed: the ranks cannot go on (a stuck reply exits in ranks.lead)
                print(f"\nerror: {e}", flush=True)
                return 1
            except Exception as e:   # one failed request never ends the chat
                print(f"\nerror: {type(e).__name__}: {e}", flush=True)
                if chat.ensure_session():
                    print("the conversation was lost with it; a new one starts", flush=True)
    finally:
        chat.close()


def _handle(chat, text: str, params: SamplingParams) -> bool:
    """Run one message or command; False to leave."""
    from ..errors import UserError

    command, _, rest = text.partition(" ") if text.startswith("/") else ("", "", "")
    if command in ("/quit", "/exit", "/bye"):
        return False
    if command == "/help":
        print(HELP)
    elif command == "/status":
        print(chat.status())
    elif command == "/doc":
        _read_document(chat, rest.strip())
    elif command:
        print(f"unknown command {command}; /help lists them")
    else:
        try:
            reply = chat.ask(text, params, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        except UserError as e:
            print(f"error: {e}")
            return True
        usage = reply.finished.usage
        print()
        print(f"[{chat.status()} | reply {usage.completion_tokens} tokens, {reply.tokens_per_s:.1f} tok/s | "
              f"prompt {usage.prompt_tokens:,} tokens, {usage.cached_tokens:,} reused]", flush=True)
    return True


def _read_document(chat, name: str) -> None:
    if not name:
        print("usage: /doc FILE")
        return
    path = Path(name).expanduser()
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        print(f"cannot read {path}: {e.strerror or e}")
        return
    if not text.strip():
        print(f"{path} is empty")
        return
    if "\0" in text:   # (as the web page's document dialog: an image, a PDF, an archive)
        print(f"{path} does not look like plain text (it holds NUL bytes); /doc reads text files")
        return
    bar = ProgressBar(f"reading {path.name}", stream=sys.stdout)
    try:
        done = chat.read(text, bar.update)
    finally:
        bar.close()
    print(f"[read {done.usage.prompt_tokens - done.usage.cached_tokens:,} tokens from {path.name} | "
          f"{chat.status()}]", flush=True)
