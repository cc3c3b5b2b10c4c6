"""The request guard: API key, Content-Type and body size, checked before any handler runs.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers streaming responses):
- `--api-key`: every path but the public ones (`/health` by default) needs
  `Authorization: Bearer KEY`, compared in constant time (`hmac.compare_digest`), else 401;
- POST bodies must be `application/json` (415 otherwise): a browser sends a cross-site
  `text/plain` POST without a CORS preflight, so accepting it would let any web page run
  generations on a server reachable from the browser;
- a body over `max_request_bytes` gets 413, from its Content-Length or, when the client sends
  none (chunked), as soon as the bytes read exceed the limit. The guard reads the body itself
  and replays it, so handlers never see more than the limit.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_REQUEST_TIMEOUT = 600.0


@dataclass(frozen=True)
class ServerOptions:
    """Limits and access control of the HTTP layer (the engine's own options are `EngineArgs`).

    `request_timeout`: seconds a request may take from admission to its last token before it
    is aborted (504). `public_paths`: paths served without the API key when one is set.
    """

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    api_key: str | None = None
    public_paths: tuple[str, ...] = ("/health",)

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty; omit it to serve without a key")


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


async def _respond(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Wrap an ASGI app with the checks described in the module docstring."""

    def __init__(self, app: ASGIApp, options: ServerOptions) -> None:
        self.app = app
        self.options = options
        self._key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self._key is not None and scope.get("path") not in self.options.public_paths:
            if not self._authorized(headers.get("authorization", b"")):
                body = _error(401, "a valid API key is required: send 'Authorization: Bearer <key>'", "invalid_api_key")
                await _respond(send, 401, body, [(b"www-authenticate", b"Bearer")])
                return
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        ctype = headers.get("content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            shown = ctype.decode("latin-1") or "none"
            message = f"Content-Type must be application/json, got {shown}; send the body as JSON"
            await _respond(send, 415, _error(415, message, "unsupported_media_type"))
            return
        body = await self._read_body(headers.get("content-length"), receive, send)
        if body is None:
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return self._key is not None and scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def _read_body(self, length: bytes | None, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 (or when the client left)."""
        limit = self.options.max_request_bytes
        too_big = _error(
            413,
            f"the request body exceeds this server's limit of {limit} bytes (--max-request-bytes); send less",
            "request_too_large",
        )
        try:
            declared = int(length) if length is not None else None
        except ValueError:
            declared = None
        if declared is not None and declared > limit:
            await _respond(send, 413, too_big, [(b"connection", b"close")])
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _respond(send, 413, too_big, [(b"connection", b"close")])
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields `body` once, then defers to the client's (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
