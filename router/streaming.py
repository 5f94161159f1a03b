"""Relaying an upstream answer while watching for the client to leave.

Used by :mod:`router.proxy` only. Two tools, both aimed at one outcome: when
the client goes away, the upstream connection is closed at once, so that
llama-server stops generating and frees its slot.

- :func:`relay_stream` sends a ``text/event-stream`` answer chunk by chunk as
  aiohttp receives it (no buffering, no re-framing: the bytes are the
  replica's), racing the copy against the client's ``http.disconnect`` and
  cancelling the loser, as Starlette's ``StreamingResponse`` does.
- :class:`DisconnectWatch` covers the time before the answer starts (a
  non-streaming completion sends nothing until generation ends). Watching
  costs a task, so it only starts for requests still running after
  :data:`WATCH_AFTER_S` (:class:`DisconnectWatches`, one timer for all); fast
  requests never pay for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

from router import errors
from router.accounting import StreamMeter
from router.replica_errors import StreamErrors
from router.serving import cut_on_purpose

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# nginx's code for "client closed the request before we answered".
STATUS_CLIENT_CLOSED = 499

# Seconds before a pending request starts watching for its client to leave.
WATCH_AFTER_S = 0.25

# Connection-scoped (RFC 9110 7.6.1) or set by uvicorn itself.
_DROP_RESPONSE = frozenset(
    {
        b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
        b"trailer", b"upgrade", b"proxy-connection", b"date", b"server",
    }
)  # fmt: skip


# CORS is the router's alone (router.app.with_cors, its allowed origins): llama-server
# answers every Origin with itself, which would both double the router's header
# (browsers refuse two values) and allow any origin the router does not (found by a
# new user, issue 10).
_CORS_PREFIX = b"access-control-"


def response_headers(upstream: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    """The replica's response headers minus hop-by-hop and CORS ones, as ASGI pairs."""
    return [
        (k, v)
        for k, v in upstream.raw_headers
        if (name := k.lower()) not in _DROP_RESPONSE and not name.startswith(_CORS_PREFIX)
    ]


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has disconnected (or the response completed)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Cancels the current task if its client disconnects.

    Made by :meth:`DisconnectWatches.watch`, which starts a task reading
    ``receive`` once the request has run :data:`WATCH_AFTER_S`. ``client_gone``
    tells the cancelled code that the cancellation was ours. Always
    :meth:`disarm` when the request is done.
    """

    __slots__ = ("_armed", "_receive", "_watcher", "client_gone", "task")

    def __init__(
        self, receive: Receive, armed: dict[DisconnectWatch, float], task: asyncio.Task[Any]
    ) -> None:
        self._receive = receive
        self._armed = armed
        # The request's task: cancelled when its client leaves.
        self.task = task
        self._watcher: asyncio.Task[None] | None = None
        self.client_gone = False

    def start(self) -> None:
        """Start reading ``receive`` (the request is still running)."""
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        await wait_disconnect(self._receive)
        if not self.task.done():
            self.client_gone = True
            self.task.cancel()

    def disarm(self) -> None:
        """Stop watching; safe to call more than once."""
        self._armed.pop(self, None)
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


class DisconnectWatches:
    """The proxy's disconnect watches, under one loop timer.

    A timer per request (``call_later``, then its cancel) was 4.5 us of the
    router's 30-35 us of its own CPU per request (bench/proxy_cpu.py, 2026-12-03).
    Here a watch is a dict entry, and one timer, armed only while watches are,
    ticks every half :data:`WATCH_AFTER_S` and starts the watcher of each request
    armed that long ago or more: between 1 and 1.5 times ``after_s`` after it began.
    """

    __slots__ = ("_after_s", "_armed", "_loop", "_timer")

    def __init__(self, after_s: float = WATCH_AFTER_S) -> None:
        self._after_s = after_s
        # Armed at (the loop's clock), in the order armed: the oldest first.
        self._armed: dict[DisconnectWatch, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        # The loop the timer runs on: a proxy used on a later loop (tests, an
        # embedding app) arms its own there rather than wait on a dead one.
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, receive: Receive, task: asyncio.Task[Any] | None = None) -> DisconnectWatch:
        """Watch the client of ``task`` (the current one when not given), from now;
        disarm it when done.

        The proxy passes its task, which it also hands :mod:`router.firstbyte`: on
        Python 3.11 every ``asyncio.get_running_loop`` (and ``current_task``) makes
        a ``getpid`` system call, the check that the loop was not inherited across
        a fork (CPython's ``_asynciomodule.c``, dropped in 3.12); ``py-spy
        --native`` under the side-by-side bench put the router's at twice the
        forwarder's."""
        if task is None:
            task = asyncio.current_task()
            assert task is not None, "watch() outside a task"
        loop = task.get_loop()
        watch = DisconnectWatch(receive, self._armed, task)
        self._armed[watch] = loop.time()
        if self._timer is None or self._loop is not loop:
            self._loop = loop
            self._timer = loop.call_later(self._after_s / 2, self._sweep)
        return watch

    def _sweep(self) -> None:
        self._timer = None  # first: whatever happens below, the next watch re-arms
        loop = asyncio.get_running_loop()
        due = loop.time() - self._after_s
        started = []
        for watch, armed_at in self._armed.items():
            if armed_at > due:
                break
            started.append(watch)
        for watch in started:
            del self._armed[watch]
            watch.start()
        self._timer = loop.call_later(self._after_s / 2, self._sweep) if self._armed else None


async def relay_stream(
    model: str,
    upstream: aiohttp.ClientResponse,
    receive: Receive,
    send: Send,
    started: bool = False,
    meter: StreamMeter | None = None,
) -> int:
    """Copy an event stream to the client until it ends or the client leaves,
    its error events in OpenAI's shape (:class:`router.replica_errors.StreamErrors`).

    ``started``: the client's response began already (a loading heartbeat,
    :mod:`router.heartbeat`), so only the events are sent. Returns the status to
    record: the replica's, :data:`STATUS_CLIENT_CLOSED` when the client left
    first; when the replica broke off mid-stream, 504 (silent for the upstream read
    timeout) or 502 (its connection broke), after an error event in OpenAI's shape
    (code ``upstream_timeout`` or ``upstream_unavailable``), and the stream then ends
    unfinished. ``meter`` reads the stream's usage (and may strip the usage event the
    router asked for, :mod:`router.accounting`). On either failure the upstream
    connection is closed, not pooled.
    """
    if not started:
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status,
                "headers": response_headers(upstream),
            }
        )
    pump = asyncio.ensure_future(_pump(upstream, send, meter))
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        pump.cancel()
        gone.cancel()
    if not pump.done() or pump.cancelled():
        # Closing (not releasing) drops the TCP connection: llama-server
        # notices on its next write and frees the slot.
        upstream.close()
        log.info("model %s: client left mid-stream; upstream request closed", model)
        return STATUS_CLIENT_CLOSED
    exc = pump.exception()
    if exc is not None:
        upstream.close()
        told = _broken(model, exc)
        log.warning(
            "model %s: replica %s:%s's stream broke: %r",
            model,
            upstream.url.host,
            upstream.url.port,
            exc,
        )
        # Bytes already went out, so no error response is possible: the client is
        # told in the stream, as llama-server tells its own failures (an SDK raises
        # it), then the stream ends without its final empty chunk, so uvicorn drops
        # the connection and a client that reads no events sees a truncated stream,
        # not a clean end. An event the replica left half-sent was held back
        # (StreamErrors); the blank line first ends one too long to hold
        # (an empty event is ignored, WHATWG HTML 9.2.6).
        told_event = b"\n\n" + error_event(errors.error_object(told))
        cut_on_purpose()
        with contextlib.suppress(Exception):  # the client may be gone as well
            await send({"type": "http.response.body", "body": told_event, "more_body": True})
        return told.status
    return upstream.status


