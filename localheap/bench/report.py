"""Table + JSON-line output shared by every benchmark."""

from __future__ import annotations

import json
import math
import platform
import sys
from typing import Sequence


def environment() -> dict:
    return {"python": platform.python_version(), "machine": platform.machine(), "system": platform.system()}


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _finite(value):
    """`value` with NaN and infinities as None: the JSON line is JSON (JSON.parse refuses NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def emit(name: str, text: str, payload: dict, out=None) -> None:
    out = out or sys.stdout   # looked up per call: a stream bound at import time may be closed since
    print(text, file=out)
    print(json.dumps(_finite({"bench": name, **payload, "env": environment()}), sort_keys=True, allow_nan=False),
          file=out)
    out.flush()
