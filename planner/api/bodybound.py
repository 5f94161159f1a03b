"""A bound on the size of every request body the admin API reads (pure ASGI middleware).

The admin API's largest legitimate body is a router's usage report
(`llmgw_contract.UsageReport`: model names and per-model load, about 100 bytes per
model), so `MAX_BODY_BYTES` (1 MiB) holds ten thousand models. Without a bound,
FastAPI reads a body whole before validating it: one request could hold the
planner's memory (a 20 MiB body was read whole before it was refused, found while
reviewing issue 19). A body announced larger (`Content-Length`) is refused before
anything is read; one that grows past the bound while it is read (chunked) is
refused as soon as it does. Both answer 413 with the API's error shape: the second
as an HTTPException, because FastAPI turns any other exception raised while it reads
a body into "400 There was an error parsing the body" (fastapi/routing.py,
get_request_handler).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 1 << 20


class BodyTooLarge(HTTPException):
    """A request body grew past the bound while it was read (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than {limit} bytes")


class BodyBound:
    """Wraps `app`; refuses a request whose body exceeds `limit` bytes with 413."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = dict(scope.get("headers") or ()).get(b"content-length")
        if announced is not None and (not announced.isdigit() or int(announced) > self.limit):
            await self._refuse(send)
            return
        started = False
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body") or b"")
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message.get("type") == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded, watched)
        except BodyTooLarge:
            if started:  # an answer is under way: nothing left to say
                raise
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"request body larger than {self.limit} bytes",
                    "type": "planner_error",
                    "code": "body_too_large",
                }
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
