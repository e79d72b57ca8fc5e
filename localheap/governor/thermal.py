"""The machine's thermal state, read where the OS exposes it; 'unknown' otherwise.

States follow macOS's ProcessInfo.thermalState: nominal, fair, serious, critical.
Never raises: a sensor that cannot be read gives 'unknown'.
"""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

STATES = ("nominal", "fair", "serious", "critical", "unknown")


def from_temperature(temp_c: float, critical_c: float) -> str:
    """Map a temperature against its critical trip point to a state."""
    if critical_c <= 0:
        return "unknown"
    ratio = temp_c / critical_c
    if ratio >= 0.95:
        return "critical"
    if ratio >= 0.85:
        return "serious"
    if ratio >= 0.70:
        return "fair"
    return "nominal"


def from_macos_speed_limit(pmset_output: str) -> str:
    """`pmset -g therm` prints CPU_Speed_Limit = N (100 = unthrottled)."""
    for line in pmset_output.splitlines():
        if "CPU_Speed_Limit" in line:
            try:
                limit = int(line.split("=")[1].strip())
            except (IndexError, ValueError):
                return "unknown"
            if limit >= 100:
                return "nominal"
            if limit >= 80:
                return "fair"
            if limit >= 50:
                return "serious"
            return "critical"
    return "nominal" if "No thermal warning level has been recorded" in pmset_output else "unknown"


def read_linux_sysfs(root: str = "/sys/class/thermal") -> str:
    """Hottest zone against its critical trip point (millidegrees in sysfs)."""
    worst = "unknown"
    order = {s: i for i, s in enumerate(("unknown", "nominal", "fair", "serious", "critical"))}
    for zone in glob.glob(f"{root}/thermal_zone*"):
        try:
            temp = int(Path(zone, "temp").read_text()) / 1000
            crit = None
            for trip in glob.glob(f"{zone}/trip_point_*_type"):
                if Path(trip).read_text().strip() == "critical":
                    crit = int(Path(trip.replace("_type", "_temp")).read_text()) / 1000
            state = from_temperature(temp, crit if crit else 100.0)
        except (OSError, ValueError):
            continue
        if order[state] > order[worst]:
            worst = state
    return worst


def read_psutil() -> str:
    try:
        import psutil
        sensors = psutil.sensors_temperatures() if hasattr(psutil, "sensors_temperatures") else {}
    except Exception:
        return "unknown"
    best = "unknown"
    order = {s: i for i, s in enumerate(("unknown", "nominal", "fair", "serious", "critical"))}
    for entries in sensors.values():
        for e in entries:
            state = from_temperature(e.current, e.critical or 100.0)
            if order[state] > order[best]:
                best = state
    return best


def read_macos(run: Callable[..., str] = None) -> str:
    run = run or (lambda: subprocess.run(["pmset", "-g", "therm"], capture_output=True, text=True, timeout=2).stdout)
    try:
        return from_macos_speed_limit(run())
    except Exception:
        return "unknown"


def read_thermal_state(platform: Optional[str] = None) -> str:
    """Best available reading for this machine; 'unknown' when nothing can be read."""
    platform = platform or sys.platform
    try:
        if platform == "darwin":
            return read_macos()
        if platform.startswith("linux"):
            state = read_linux_sysfs()
            return state if state != "unknown" else read_psutil()
    except Exception:
        pass
    return "unknown"
