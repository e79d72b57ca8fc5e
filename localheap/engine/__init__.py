"""The engine: one thread that owns the backend and every session (see engine.py)."""

from .engine import Engine, wait_idle
from .errors import EngineFailed, EngineStopped, InvalidTokens, OverBudget, Overloaded, RankFailed, RankLost
from .events import Delta, Emit, Event, Failed, Feed, Finished, Generate, Job, Progress, Started, Usage
from .governor import AdmitAll, Governor

__all__ = ["AdmitAll", "Delta", "Emit", "Engine", "EngineFailed", "EngineStopped", "Event", "Failed", "Feed",
           "Finished", "Generate", "Governor", "InvalidTokens", "Job", "OverBudget", "Overloaded", "Progress",
           "RankFailed", "RankLost", "Started", "Usage", "wait_idle"]
