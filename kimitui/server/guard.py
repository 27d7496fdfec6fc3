"""What a request meets before any route: the Host and Origin checks (DNS rebinding, pages of
other sites) with the report of every request, then the API key, JSON bodies only and the body
size limit. Both answer in the API's own error shape."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import time
from typing import Callable

from starlette.datastructures import Headers
from starlette.responses import Response

from kimitui.server.errors import error_response
from kimitui.server.params import ApiError
from kimitui.server.runner import is_loopback

log = logging.getLogger("kimitui.server")

# Reachable without a key, as in llama-server: load balancers probe /health, and clients list
# the models before they know which key goes where.
OPEN_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models"})
TOO_LARGE = "request body too large"
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def _host_name(header: str) -> str:
    """The name or address in a Host header, without its port."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    name, colon, port = header.rpartition(":")
    return (name if colon and port.isdigit() else header).rstrip(".")


def host_allowed(header: str, bind_host: str, allowed: frozenset[str]) -> bool:
    """Whether a request's Host header names this server: its own address (``bind_host``, or
    any of several comma-separated), an address of any interface when it listens on all of
    them, localhost when it listens on loopback, or one of ``allowed`` (server.allowed_hosts).
    Anything else is a page that rebound its own name here."""
    name = _host_name(header)
    if not name or "*" in allowed or name in allowed:
        return True
    binds = [b.strip().strip("[]").lower() for b in bind_host.split(",")]
    return any(_names_bind(name, bind) for bind in [b for b in binds if b] or [""])


def _names_bind(name: str, bind: str) -> bool:
    """Whether ``name`` (a Host header's, not in server.allowed_hosts) is the address ``bind``."""
    try:
        bind_ip = ipaddress.ip_address(bind)
    except ValueError:
        bind_ip = None
    loopback = is_loopback(bind)
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:  # a name: only those the server was given
        return name == bind or (name == "localhost" and (loopback or bind in WILDCARDS))
    return bind in WILDCARDS or ip == bind_ip or (loopback and ip.is_loopback)


def _content_length(scope) -> int:
    try:
        return int(Headers(scope=scope).get("content-length", "0"))
    except ValueError:
        return 0


def _canonical(name: bytes) -> bytes:
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


def origin_allowed(origin: str, cors_origins: frozenset[str]) -> bool:
    """An origin listed exactly, "*", or, for the entry "localhost" (llama-server's word), a
    page served from this machine's loopback names on any port."""
    if origin in cors_origins or "*" in cors_origins:
        return True
    return "localhost" in cors_origins and re.fullmatch(LOOPBACK_ORIGINS, origin) is not None


class OriginCheck:
    """Outermost: the report to ``on_request``, and what a browser could abuse. A foreign Host
    header (DNS rebinding) and a request from a web origin not in server.cors_origins get 403
    before anything else runs; a preflight from such an origin gets 200 without any grant (as
    llama-server answers: the browser then refuses the request); preflights from allowed origins
    are answered by Starlette's CORSMiddleware, inside this."""

    def __init__(
        self, app, bind_host: str, allowed_hosts: frozenset[str], cors_origins: frozenset[str],
        on_request: Callable[[dict], None] | None,
    ) -> None:
        self.app = app
        self.bind_host = bind_host
        self.allowed_hosts = allowed_hosts
        self.cors_origins = cors_origins
        self.on_request = on_request

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app fails before answering, ServerErrorMiddleware sends a 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # Header names as llama-server writes them ("Access-Control-Allow-Origin"): HTTP
                # says case does not matter, but some clients look them up case by case.
                message = {**message, "headers": [(_canonical(k), v) for k, v in message.get("headers", [])]}
            await send(message)

        try:
            await self._checked(scope, receive, send_status)
        finally:
            if self.on_request is not None:
                self._report(scope, status, time.perf_counter() - started)

    async def _checked(self, scope, receive, send) -> None:
        headers = Headers(scope=scope)
        host, origin = headers.get("host", ""), headers.get("origin")
        if not host_allowed(host, self.bind_host, self.allowed_hosts):
            response = error_response(
                403, "invalid_request_error",
                f"Host {_host_name(host)!r} is not this server's name: add it to server.allowed_hosts to allow it", path=scope["path"],
            )
        elif origin is not None and not origin_allowed(origin, self.cors_origins):
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                response = Response(status_code=200)  # no grant: the browser refuses the request
            else:
                response = error_response(
                    403, "invalid_request_error",
                    f"cross-origin requests from {origin} are refused: add it to server.cors_origins to allow it", path=scope["path"],
                )
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)

    def _report(self, scope, status: int, duration_s: float) -> None:
        state = scope.get("state") or {}
        client = scope.get("client")
        record = {
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "client": f"{client[0]}:{client[1]}" if client else None,
            "prompt_tokens": state.get("prompt_tokens"),
            "tokens": state.get("tokens"),
            "queue_position": state.get("queue_position"),
            "duration_s": duration_s,
        }
        try:
            self.on_request(record)
        except Exception:  # a display callback must never break the API
            log.exception("on_request callback failed")


class Guard:
    """Inner app middleware: the API key, JSON bodies only, the body size limit.

    The limit is here rather than Starlette's ``max_body_size``, which answers in plain text;
    clients of this API expect JSON errors. Only application/json bodies are read: a web page
    can send text/plain across origins without a preflight, never JSON.
    """

    def __init__(self, app, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    @staticmethod
    def _json_body(scope) -> bool:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return True
        headers = Headers(scope=scope)
        if "content-type" not in headers and headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers:
            return True  # no body at all (llama-server's POST /slots/{id}?action=erase)
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        return media == "application/json"

    def _limited(self, receive):
        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:  # a chunked upload, counted as it arrives
                    raise ApiError(TOO_LARGE, 413)
            return message

        return receive_limited

    def _authorized(self, scope) -> bool:
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return hmac.compare_digest(token.strip().encode(), self.api_key)
        # Anthropic's header, which llama-server also takes.
        return hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), self.api_key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            response = error_response(
                401, "authentication_error", "missing or wrong API key (send Authorization: Bearer KEY, or X-Api-Key: KEY)",
                headers={"WWW-Authenticate": "Bearer"}, path=scope["path"],
            )
            await response(scope, receive, send)
        elif not self._json_body(scope):
            given = Headers(scope=scope).get("content-type") or "none"
            await error_response(415, "invalid_request_error", f"Content-Type must be application/json (got {given})", path=scope["path"])(
                scope, receive, send,
            )
        elif _content_length(scope) > self.max_body:  # refused before the upload is read
            await error_response(413, "invalid_request_error", TOO_LARGE, path=scope["path"])(scope, receive, send)
        else:
            await self.app(scope, self._limited(receive), send)
