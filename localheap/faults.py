"""A fault hook for crash tests: LOCALHEAP_FAULT="<step>[:n]" kills the process (SIGKILL, as
kill -9 would) the n-th time (default: the first) the named write step completes.

Steps (each is called just after its write is durable, so "after X" is "before the next one"):
  pages.write       a page record written (a document read, a spill of evicted tokens)
  pages.state       the page store's state file of a save renamed into place
  save.heap         a session's heap file renamed into place
  save.tokens       its token file renamed into place
  save.index        index.json renamed into place (the commit point of a turn)
  save.prune        the previous turn's files removed (the end of a save)
  index             any other index commit (a session created, titled, deleted)
  checkpoint.tokens a checkpoint's token file written
  checkpoint.pages  a checkpoint's links of the page store and its state written
  checkpoint.heap   a checkpoint's heap file renamed into place

Unset (the normal case) a step costs one comparison. Read once, at import.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

_SPEC = os.environ.get("LOCALHEAP_FAULT", "")
_STEP, _, _N = _SPEC.partition(":")
_AT: Optional[int] = (int(_N) if _N.isdigit() else 1) if _STEP else None
_seen: dict = {}


def step(name: str) -> None:
    """A write step completed: with LOCALHEAP_FAULT naming it (for the n-th time), die here."""
    if _AT is None or name != _STEP:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == _AT:
        os.kill(os.getpid(), signal.SIGKILL)
