"""ASGI middleware: Host check, Origin check, API keys, request body limit. Errors go through errors.to_response."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Optional

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starlette.concurrency import run_in_threadpool

from .errors import ApiError, Forbidden, Unauthorized, for_path, to_response
from .logonce import warn_once
from .tokens import release_freed_memory

log = logging.getLogger("localheap.server")
RELEASE_AFTER_BYTES = 4 << 20

# every API route (tests/test_server_errors.py checks each one the app has); /health and the web
# page's files stay open
PROTECTED_PREFIXES = ("/v1/", "/api/", "/metrics", "/completion", "/infill", "/tokenize", "/detokenize",
                      "/apply-template", "/props", "/slots", "/docs", "/openapi.json")
class UnsupportedEncoding(ApiError):
    status, code = 415, "unsupported_content_encoding"


HELD_GETS = ("/v1/heap/events",)   # GETs that hold something while they last (a stream's observer slot)


OWNER = "localheap.owner"   # scope key: the id of the API key that authenticated the request
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def owner_id(api_key: str) -> str:
    """What a session records about the key that created it: a digest, never the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def request_owner(scope: Scope) -> Optional[str]:
    return scope.get(OWNER)


class RequireApiKey:
    """Bearer key on every API route (PROTECTED_PREFIXES); /health and the web page stay open. With several
    keys, the one that matched is recorded in the scope (sessions belong to it)."""

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        assert api_keys
        self.app = app
        self.expected = [(f"Bearer {k}".encode(), owner_id(k)) for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            # Anthropic's clients send the key as x-api-key (some send an Authorization header beside it,
            # for their own proxies): either one that matches will do, the Authorization header's first
            tried = [g for g in (given, b"Bearer " + headers[b"x-api-key"] if headers.get(b"x-api-key") else b"") if g]
            given = given or (tried[0] if tried else b"")
            owner = None
            for key in reversed(tried):
                for expected, who in self.expected:   # every key compared: the time says nothing about which
                    if hmac.compare_digest(key, expected):
                        owner = who
            if owner is None:
                message = ("missing API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
                           if not given else "incorrect API key")
                await for_path(scope["path"], to_response(Unauthorized(message)))(scope, receive, send)
                return
            scope[OWNER] = owner
        await self.app(scope, receive, send)


class CheckHost:
    """Refuse requests whose Host header names another site (DNS rebinding: a page on
    evil.example whose name resolves to 127.0.0.1 must not reach a loopback server).
    Accepted: localhost, 127.0.0.1, [::1] and the bound host, plus names the operator allowed
    (--allow-host: a proxy's name), on any port: what rebinding forges is the name (a page's own,
    which it cannot make "localhost"), while a Host naming this machine on another port comes
    through a forward of it (ssh -L 9000:localhost:8000, an editor's port forwarding)."""

    def __init__(self, app: ASGIApp, bound_host: str, extra: list[str] = ()):
        self.app = app
        bound = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.names = {n.lower() for n in (*LOOPBACK_NAMES, bound)}
        self.extra = {n.lower() for n in extra}

    def allowed(self, host: str) -> bool:
        name, _, given_port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
        if not name or not given_port.isdigit():   # no port in the header (the scheme's default)
            name = host
        name = name.lower()
        return name in self.names or name in self.extra

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").strip()
            if not self.allowed(host):
                log.warning("refused a request for Host %r (not this server's name; DNS rebinding?)", host)
                error = ApiError(f"unknown Host header {host!r}: this server answers only to "
                                 f"{', '.join(sorted(self.names | self.extra))} (see --allow-host)", code="invalid_host")
                await for_path(scope["path"], to_response(error))(scope, receive, send)
                return
        await self.app(scope, receive, send)


SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
WEB_SCHEMES = ("http", "https")


class CheckOrigin:
    """Refuse a request that can change something (any method but GET, HEAD and OPTIONS) sent by a
    web page of another site. A browser sends such a page's POST without asking first when its body
    is a form or text/plain (no CORS preflight): CORS only keeps the page from reading the answer,
    so without this any site the user visits could run generations on a server at localhost, or
    save and erase its slots. Allowed: no Origin header (SDKs, curl, other programs); the request's
    own origin (the Origin names the Host it was sent to, or the X-Forwarded-Host a reverse proxy
    passes on, which no page can set without a preflight: the web UI, however it is reached; where
    the server is bound to a name, CheckHost vouches for that name); the origins CORS allows
    (--cors-origin; `*`: every one); and origins that are not web pages (a browser extension's or
    an app's: chrome-extension://, moz-extension://, tauri://, ...), as Ollama allows them."""

    def __init__(self, app: ASGIApp, allowed: list[str]):
        self.app = app
        self.any = "*" in allowed
        self.allowed = {o.rstrip("/").lower() for o in allowed}

    def permits(self, origin: str, hosts: list[str]) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any or origin in self.allowed:
            return True
        scheme, sep, netloc = origin.partition("://")
        if not sep:   # "null": a sandboxed frame's or a file's page (--cors-origin null allows it)
            return False
        return scheme not in WEB_SCHEMES or netloc in {h.strip().lower() for h in hosts if h.strip()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        held = scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in HELD_GETS
        headers = dict(scope.get("headers") or ())
        if held:
            # a page of another site opening the stream (no CORS needed to start a GET: it cannot read it,
            # but it held one of the few observer slots, the web UI's refused): its Origin, where sent,
            # is checked as below; a browser's no-cors GET sends none, only Sec-Fetch-Site
            if headers.get(b"origin") is None and headers.get(b"sec-fetch-site", b"").lower() == b"cross-site":
                error = Forbidden("the heap event stream is refused to web pages of other sites (start the server "
                                  "with --cors-origin ORIGIN to allow one)", code="cross_origin_refused")
                await for_path(scope["path"], to_response(error))(scope, receive, send)
                return
        if scope["type"] == "http" and (scope["method"] not in SAFE_METHODS or held):
            origin = headers.get(b"origin")
            if origin is not None:
                origin_s = origin.decode("latin-1")
                hosts = [headers.get(b"host", b"").decode("latin-1"),
                         headers.get(b"x-forwarded-host", b"").decode("latin-1").split(",")[0]]
                if not self.permits(origin_s, hosts):
                    warn_once("refused requests from web pages of other sites (start the server with "
                              "--cors-origin ORIGIN to allow one): %s", [origin_s])
                    error = Forbidden(f"a {scope['method']} from the web page at {origin_s!r} (another site) is "
                                      f"refused: start the server with --cors-origin {origin_s} to allow "
                                      f"that page to use it", code="cross_origin_refused")
                    await for_path(scope["path"], to_response(error))(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class BodiesAreJson:
    """An API route's body is read as JSON whatever its Content-Type says (none, a form, text/plain),
    as llama-server and Ollama read theirs: `curl -d '{...}'` labels JSON a form, and a client
    told "Input should be a valid dictionary" would not guess why. (CheckOrigin keeps the web pages
    of other sites, whose form posts need no preflight, out.) Bodies that are not JSON are still
    refused as such."""

    RELABELLED = (b"", b"application/x-www-form-urlencoded", b"text/plain")

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS and \
                scope["path"].startswith(PROTECTED_PREFIXES):
            coding = dict(scope["headers"]).get(b"content-encoding", b"identity").strip().lower()
            if coding not in (b"", b"identity"):
                error = UnsupportedEncoding(f"request bodies are read as sent: Content-Encoding "
                                            f"{coding.decode('latin-1')!r} is not accepted (send the JSON uncompressed)")
                await for_path(scope["path"], to_response(error))(scope, receive, send)
                return
            kind = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind in self.RELABELLED:
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def checks_host(bound_host: str) -> bool:
    """A server bound to every interface was opened up on purpose: any name may reach it."""
    return bound_host not in WILDCARD_HOSTS


class LimitBody:
    """413 for bodies over max_bytes: at once from Content-Length, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> HTTPException:
        return HTTPException(413, f"request body too large: the limit is {self.max_bytes:,} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await for_path(scope["path"], to_response(self._error()))(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()   # FastAPI passes HTTPExceptions from body reading through
            return message

        try:
            await self.app(scope, limited, send)
        finally:
            if seen >= RELEASE_AFTER_BYTES:   # a large body leaves freed copies behind: hand them back
                await run_in_threadpool(release_freed_memory)
