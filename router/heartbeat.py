"""SSE comments to a streaming client while its on-demand model loads.

Why: a model that scales from 0 takes tens of seconds to pass its health
check, and the request is held that long (:mod:`router.activation`). A
streaming client with an idle timeout (a chat UI's, a proxy's) gives up on a
connection that sends nothing, and cannot show "loading". So a request that
asked for ``"stream": true`` and is still waiting for an endpoint after
``interval_s`` gets its response started (200, ``text/event-stream``) and a
comment line every ``interval_s``::

    : loading model <name>

SSE comments (lines starting with ``:``) are ignored by every conforming
reader (WHATWG HTML, "Server-sent events", 9.2.6), the OpenAI SDKs included
(openai-python's ``SSEDecoder.decode`` drops them). The answer follows on the
same response: the replica's events, or, for an error (the router's refusal
or the replica's error answer), one ``data: {"error": {...}}`` event in
OpenAI's shape, which the OpenAI SDKs raise as ``APIError``. A load that
ends within ``interval_s`` sends nothing early, so its refusals keep their
HTTP status.

Used by :mod:`router.proxy` around its wait for an endpoint (the
:data:`router.proxy.NoEndpoint` policy); one :class:`LoadingHeartbeat` per
streaming request.
"""

from __future__ import annotations

import asyncio

from router.streaming import Send, error_event

# What llama-server's own streams carry (server.cpp: Cache-Control no-cache,
# X-Accel-Buffering no), so an nginx in front passes the loading comments at once
# rather than buffering them away (found in review).
HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class LoadingHeartbeat:
    """Starts the response of a waiting stream and keeps it alive; see the module.

    :meth:`start` when the wait begins, :meth:`stop` when it ends (always);
    ``started`` says whether the response began, and then the caller sends only
    body messages (:meth:`fail` for an error)."""

    __slots__ = ("_comment", "_interval_s", "_send", "_task", "started")

    def __init__(self, send: Send, model: str, interval_s: float) -> None:
        self._send = send
        self._interval_s = interval_s
        self._comment = f": loading model {model}\n\n".encode()
        self._task: asyncio.Task[None] | None = None
        self.started = False

    def start(self) -> None:
        """Begin beating (after one interval); a second call does nothing."""
        if self._task is None and self._interval_s > 0:
            self._task = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            if not self.started:
                # Set first: uvicorn writes the head before its first await, so a
                # cancel inside send() finds it sent.
                self.started = True
                await self._send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            await self._send(
                {"type": "http.response.body", "body": self._comment, "more_body": True}
            )

    async def stop(self) -> None:
        """Stop beating; returns once no send of the heartbeat is in progress."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # gather, not a suppressed await: a cancel of the caller itself (its
            # client left) must still reach it.
            await asyncio.gather(task, return_exceptions=True)

    async def fail(self, error: dict[str, object]) -> None:
        """End the started response with ``{"error": error}`` as its last event."""
        body = error_event(error)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
