"""What stands before the routes of ``opus serve`` when more than one person can reach it: the API key and
the request body's size.

An ASGI middleware around the whole app, so that nothing behind it (JSON parsing, tokenizing, the engine)
sees a request it refuses. With an API key, every route but ``/health`` (what a load balancer probes)
needs ``Authorization: Bearer KEY``, as OpenAI's clients send it; the answer otherwise is 401 with
OpenAI's error body. A body must declare its length (411 without one) and stay within the limit (413).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opus.serve.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health",)
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a 32k-token prompt is ~130 kB of text


class Guard:
    def __init__(self, app: App, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := self.refusal(scope)):
            status, body, headers = refusal
            await _reply(send, status, body, headers)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, dict[str, Any], dict[str, str]] | None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers") or []}
        if self.api_key and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            return 401, error_body("a valid API key is required: send 'Authorization: Bearer KEY'",
                                   code="invalid_api_key"), {"www-authenticate": "Bearer"}
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return None
        length = headers.get("content-length")
        if length is None:
            return 411, error_body("the request must declare its body's length (Content-Length)"), {}
        try:
            size = int(length)
        except ValueError:
            return 400, error_body(f"Content-Length {length.decode('latin-1')!r} is not a number"), {}
        if size > self.max_body_bytes:
            return 413, error_body(f"the request body is {size} bytes; this server accepts at most "
                                   f"{self.max_body_bytes} (--max-body-kb)"), {}
        return None

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        scheme, _, token = headers.get("authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key or b"")


async def _reply(send: Send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
           *((k.encode(), v.encode()) for k, v in headers.items())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
