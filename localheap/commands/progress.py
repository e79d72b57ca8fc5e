"""A dependency-free progress bar for long prefill and benchmarks (stderr)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, label: str, stream=None, width: int = 30):
        self.label, self.width = label, width
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        frac = done / total if total else 1.0
        fill = int(frac * self.width)
        rate = done / max(now - self.t0, 1e-9)
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] "
                          f"{done:,}/{total:,} tokens {rate:,.0f} tok/s")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
