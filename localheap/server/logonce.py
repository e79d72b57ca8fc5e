"""Warnings about what clients send that the server leaves out or ignores: each name once per
process, since a client sends the same fields on every request. Bounded: a name is logged cut to
NAME_CHARS, a line holds at most NAMES of them, and each message remembers at most SEEN names (a
client inventing names grew the log 130 MB and the memory 150 MB in ten requests); past that the
message is logged once more, saying so, and no more."""

from __future__ import annotations

import logging
from typing import Iterable

log = logging.getLogger("localheap.server")
_SEEN: dict[str, set[str]] = {}
NAME_CHARS = 80
NAMES = 20
SEEN = 1000
FULL = "\0full"


def warn_once(message: str, names: Iterable[str]) -> None:
    """Log `message` (a %s for the names, comma-separated) with the names not logged under it yet."""
    seen = _SEEN.setdefault(message, set())
    if FULL in seen:
        return
    fresh = [n for n in dict.fromkeys(_short(str(n)) for n in names) if n not in seen]
    if not fresh:
        return
    if len(seen) + len(fresh) > SEEN:
        seen.add(FULL)   # (more than SEEN: nothing more is logged for this message)
        log.warning(message, f"{', '.join(fresh[:NAMES])}, ... (more names than this server logs: no more are)")
        return
    seen.update(fresh)
    log.warning(message, ", ".join(fresh[:NAMES]) + (f", and {len(fresh) - NAMES} more" if len(fresh) > NAMES else ""))


def _short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS] + "..."