def event(data: bytes) -> bytes:
    """``data`` (JSON) as one SSE event: a ``data:`` line per line of it, which a
    client joins back with LF (WHATWG HTML 9.2.6), so a replica's pretty-printed
    answer sent after a loading heartbeat stays one event (found in review)."""
    if b"\n" in data or b"\r" in data:
        return b"".join(b"data: " + line + b"\n" for line in data.splitlines()) + b"\n"
    return b"data: " + data + b"\n\n"


def error_event(error: dict[str, Any]) -> bytes:
    """``{"error": error}`` as one SSE event (OpenAI's and llama-server's way to tell
    a stream it failed)."""
    return event(json.dumps({"error": error}).encode())


def _broken(model: str, exc: BaseException) -> errors.UpstreamError:
    """What a client is told of a stream the replica broke off: its silence timeout
    (aiohttp's ``sock_read``, ``upstream_read_timeout_s``) or a broken connection."""
    if isinstance(exc, TimeoutError):
        return errors.UpstreamTimeout(
            f"The model `{model}` replica went silent mid-stream (nothing for the "
            "router's upstream read timeout); the stream was cut."
        )
    return errors.UpstreamUnavailable(
        f"The model `{model}` replica's stream broke ({type(exc).__name__}); the stream was cut."
    )


async def _pump(
    upstream: aiohttp.ClientResponse, send: Send, meter: StreamMeter | None = None
) -> None:
    errors = StreamErrors(upstream.status)
    async for chunk in upstream.content.iter_any():
        out = errors.feed(chunk)
        if meter is not None:
            out = meter.feed(out)
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
    last = errors.flush()
    if meter is not None:
        last = meter.feed(last) + meter.flush()
    await send({"type": "http.response.body", "body": last, "more_body": False})
