"""Typed errors users see. The server maps them to HTTP in server/errors.py; the CLI prints them."""

from __future__ import annotations

from .heap import HeapConfigError
from .models import ModelNotFound
from .sessions import SpillFailed

UserError = (HeapConfigError, ModelNotFound, ValueError, FileNotFoundError, SpillFailed)
