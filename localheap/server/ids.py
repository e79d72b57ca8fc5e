"""The random parts of the ids a reply's items and calls get (msg_..., call_...): secrets', or,
in a background response's task, a generator seeded by the response's id, so that reading its
kept reply again (routes/responses: a run after a restart goes on from it) gives each item the
id it was sent with."""

from __future__ import annotations

import random
import secrets
from contextvars import ContextVar
from typing import Optional, Sequence

SOURCE: ContextVar[Optional[random.Random]] = ContextVar("localheap_id_source", default=None)


def hex_id(nbytes: int) -> str:
    """`nbytes` random bytes as hex."""
    source = SOURCE.get()
    if source is None:
        return secrets.token_hex(nbytes)
    return source.getrandbits(8 * nbytes).to_bytes(nbytes, "big").hex()


def choice(options: Sequence[str]) -> str:
    source = SOURCE.get()
    return secrets.choice(options) if source is None else source.choice(options)


def seeded(key: str) -> random.Random:
    """The id source of the background response `key` (the same ids, in the same order, each run)."""
    return random.Random(key)
