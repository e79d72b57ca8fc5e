"""FastAPI server: OpenAI routes, session routes, heap event stream, /health, /metrics.

Never touches tensors: it tokenizes requests and talks to the engine through queues.
"""

from .app import create_app
from .settings import ServerSettings, parse_bytes

__all__ = ["ServerSettings", "create_app", "parse_bytes"]
