"""Typed engine errors (mapped to HTTP once, in server/errors.py)."""

from __future__ import annotations


class Overloaded(RuntimeError):
    """Too many requests in flight; retry later."""

    def __init__(self, in_flight: int, limit: int, retry_after: float = 1.0):
        super().__init__(f"server overloaded: {in_flight} requests in flight (limit {limit}); retry later")
        self.retry_after = retry_after


class OverBudget(RuntimeError):
    """A session's heap does not fit the RAM budget right now (every resident heap is busy)."""

    def __init__(self, reason: str, retry_after: float = 2.0):
        super().__init__(reason)
        self.retry_after = retry_after


class EngineStopped(RuntimeError):
    def __init__(self) -> None:
        super().__init__("the engine is shutting down")


class EngineFailed(RuntimeError):
    """The engine thread stopped on an internal error; the server is exiting."""

    def __init__(self) -> None:
        super().__init__("the engine stopped after an internal error; the server is restarting, retry shortly")


class InvalidTokens(ValueError):
    """Token ids outside the model's vocabulary (a client error: 400, the session untouched)."""

    def __init__(self, token: int, vocab_size: int):
        super().__init__(f"token id {token} is out of range: this model's ids are 0..{vocab_size - 1}")


class RankLost(RuntimeError):
    """A rank of a model sharded across processes (--distributed) is gone: nothing can run until
    every rank is restarted."""

    heap_file_intact = True   # a restore it stops keeps the session's saved copy (store.restore)


class RankFailed(RuntimeError):
    """A heap call failed on another rank of a sharded model (--distributed) while it went
    through on rank 0; every rank dropped what that call made, and the ranks go on."""

    def __init__(self, rank: int, op: str, error: str):
        super().__init__(f"rank {rank} failed the {op} step of this request ({error}); the request was "
                         f"rolled back on every rank: retry it (rank {rank}'s log has the traceback)")
        self.rank, self.op, self.error = rank, op, error

    heap_file_intact = True   # a restore that fails so keeps the session's saved copy (store.restore)
