"""Warnings about what clients send that the server leaves out or ignores: each name once per
process, since a client sends the same fields on every request."""

from __future__ import annotations

import logging
from typing import Iterable

log = logging.getLogger("localheap.server")
_SEEN: dict[str, set[str]] = {}


def warn_once(message: str, names: Iterable[str]) -> None:
    """Log `message` (a %s for the names, comma-separated) with the names not logged under it yet."""
    seen = _SEEN.setdefault(message, set())
    fresh = [n for n in dict.fromkeys(names) if n not in seen]
    if fresh:
        seen.update(fresh)
        log.warning(message, ", ".join(fresh))
