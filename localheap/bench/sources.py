"""Filler text the demo model never trained on: what ships with the OS and with installed packages.

The demo model learned from Python's own docs (bench/facts.corpus); a bench whose filler is
only that corpus can be tuned to it. These sources are other kinds of English text found on
any Debian-like machine with this package installed: licence and copyright texts, manual
pages (troff stripped), and the comment blocks of installed Python packages' source. Each is
read in sorted path order up to MAX_CHARS, so a machine gives the same text every run.
Knows no tokenizer and no tensors: it returns strings.
"""

from __future__ import annotations

import gzip
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

SOURCES = ("licenses", "man", "comments")
MAX_CHARS = 1_500_000    # ~400K demo tokens: more than a 64K window, read in a few seconds
MIN_CHARS = 100_000      # less than this and the source is not on this machine: say so
MIN_DOC = 200            # shorter pieces (headers, one-line comments) are dropped


class SourceUnavailable(ValueError):
    """A filler source has too little text on this machine."""


def _collect(paths, read) -> tuple[str, ...]:
    texts, total, seen = [], 0, set()
    for path in paths:
        try:
            pieces = read(path)
        except (OSError, UnicodeDecodeError, EOFError, ValueError):
            continue
        for t in pieces:
            t = t.strip()
            if len(t) >= MIN_DOC and t not in seen:   # licences repeat verbatim across packages
                seen.add(t)
                texts.append(t)
                total += len(t)
        if total >= MAX_CHARS:
            break
    return tuple(texts)


def _licenses() -> tuple[str, ...]:
    """/usr/share/common-licenses, then the packages' copyright files (/usr/share/doc/*/copyright)."""
    common = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())
    copyright = sorted(Path("/usr/share/doc").glob("*/copyright"))
    return _collect(common + copyright, lambda p: re.split(r"\n\s*\n", p.read_text(encoding="utf-8")))


_TROFF_TEXT = re.compile(r"^\.(?:B|I|BR|RB|BI|IB|IR|RI|SH|SS|TP|IP|SM)\b\s*")
_TROFF_ESC = re.compile(r"\\[hvwo]'[^']*'|\\f(?:\[[^\]]*\]|\(..|.)|\\\(..|\\\[[^\]]*\]|\\s[+-]?\d+|\\[&|^%~ ec-]|\\\*.")


def _man_text(path: Path) -> list[str]:
    """A manual page's paragraphs as plain text: macro lines dropped (text-bearing ones kept), escapes removed."""
    raw = (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")).read()
    paras, cur = [], []
    for line in raw.splitlines():
        if line.startswith((".", "'")):
            m = _TROFF_TEXT.match(line)
            if line[1:3] in ("PP", "SH", "LP", "P ", "SS", "TP", "IP") or line.strip() == ".P":
                paras.append(" ".join(cur)), cur.clear()
            if not m:
                continue
            line = line[m.end():].replace('"', "")
        line = _TROFF_ESC.sub("", line).strip()
        if line:
            cur.append(line)
    paras.append(" ".join(cur))
    return paras


def _man() -> tuple[str, ...]:
    """English manual pages (/usr/share/man/man1..8), sections in order."""
    pages = sorted(p for s in range(1, 9) for p in Path(f"/usr/share/man/man{s}").glob("*")
                   if p.is_file() and not p.is_symlink())
    return _collect(pages, _man_text)


def _comment_blocks(path: Path) -> list[str]:
    """Runs of >= 3 consecutive '#' comment lines, joined: the prose of a source file."""
    blocks, cur = [], []
    for line in path.read_text(encoding="utf-8").splitlines() + [""]:
        s = line.strip()
        if s.startswith("#") and not s.startswith("#!"):
            cur.append(s.lstrip("#").strip())
        else:
            if len(cur) >= 3:
                blocks.append(" ".join(c for c in cur if c))
            cur = []
    return blocks


def _comments() -> tuple[str, ...]:
    """Comment blocks of the installed packages' Python source (site-packages; not the stdlib,
    whose docstrings are the training corpus)."""
    root = Path(sysconfig.get_paths()["purelib"])
    return _collect(sorted(root.rglob("*.py")), _comment_blocks)


@lru_cache(maxsize=None)
def texts(kind: str) -> tuple[str, ...]:
    """The documents of one source; SourceUnavailable when the machine has too little of it."""
    read = {"licenses": _licenses, "man": _man, "comments": _comments}.get(kind)
    if read is None:
        raise ValueError(f"unknown filler source {kind!r}; one of {', '.join(SOURCES)}")
    docs = read()
    if sum(map(len, docs)) < MIN_CHARS:
        raise SourceUnavailable(f"filler source {kind!r}: only {sum(map(len, docs)):,} characters on this machine "
                                f"(need {MIN_CHARS:,})")
    return docs
