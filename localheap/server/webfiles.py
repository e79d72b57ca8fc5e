"""The web UI's static files, mounted at `/`: the UI's own files only, and unknown paths
answer 404 for every method.

Starlette's StaticFiles answers any method but GET/HEAD with 405 before it looks the path up,
so a POST to a mistyped API path (which falls through to this mount) read as 405, not 404.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import anyio
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount
from starlette.types import Scope


def _other_method_routed(scope: Scope) -> bool:
    routes = getattr(getattr(scope.get("app"), "router", None), "routes", [])
    return any(isinstance(r, BaseRoute) and not isinstance(r, Mount) and r.matches(scope)[0] == Match.PARTIAL
               for r in routes)


class WebFiles(StaticFiles):
    """The UI's own files only: pages, scripts, styles, images, fonts; never the package's
    Python files, caches or dotfiles that sit beside them (404, as for a missing file)."""

    SERVED = {".html", ".js", ".mjs", ".css", ".svg", ".png", ".ico", ".webp", ".woff2", ".json", ".map"}

    async def get_response(self, path: str, scope: Scope) -> Response:
        parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
        hidden = any(p.startswith((".", "_")) for p in parts)
        folder = not parts or (Path(str(self.directory)) / "/".join(parts)).is_dir()   # -> its index.html
        if hidden or not (folder or Path(parts[-1]).suffix.lower() in self.SERVED):
            raise HTTPException(status_code=405 if _other_method_routed(scope) else 404)
        if scope["method"] not in ("GET", "HEAD") and not await self._exists(path):
            # a known API path with another method fell through to this mount: that is a 405
            raise HTTPException(status_code=405 if _other_method_routed(scope) else 404)
        return await super().get_response(path, scope)   # 405 for files that exist

    async def _exists(self, path: str) -> bool:
        _, found = await anyio.to_thread.run_sync(self.lookup_path, path)
        if found is None:
            return False
        if stat.S_ISDIR(found.st_mode):   # html mode serves a directory's index.html
            index, _ = await anyio.to_thread.run_sync(self.lookup_path, os.path.join(path, "index.html"))
            return bool(index)
        return True
