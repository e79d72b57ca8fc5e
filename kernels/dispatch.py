"""Kernel dispatch with a self-check: the fused kernel runs only after it agreed with its reference.

Framework-agnostic (no torch, no mlx imports). On the first call for a key (device,
dtype, ...) the kernel and the reference both run on the caller's inputs and are
compared; a kernel that fails to compile, raises, or disagrees is switched off for
that key with one log line, and the reference answers from then on.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable

log = logging.getLogger("localheap.kernels")


class CheckedKernel:
    def __init__(self, name: str, kernel: Callable[..., Any], reference: Callable[..., Any],
                 agree: Callable[[Any, Any, Hashable], bool]):
        self.name = name
        self.kernel = kernel
        self.reference = reference
        self.agree = agree                       # (kernel result, reference result, key) -> bool
        self.verdicts: dict[Hashable, bool] = {}  # key -> kernel trusted?

    def __call__(self, key: Hashable, *args):
        verdict = self.verdicts.get(key)
        if verdict is False:
            return self.reference(*args)
        try:   # a raising kernel is switched off; lazy frameworks raise in the comparison
            got = self.kernel(*args)
            if verdict is True:
                return got
            want = self.reference(*args)
            ok = bool(self.agree(got, want, key))
        except Exception as e:  # compile errors come in many types
            self.verdicts[key] = False
            log.warning("%s kernel failed for %s (%s: %s); using the reference", self.name, key, type(e).__name__, e)
            return self.reference(*args)
        self.verdicts[key] = ok
        if not ok:
            log.warning("%s kernel disagrees with the reference for %s; using the reference", self.name, key)
            return want
        log.info("%s kernel verified for %s", self.name, key)
        return got

    def trusted(self, key: Hashable) -> bool | None:
        """True/False once checked for `key`, None before."""
        return self.verdicts.get(key)
