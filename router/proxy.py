"""The request hot path: read the body, pick a replica, forward, relay the answer.

:class:`Proxy` is a plain ASGI callable that :mod:`router.app` puts in front
of FastAPI's routing for every model-addressed ``POST`` (:mod:`router.routes`).
Per request it does no Consul call, no pydantic parsing and no body
rewriting: :mod:`router.bodies` finds ``model`` (off the event loop for a
large body), the raw bytes go upstream unchanged over a keep-alive pool per
replica. Before the first Consul read it answers 503 ``router_starting``;
past ``max_requests`` held at once, 503 ``router_overloaded``.

- Non-streaming answers are read whole and returned with a Content-Length.
- ``text/event-stream`` answers are relayed chunk by chunk as they arrive
  (:mod:`router.streaming`).
- A replica's error answers, and the error events of its streams, reach the
  client as OpenAI error objects (:mod:`router.replica_errors`).
- A streaming request that waits for its on-demand model gets SSE comments
  meanwhile (:mod:`router.heartbeat`).
- A client that leaves, mid-stream, while a long non-streaming answer is
  being generated or while it waits for a slot, closes the upstream
  connection (or leaves the queue): that is how llama-server learns to free
  the slot.
- Each replica takes at most its limit of requests at once; the rest wait,
  in order, for a bounded time (:mod:`router.admission`), then 503
  ``replicas_busy``.
- No request runs twice, except on a replica that proves dead. A request is
  retried on another replica when it provably never reached one: the
  connection could not be made (:data:`_NEVER_SENT`); or when the replica sent
  no first byte in time and then failed its liveness probe
  (:mod:`router.firstbyte`: ``GET /health``, answered by its HTTP thread, so
  a busy replica always passes). Both, and 5xx answers, count towards
  ejecting the replica (:mod:`router.outliers`). A connection that breaks after the
  request went out (closed, reset) may have run it, so that is 502
  ``upstream_unavailable``, and the client decides.

A parked model is refused at once (:func:`router.refusals.gate`), before its
endpoints are looked at. When a defined model has no passing endpoint the
:data:`NoEndpoint` policy decides: the router's is on-demand activation
(:class:`router.activation.Activator`: ask the planner, then wait a bounded
time for an endpoint); :func:`router.refusals.refuse_at_once` refuses at once
with 503 ``model_unplaceable``, ``model_loading`` (room being made) or
``model_not_ready``. Every refusal is counted by its
:class:`router.errors.Refusal`. Each request marks its model used
(``entry.used``) for :mod:`router.usage`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from router import errors, refusals
from router.accounting import (
    STREAM_OPTION_ROUTES,
    StreamMeter,
    Usage,
    ask_for_usage,
    whole_usage,
)
from router.admission import Held
from router.balancer import Affinity
from router.bodies import BodyParser, parse_request
from router.endpoint import Endpoint, Failure
from router.endpoints import EndpointTable, ModelEntry
from router.firstbyte import Attempt, FirstByteWatch
from router.heartbeat import LoadingHeartbeat
from router.intake import (
    BodyBudget,
    ClientGone,
    Reservation,
    content_length,
    default_budget,
    read_body,
)
from router.keys import KeySource
from router.limits import Admission, KeyLimits
from router.metrics import (
    KEY_ANONYMOUS,
    KEY_UNAUTHENTICATED,
    METERED_ROUTES,
    RequestMetrics,
    RouterMetrics,
)
from router.outliers import OutlierDetector
from router.prefix import PrefixChooser
from router.replica_errors import error_answer
from router.replicaload import hush
from router.routes import model_route, upstream_query
from router.serving import body_whole
from router.streaming import (
    STATUS_CLIENT_CLOSED,
    DisconnectWatch,
    DisconnectWatches,
    Message,
    Receive,
    Scope,
    Send,
    event,
    relay_stream,
    response_headers,
)

log = logging.getLogger(__name__)

# Bodies larger than this go upstream in slices of this size (_payload).
SEND_SLICE_BYTES = 256 * 1024

NoEndpoint = Callable[[ModelEntry], Awaitable[None]]
"""Called when ``entry`` has no passing endpoint: return once it has one, or
raise a :class:`router.errors.ModelUnavailable` explaining why not."""

__all__ = ["NoEndpoint", "Proxy", "extract_model", "send_error"]

# Connection-scoped (RFC 9110 7.6.1) or recomputed by us / by uvicorn.
_DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "expect",
        # CORS is the router's (router.app.with_cors): the replica is not asked.
        "origin",
    }
)
# llama-server's HTTP server (cpp-httplib, httplib.h CPPHTTPLIB_HEADER_MAX_LENGTH and
# CPPHTTPLIB_HEADER_MAX_COUNT, left at their defaults by llama.cpp) refuses a header
# line over 8,192 bytes (CRLF included) and a 101st header with an empty 400; the
# router, whose own bound is 64 KiB in all (router.serving), answers what the replica
# would refuse with its own 431 (found in review: a 20 KiB header, or 5,000 small
# ones, came back as "replica answered 400: (no body)"). aiohttp and the router add
# up to 7 lines of their own (host, accept, accept-encoding, user-agent,
# content-type, content-length, connection).
REPLICA_LINE_MAX = 8192
REPLICA_HEADER_MAX_BYTES = REPLICA_LINE_MAX - len(": \r\n")
REPLICA_HEADERS_MAX = 100
REPLICA_HEADERS_FORWARDED_MAX = REPLICA_HEADERS_MAX - 7
# The longest path and query sent to a replica. llama-server drops the connection,
# unanswered, on a longer request line than about 32 KiB (found in review: a
# 32,732-byte line served, a 32,772-byte one dropped; the 502 then counted toward
# ejecting a healthy replica). The router's bound is nginx's default for a request
# line (large_client_header_buffers, 8 KiB): model routes need no long query.
REPLICA_TARGET_MAX = 8192
# The only failures after which the request provably never reached a replica:
# no connection could be made (refused, unreachable, name or TLS failure:
# ClientConnectorError and its subclasses) or making it timed out. aiohttp
# itself never resends a POST on a reused connection (client.py retries only
# idempotent methods, RFC 9112 9.3.1), so nothing below retries it either.
_NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def extract_model(body: bytes) -> str:
    """Return the ``model`` field of a JSON request body (:mod:`router.bodies`).

    Raises :class:`router.errors.InvalidRequest` when the body is not a JSON
    object or ``model`` is missing or not a non-empty string.
    """
    return parse_request(body)[0]


def hop_by_hop(headers: list[tuple[bytes, bytes]]) -> frozenset[str]:
    """The header names a request's ``Connection`` headers list (lowercased): they
    are for this connection only and are not forwarded (RFC 9110 7.6.1)."""
    names = frozenset()
    for name, value in headers:
        if name == b"connection":
            names |= {t.strip().lower() for t in value.decode("latin-1").split(",")} - {""}
    return names


def authorization(scope: Scope) -> bytes | None:
    """The request's ``Authorization`` header value, or ``None``."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value
    return None


