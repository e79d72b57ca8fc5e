"""Progress bars for long prefill, document reads and benchmarks: tqdm behind the
`update(done, total)` callback the backends and the engine call."""

from __future__ import annotations

import sys
from typing import Optional

from tqdm import tqdm


class ProgressBar:
    """update(done, total) with absolute counts; the bar is created at the first call, when
    the total is known, and drawn on stderr (stdout stays the generated text)."""

    def __init__(self, label: str, stream=None, unit: str = "tok"):
        self.label, self.unit = label, unit
        self.stream = stream or sys.stderr
        self.bar: Optional[tqdm] = None

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.label, unit=self.unit, unit_scale=True, file=self.stream,
                            leave=True, dynamic_ncols=True, mininterval=0.2)
        if total != self.bar.total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