class Proxy:
    """ASGI app for the proxied OpenAI endpoints. ``session`` is set by the lifespan."""

    def __init__(
        self,
        table: EndpointTable,
        metrics: RouterMetrics,
        *,
        max_body_bytes: int,
        max_attempts: int,
        queue_timeout_s: float = 30.0,
        busy_retry_after_s: int = 2,
        no_endpoint: NoEndpoint = refusals.refuse_at_once,
        prefix: PrefixChooser | None = None,
        keys: KeySource | None = None,
        forward_authorization: bool = False,
        first_byte_timeout_s: float = 10.0,
        stall_timeout_s: float = 300.0,
        loading_heartbeat_s: float = 5.0,
        max_requests: int = 0,
        outliers: OutlierDetector | None = None,
        bodies: BodyParser | None = None,
        budget: BodyBudget | None = None,
        body_read_timeout_s: float = 30.0,
        body_min_rate: float = 64 * 1024,
        accounting: bool = True,
        ask_stream_usage: bool = False,
        limits: KeyLimits | None = None,
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_attempts = max(1, max_attempts)
        self.queue_timeout_s = queue_timeout_s
        self.busy_retry_after_s = busy_retry_after_s
        self.no_endpoint = no_endpoint
        # Cache-aware routing (router.prefix); None: least-outstanding only.
        self.prefix = prefix
        # Router API keys (router.keys); None: none asked for. The client's
        # Authorization is the router's key, not the replica's: dropped
        # unless the operator says to forward it.
        self.keys = keys
        self._drop = _DROP_REQUEST if forward_authorization else _DROP_REQUEST | {"authorization"}
        self.first_byte_timeout_s = first_byte_timeout_s
        # SSE comments to a stream waiting for its model to load (router.heartbeat).
        self.loading_heartbeat_s = loading_heartbeat_s
        self.first_byte = FirstByteWatch(
            self._control, first_byte_timeout_s, stall_timeout_s, self._stalled
        )
        # Requests in the router at once (waiting for a slot included); 0: no limit.
        self.max_requests = max_requests
        self.active = 0
        self.outliers = outliers or OutlierDetector()
        if self.outliers.check is None:
            # A replica returning from an ejection is asked what it failed first.
            self.outliers.check = self.first_byte.check
        self.bodies = bodies or BodyParser()
        # Bytes of bodies held at once, and how long one may take (router.intake).
        self.budget = budget or BodyBudget(default_budget(), busy_retry_after_s)
        self.body_read_timeout_s = body_read_timeout_s
        self.body_min_rate = body_min_rate
        # Token accounting (router.accounting): usage read from every answer.
        self.accounting = accounting
        # Add stream_options.include_usage to streams that did not ask (off: the
        # llama-server timings of the last event are read instead).
        self.ask_stream_usage = ask_stream_usage
        # Per-key limits (router.limits), for keys that have some.
        self.limits = limits
        # Set by the lifespan: requests go on ``session``; liveness probes
        # (router.firstbyte) on ``control``, so a replica's full pool never
        # delays the question whether it is alive.
        self.session: aiohttp.ClientSession | None = None
        self.control: aiohttp.ClientSession | None = None
        self.watches = DisconnectWatches()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        bound: RequestMetrics = self.metrics.unknown
        status = 500
        self.active += 1
        reservation = Reservation(self.budget)
        # A refusal sent before the whole body was read closes the connection:
        # uvicorn would otherwise read the rest of the body only to drop it.
        body_read = False
        heartbeat: LoadingHeartbeat | None = None
        key_name = KEY_ANONYMOUS if self.keys is None else KEY_UNAUTHENTICATED
        refused = False
        meter = _Meter()
        limited: Admission | None = None
        try:
            if scope["method"] != "POST":
                raise _MethodNotAllowed(f"Use POST for {scope['path']}.")
            path = _target(scope)  # refused before the body is read
            if self.max_requests and self.active > self.max_requests:
                raise errors.RouterOverloaded(
                    f"The router holds its limit of {self.max_requests} requests (in flight "
                    f"and waiting for a replica) already. Retry in {self.busy_retry_after_s} s.",
                    self.busy_retry_after_s,
                )
            key = None if self.keys is None else self.keys.authenticate(authorization(scope))
            if key is not None:
                key_name = key.name
                if key.limited and self.limits is not None:
                    limited = await self.limits.admit(key)
                    if key.requests_per_minute or key.tokens_per_minute:
                        send = _with_standing(send, self.limits, limited)
            body = await read_body(
                receive,
                content_length(scope["headers"]),
                reservation,
                max_bytes=self.max_body_bytes,
                timeout_s=self.body_read_timeout_s,
                min_rate=self.body_min_rate,
                whole=body_whole(scope),
            )
            body_read = True
            if limited is not None:
                self.limits.estimate(limited, len(body))  # type: ignore[union-attr]
            doc: dict[str, Any] | None = None
            if len(body) <= self.bodies.inline_bytes:
                model, doc = parse_request(body)  # the common case, without a coroutine
            else:
                # A huge body: only its model is found, off the loop (router.bodies);
                # it gets no prefix affinity, and its connection is not reused.
                model = await self.bodies.find_model(body)
            if key is not None and not key.allows(model):
                raise errors.ModelNotAllowed(model)
            entry = self.table.get(model)
            if entry is None:
                if not self.table.synced:
                    raise errors.RouterStarting(
                        "The router has not read its models from Consul yet. Retry in 1 s.", 1
                    )
                raise errors.ModelNotFound(model)
            bound = entry.metrics
            entry.used = True  # for the usage report (router.usage)
            if entry.parked is not None:
                # Parked wins over passing endpoints: the planner stopped the
                # job, and a replica still deregistering must not serve.
                raise refusals.parked(entry.name, entry.parked)
            affinity: Affinity | None = None
            if (
                self.prefix is not None
                and doc is not None
                and (prefix_key := self.prefix.key(doc)) is not None
            ):
                affinity = (self.prefix, prefix_key)
            # llama-server closes the connection after a streamed answer while
            # advertising keep-alive (no "Connection: close"); pooled, that
            # connection takes the next request, which fails once written (502
            # "Can not write request body", found by bench/prefix_routing.py).
            # Saying "close" up front keeps it out of the pool.
            stream = doc is not None and doc.get("stream") is True
            close = doc is None or stream
            if self.accounting:
                route = path.partition("?")[0]
                meter.metered = route in METERED_ROUTES
                if stream:
                    assert doc is not None
                    asked = (
                        ask_for_usage(body, doc)
                        if self.ask_stream_usage and route in STREAM_OPTION_ROUTES
                        else None
                    )
                    if asked is not None:
                        # The router's own question: its answer is not the client's.
                        body = asked
                    meter.stream = StreamMeter(strip=asked is not None)
                else:
                    meter.whole = True
            if stream and self.loading_heartbeat_s > 0:
                heartbeat = LoadingHeartbeat(send, entry.name, self.loading_heartbeat_s)
            status = await self._forward(
                entry, scope, path, body, receive, send, affinity, close, heartbeat, meter
            )
        except errors.RouterError as exc:
            if limited is not None:
                # The router answers itself: no replica served it, nothing is charged.
                self.limits.refund(limited)  # type: ignore[union-attr]
            if exc.refusal is not None:
                refused = True
                bound.refused(exc.refusal)
            if heartbeat is not None and heartbeat.started:
                # The stream began while the model loaded: the error is its last event.
                await heartbeat.fail(errors.error_object(exc))
                status = exc.status
            else:
                status = await send_error(send, exc, close=not body_read)
        except ClientGone:
            status = STATUS_CLIENT_CLOSED
        except Exception:
            log.exception("unhandled error proxying %s", scope.get("path"))
            # Fails (and is ignored) when the response had already started;
            # uvicorn then drops the connection, which is all that is left to do.
            with contextlib.suppress(Exception):
                await send_error(send, errors.RouterError("The router failed unexpectedly."))
        finally:
            reservation.release()
            self.active -= 1
            ended = time.perf_counter()
            bound.observe(status, ended - started)
            if self.accounting:
                _account(bound, key_name, status, refused, meter, started, ended)
            if limited is not None:
                assert self.limits is not None
                self.limits.release(limited)
                if limited.counts_tokens and (usage := meter.used()) is not None:
                    self.limits.charge(limited, usage.prompt + usage.completion)
                elif limited.counts_tokens:
                    self.limits.unread(limited, meter.stream.events if meter.stream else 0)

    async def _forward(
        self,
        entry: ModelEntry,
        scope: Scope,
        path: str,
        body: bytes | bytearray,
        receive: Receive,
        send: Send,
        affinity: Affinity | None = None,
        close: bool = False,
        heartbeat: LoadingHeartbeat | None = None,
        meter: _Meter | None = None,
    ) -> int:
        headers = []
        has_accept_encoding = False
        drop = self._drop | hop_by_hop(scope["headers"])
        for raw_name, raw_value in scope["headers"]:
            name = raw_name.decode("latin-1")
            if name not in drop:
                if len(raw_name) + len(raw_value) > REPLICA_HEADER_MAX_BYTES:
                    raise _replica_refuses(f"a header line of at most {REPLICA_LINE_MAX} bytes")
                try:
                    # aiohttp sends header values as UTF-8: a value decoded any other
                    # way reaches the replica changed (found in review: latin-1 doubled
                    # every byte over 0x7f), and the length above would not be its own.
                    value = raw_value.decode("utf-8")
                except UnicodeDecodeError:
                    raise _not_utf8(name) from None
                headers.append((name, value))
                has_accept_encoding = has_accept_encoding or name == "accept-encoding"
        if len(headers) > REPLICA_HEADERS_FORWARDED_MAX:
            raise _replica_refuses(
                f"at most {REPLICA_HEADERS_FORWARDED_MAX} header lines from the client "
                f"({REPLICA_HEADERS_MAX} in all, with the router's own)"
            )
        if not has_accept_encoding:
            # Else aiohttp adds "gzip, deflate" and the replica may compress a
            # body the client never asked to decompress. Setting it here rather
            # than via skip_auto_headers keeps aiohttp on its fast path.
            headers.append(("accept-encoding", "identity"))
        if close:
            headers.append(("connection", "close"))
        if len(body) > SEND_SLICE_BYTES:
            headers.append(("content-length", str(len(body))))  # sent in slices: _payload
        watch = self.watches.watch(receive, self._current_task())
        try:
            return await self._attempts(
                entry, path, headers, body, receive, send, watch, affinity, heartbeat, meter
            )
        except asyncio.CancelledError:
            if not watch.client_gone:
                raise
            # Our own cancellation, not a shutdown: the client left.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            log.info("model %s: client left before the answer; upstream closed", entry.name)
            raise ClientGone from None
        finally:
            watch.disarm()

    async def _attempts(
        self,
        entry: ModelEntry,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | bytearray,
        receive: Receive,
        send: Send,
        watch: DisconnectWatch,
        affinity: Affinity | None,
        heartbeat: LoadingHeartbeat | None = None,
        meter: _Meter | None = None,
    ) -> int:
        tried: list[Endpoint] = []
        failure: BaseException | None = None
        outliers = self.outliers
        first_bytes = self.first_byte
        for _ in range(self.max_attempts):
            endpoint = await self._slot(entry, tried, affinity, heartbeat)
            if endpoint is None:
                break
            with Held(entry.slots, endpoint):
                assert self.session is not None, "Proxy used outside the app lifespan"
                first_byte = first_bytes.start(endpoint, entry, watch.task)
                try:
                    # Redirects are the client's to follow, not ours: a replica's
                    # 3xx would send the request (and its body) to wherever it
                    # points (found in review: a 302 fetched and returned as 200).
                    upstream = await self.session.request(
                        "POST",
                        endpoint.url(path),
                        data=_payload(body),
                        headers=headers,
                        allow_redirects=False,
                    )
                except asyncio.CancelledError:
                    if watch.client_gone:
                        hush(endpoint)  # its load reads would keep the request running
                    if not first_byte.expired or watch.client_gone:
                        raise
                    # Our own cancellation: no first byte, and the replica's
                    # HTTP server failed its liveness probe: dead, so the request
                    # cannot run there. Nothing went to the client.
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    tried.append(endpoint)
                    failure = errors.UpstreamTimeout(
                        f"The model `{entry.name}` replica at {endpoint.base_url} sent no "
                        f"first byte within {self.first_byte_timeout_s:g} s and did not "
                        f"answer its liveness check (GET /health)."
                    )
                    log.warning("model %s: %s", entry.name, failure.message)
                    outliers.failed(entry.name, entry.metrics, entry.slots, endpoint, Failure.DEAD)
                    continue
                except aiohttp.SocketTimeoutError:
                    # Connected, sent, and the replica stayed silent for the
                    # whole read timeout: trying another one would double that.
                    raise errors.UpstreamTimeout(
                        f"The model `{entry.name}` replica at {endpoint.base_url} sent "
                        f"nothing for {self.session.timeout.sock_read}s."
                    ) from None
                except _NEVER_SENT as exc:
                    tried.append(endpoint)
                    failure = exc
                    log.debug("model %s: could not connect to %s: %r", entry.name, endpoint, exc)
                    outliers.failed(
                        entry.name, entry.metrics, entry.slots, endpoint, Failure.CONNECT
                    )
                    continue
                except aiohttp.ClientError as exc:
                    # Counted like a connect error (found in review: a replica that
                    # accepted and then closed or reset every connection failed half
                    # the requests and was never ejected); not retried, as it says.
                    outliers.failed(
                        entry.name, entry.metrics, entry.slots, endpoint, Failure.BROKEN
                    )
                    raise errors.UpstreamUnavailable(
                        f"The model `{entry.name}` replica at {endpoint.base_url} failed after "
                        f"the request was sent ({exc!r}). It was not retried on another "
                        f"replica: it may have run there."
                    ) from None
                finally:
                    first_bytes.stop(first_byte)
                outliers.answered(entry.name, entry.metrics, entry.slots, endpoint, upstream.status)
                started = heartbeat is not None and heartbeat.started
                try:
                    if upstream.content_type == "text/event-stream":
                        watch.disarm()
                        stream_meter = None if meter is None else meter.stream
                        return await relay_stream(
                            entry.name, upstream, receive, send, started, stream_meter
                        )
                    return await self._relay_whole(entry, upstream, send, started, meter)
                except BaseException:
                    # Drop the connection rather than pool it half-read; for a
                    # cancelled request this is what tells llama-server to stop.
                    upstream.close()
                    raise
                finally:
                    upstream.release()
        if isinstance(failure, errors.UpstreamTimeout):
            raise failure
        raise self._unreachable(entry, tried, failure)

    def _current_task(self) -> asyncio.Task[Any]:
        """The request's task, found by the loop the proxy last ran on: on Python 3.11
        ``asyncio.current_task()`` asks ``get_running_loop``, a ``getpid`` system call
        each time (see :meth:`router.streaming.DisconnectWatches.watch`); given the
        loop, it is a dict lookup. A loop that no longer runs has no current task, and
        the running one is looked up and kept."""
        task = None if self._loop is None else asyncio.current_task(self._loop)
        if task is None:
            task = asyncio.current_task()
            assert task is not None, "Proxy called outside a task"
            self._loop = task.get_loop()
        return task

    def _control(self) -> aiohttp.ClientSession | None:
        return self.control

    def _stalled(self, attempt: Attempt) -> None:
        entry: ModelEntry = attempt.owner  # type: ignore[assignment]
        self.outliers.failed(
            entry.name, entry.metrics, entry.slots, attempt.endpoint, Failure.STALLED
        )

    async def _slot(
        self,
        entry: ModelEntry,
        tried: list[Endpoint],
        affinity: Affinity | None = None,
        heartbeat: LoadingHeartbeat | None = None,
    ) -> Endpoint | None:
        """A granted slot on one of ``entry``'s endpoints not in ``tried``; ``None``
        when every endpoint already failed this request.

        Waits for an endpoint (the :data:`NoEndpoint` policy, with ``heartbeat``
        beating meanwhile) when there is none, and for a free slot when every
        endpoint is at its limit, at most the queue timeout. Raises the policy's refusal, or
        :class:`errors.ReplicasBusy` when the queue timeout runs out.
        """
        slots = entry.slots
        # A retry already waited its turn: it goes first.
        first = bool(tried)
        endpoint = slots.take(tried, first=first, affinity=affinity)
        if endpoint is not None:
            return endpoint
        deadline: float | None = None
        while True:
            if not slots.endpoints:
                if heartbeat is not None:
                    heartbeat.start()
                try:
                    await self.no_endpoint(entry)
                finally:
                    if heartbeat is not None:
                        await heartbeat.stop()
                endpoint = slots.take(tried, first=first, affinity=affinity)
                if endpoint is not None:
                    return endpoint
                continue
            if tried and all(e in tried for e in slots.endpoints):
                return None
            if deadline is None:
                deadline = time.monotonic() + self.queue_timeout_s
            try:
                endpoint = await slots.wait(deadline - time.monotonic(), tried, first=first)
            except TimeoutError:
                raise self._busy(entry) from None
            if endpoint is None:
                continue  # the endpoints went away while it waited: check again
            if entry.parked is not None:
                # Parked while it waited: the replica it got is being stopped.
                slots.release(endpoint)
                raise refusals.parked(entry.name, entry.parked)
            return endpoint

    def _busy(self, entry: ModelEntry) -> errors.ReplicasBusy:
        return errors.ReplicasBusy(
            entry.name,
            f"Every replica of the model `{entry.name}` is at its limit of requests in "
            f"flight ({entry.slots.describe()}), and none freed a slot within the "
            f"router's queue timeout of {self.queue_timeout_s:g} s. Retry in "
            f"{self.busy_retry_after_s} s.",
            self.busy_retry_after_s,
        )

    def _unreachable(
        self, entry: ModelEntry, tried: list[Endpoint], failure: BaseException | None
    ) -> errors.UpstreamUnavailable:
        return errors.UpstreamUnavailable(
            f"No replica of the model `{entry.name}` could be connected to "
            f"({len(set(tried))} tried): {failure!r}."
        )

    async def _relay_whole(
        self,
        entry: ModelEntry,
        upstream: aiohttp.ClientResponse,
        send: Send,
        started: bool = False,
        meter: _Meter | None = None,
    ) -> int:
        """Read the whole answer and send it; an error answer (status >= 400) in
        OpenAI's shape (:func:`router.replica_errors.error_answer`). ``started``:
        the response began already (a loading heartbeat), so the answer goes as
        one event and ends the stream. A successful answer's usage goes to
        ``meter`` when it asks for it."""
        try:
            data = await upstream.read()
        except TimeoutError as exc:
            raise errors.UpstreamTimeout(
                f"The model `{entry.name}` replica stopped sending ({type(exc).__name__})."
            ) from None
        except aiohttp.ClientError as exc:
            raise errors.UpstreamUnavailable(
                f"The model `{entry.name}` replica failed while answering: {exc!r}."
            ) from None
        status = upstream.status
        if meter is not None and meter.whole and status < 400:
            meter.usage = whole_usage(data)
        headers = response_headers(upstream)
        if status >= 400:
            data = error_answer(data, status, entry.name)
            headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
            headers.append((b"content-type", b"application/json"))
        if started:
            await send({"type": "http.response.body", "body": event(data), "more_body": False})
            return status
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        return status


def _with_standing(send: Send, limits: KeyLimits, admission: Admission) -> Send:
    """``send``, adding the key's ``x-ratelimit-*`` headers (:meth:`KeyLimits.headers`)
    to the response's start, whoever answers: OpenAI sends them on every answer. Read
    when the answer starts, so a request the router refused itself shows what it gave
    back."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {
                **message,
                "headers": [*message.get("headers", ()), *limits.headers(admission)],
            }
        await send(message)

    return sending


class _Meter:
    """What one request's accounting learns on its way: set by the proxy, read
    by :func:`_account` when the request ends."""

    __slots__ = ("metered", "stream", "usage", "whole")

    def __init__(self) -> None:
        self.metered = False
        # A stream's meter (router.accounting), or whether a whole answer is read.
        self.stream: StreamMeter | None = None
        self.whole = False
        self.usage: Usage | None = None

    def used(self) -> Usage | None:
        """The answer's usage, whole or streamed; ``None`` when none was read."""
        return self.stream.usage if self.stream is not None else self.usage


def _account(
    bound: RequestMetrics,
    key: str,
    status: int,
    refused: bool,
    meter: _Meter,
    started: float,
    ended: float,
) -> None:
    stream = meter.stream
    if stream is None:
        bound.account(key, status, refused, meter.usage, metered=meter.metered)
        return
    first = None if stream.first_at is None else stream.first_at - started
    bound.account(key, status, refused, stream.usage, first, ended - started, meter.metered)


def _payload(body: bytes | bytearray) -> bytes | bytearray | AsyncIterator[memoryview]:
    """What aiohttp sends of ``body``: a large one in slices of the one buffer.

    Measured (bench/slow_uploads.py): handed whole, aiohttp joins the request head
    and the body into one new bytes object (its writelines fallback before Python
    3.12.9) and the transport copies what the socket did not take: three copies of
    each 50 MiB body, 3.1 GB of RSS under a 1 GiB body budget. In slices, each one
    awaits the socket (aiohttp drains past 64 KiB), so no copy outgrows a slice.
    A new iterator per attempt: a retry sends the body again from its start."""
    if len(body) <= SEND_SLICE_BYTES:
        return body
    return _slices(memoryview(body))


async def _slices(view: memoryview) -> AsyncIterator[memoryview]:
    for start in range(0, len(view), SEND_SLICE_BYTES):
        yield view[start : start + SEND_SLICE_BYTES]


def _not_utf8(name: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"The request's header {name} is not UTF-8, so the router cannot pass it on "
        "unchanged (it forwards header values as UTF-8)."
    )


def _replica_refuses(limit: str) -> errors.HeadersTooLarge:
    return errors.HeadersTooLarge(
        f"The request's headers exceed what a model's server (llama-server) accepts: {limit}."
    )


def _target(scope: Scope) -> str:
    """The path and query the replica receives (:mod:`router.routes`): the route from
    the router's table, never the client's spelling of it. Raises 404 for a path
    that is not a model route (the app sends none here), 400 for a query string
    no URL may carry and 414 for a target over :data:`REPLICA_TARGET_MAX` bytes."""
    route = model_route(scope)
    if route is None:
        raise _NotFound(f"{scope['method']} {scope['path']}: Not Found")
    query = upstream_query(scope.get("query_string", b""))
    if query is None:
        raise errors.InvalidRequest(
            "The query string holds a byte a URL may not carry (a control character, a "
            "space, a '#' or a non-ASCII byte); percent-encode it."
        )
    target = f"{route}?{query}" if query else route
    if len(target) > REPLICA_TARGET_MAX:
        raise errors.UriTooLong(
            f"The request's path and query are {len(target)} bytes; the router passes at "
            f"most {REPLICA_TARGET_MAX} to a model's server."
        )
    return target


class _NotFound(errors.InvalidRequest):
    status = 404
    code = "not_found"


class _MethodNotAllowed(errors.InvalidRequest):
    status = 405
    code = "method_not_allowed"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"allow", b"POST")]


async def send_error(send: Send, exc: errors.RouterError, close: bool = False) -> int:
    """Send ``exc`` as a complete OpenAI error response (with ``Connection: close``
    when ``close``); returns its status."""
    status, headers, body = errors.render(exc)
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return status
