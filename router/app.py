"""The router's ASGI app: :func:`create_app` wires table, watches, proxy and routes.

Called by :mod:`router.cli` (which runs it under uvicorn) and by tests. Nothing
starts at import or at :func:`create_app`; the lifespan opens the upstream
aiohttp pool, the Consul watches, the planner client (activation, usage
reports) and, with API keys, the task that follows the keys file on startup,
and closes them, with the replicas' ``/props`` reads (:mod:`router.capacity`),
in named steps, on shutdown.

Routes:

- every model-addressed ``POST`` (OpenAI's and llama-server's model routes, sent
  exactly as listed in :mod:`router.routes`): :class:`router.proxy.Proxy`, a
  plain ASGI handler that :class:`RouterApp` calls before any of Starlette's
  middleware, routing or dependency injection.
- ``GET /v1/models``: defined models (Consul KV records and ``llmgw-<model>``
  services) in OpenAI's list shape; ``GET /v1/models/{id}``: one, in OpenAI's
  shape, with the router's view of it under ``llmgw``. Both 503
  ``router_starting`` until Consul was read; an undefined model is 404
  ``model_not_found``. With router API keys (:mod:`router.keys`), a key is
  needed and only its models are listed or described.

With ``cors_origins`` set, Starlette's CORS middleware stands in front of
everything (:func:`with_cors`): preflights are answered there, and every
answer to an allowed origin, errors and streams included, carries the headers.
- ``GET /health``: 200 once the model list was read from Consul, else 503.
- ``GET /metrics``: Prometheus exposition, the certificate expiry series of every
  configured certificate file included (:mod:`llmgw_contract.certificates`).

Every error, including FastAPI's own 404/405/500, leaves in OpenAI's
error-object shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from llmgw_contract.certificates import CertificateCollector
from router import errors
from router import workers as router_workers
from router.activation import Activator
from router.capacity import CapacityReader
from router.catalog import ConsulCatalog
from router.endpoints import EndpointTable, ModelEntry
from router.intake import BodyBudget, default_budget
from router.keys import ConsulKeys, KeysFile, KeySource
from router.limits import KeyLimits
from router.metrics import RouterMetrics
from router.outliers import OutlierDetector, OutlierPolicy
from router.plannerapi import PlannerAPI
from router.planners import PlannerCandidates
from router.prefix import PrefixChooser
from router.proxy import NoEndpoint, Proxy, Receive, Scope, Send
from router.refusals import refuse_at_once
from router.replicaload import LoadSampler
from router.routes import model_route
from router.settings import RouterSettings
from router.sharedlimits import ConsulCounters
from router.usage import UsageReporter
from router.watch import ConsulWatcher

log = logging.getLogger(__name__)


class RouterApp(FastAPI):
    """FastAPI, except that proxied paths go straight to the :class:`Proxy`.

    Measured on the 2-core bench: Starlette's middleware stack (error
    middleware, FastAPI's telemetry and body-limit layers, the send wrapper)
    cost about 8% of the router's CPU per proxied request. The proxy renders
    its own OpenAI errors, so it needs none of it.
    """

    proxy: Proxy
    # What a request meets first when CORS is configured (create_app): the
    # CORS gate, in front of route.
    entry: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.entry is not None:
            await self.entry(scope, receive, send)
        elif scope["type"] == "http" and model_route(scope) is not None:
            await self.proxy(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Model-addressed requests (:mod:`router.routes`) to the proxy, the rest to FastAPI."""
        if scope["type"] == "http" and model_route(scope) is not None:
            await self.proxy(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def with_cors(app: ASGIApp, origins: tuple[str, ...]) -> ASGIApp:
    """``app`` behind Starlette's CORS middleware for ``origins`` (none: ``app`` itself).

    The middleware answers preflights itself and adds the CORS headers to the
    ``http.response.start`` of every answer, errors and streams included
    (it wraps ``send``). Only requests with an ``Origin`` header reach it
    (:class:`_OriginGate`).
    """
    if not origins:
        return app
    cors = CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],
        # What a browser client needs to read from an answer: when to retry,
        # and the OpenAI SDK's own retry hint.
        expose_headers=["Retry-After", "x-should-retry"],
        max_age=600,
    )
    return _OriginGate(app, cors)


class _OriginGate:
    """Sends requests that carry an ``Origin`` header through ``cors``, the rest
    straight to ``app``. Measured: Starlette's middleware costs 5-6 us per request
    even without an ``Origin`` (it builds a ``Headers`` view first); this scan,
    well under 1 us. Servers lowercase header names (ASGI)."""

    __slots__ = ("app", "cors")

    def __init__(self, app: ASGIApp, cors: ASGIApp) -> None:
        self.app = app
        self.cors = cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, _ in scope["headers"]:
                if name == b"origin":
                    await self.cors(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def upstream_session(settings: RouterSettings) -> aiohttp.ClientSession:
    """The aiohttp session every proxied request shares: a keep-alive pool per
    replica (``max_connections_per_replica``), not one for all, so one model's
    long streams never hold the connections another model's request needs.

    Relays bytes verbatim (no decompression, no cookies; the proxy sets
    Accept-Encoding itself) and times out on connect and on silence, never on total
    duration: a long generation is not an error.
    """
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections,
        limit_per_host=settings.max_connections_per_replica,
        # Under llama-server's own 5 s (cpp-httplib's CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND):
        # a request is never sent on a connection the replica is closing, which
        # would fail after the request went out and so could not be retried.
        keepalive_timeout=4,
        ttl_dns_cache=60,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.upstream_connect_timeout_s,
            sock_read=settings.upstream_read_timeout_s,
        ),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )


def control_session(settings: RouterSettings) -> aiohttp.ClientSession:
    """The session for the router's own small calls to replicas (``/props``, the
    first-byte liveness probe): a pool of its own, so a replica whose request
    pool is full is still asked."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=4, keepalive_timeout=4),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.upstream_connect_timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


def create_app(settings: RouterSettings, *, no_endpoint: NoEndpoint | None = None) -> FastAPI:
    """Build the router app for ``settings``.

    ``no_endpoint`` decides what a request for a defined model with no passing
    endpoint gets. By default that is on-demand activation through the
    planners (:class:`router.activation.Activator`): the leader the Consul
    watches find, ``settings.planner_url`` and the other ``llmgw-planner``
    instances (:class:`router.planners.PlannerCandidates`), with usage reports
    (:class:`router.usage.UsageReporter`); with ``settings.activation`` off,
    :func:`router.refusals.refuse_at_once`. A parked model is refused before it
    is asked. The returned app's ``state`` carries ``table``, ``metrics``,
    ``proxy``, ``activator``, ``planners`` and ``usage`` (``None`` without
    activation), ``capacity`` (``None`` with a fixed
    ``settings.replica_concurrency``) and, while running, ``watcher``. The
    activator needs the lifespan (it opens the planner client there).
    """
    metrics = RouterMetrics()
    metrics.registry.register(CertificateCollector(settings.certificate_files))
    capacity: CapacityReader | None = None
    if not settings.replica_concurrency:
        capacity = CapacityReader(
            lambda: proxy.control, settings.props_timeout_s, settings.max_connections_per_replica
        )
    table = EndpointTable(
        metrics,
        default_limit=settings.initial_replica_limit,
        on_joined=None if capacity is None else capacity.joined,
    )
    planners: PlannerCandidates | None = None
    planner: PlannerAPI | None = None
    activator: Activator | None = None
    usage: UsageReporter | None = None
    if settings.activation:
        planners = PlannerCandidates(settings.fixed_planner_url, metrics, settings.planner_scheme)
        planner = PlannerAPI(
            planners,
            settings.planner_token,
            settings.activate_timeout_s,
            settings.planner_ssl_context(),
        )
        activator = Activator(table, planner, window_s=settings.activation_window_s)
        usage = UsageReporter(table, planner, settings.usage_interval_s)
    if no_endpoint is None:
        no_endpoint = activator if activator is not None else refuse_at_once
    keys: KeySource | None = None
    if settings.api_keys_file:
        keys = KeysFile(settings.api_keys_file)
    elif settings.api_keys_consul:
        keys = ConsulKeys()
    limits: KeyLimits | None = None
    if keys is not None:
        limits = KeyLimits(shared=settings.shared_limits, fail_open=metrics.limits_fail_open.inc)
        shared_limits = limits
        metrics.limits_shared.set_function(
            lambda: float(shared_limits.shared and not shared_limits.failing_open)
        )
    proxy = Proxy(
        table,
        metrics,
        max_body_bytes=settings.max_body_bytes,
        max_attempts=settings.max_attempts,
        queue_timeout_s=settings.queue_timeout_s,
        busy_retry_after_s=settings.busy_retry_after_s,
        no_endpoint=no_endpoint,
        prefix=PrefixChooser(settings.prefix_load_factor, prefix_chars=settings.prefix_chars)
        if settings.routing == "prefix"
        else None,
        keys=keys,
        forward_authorization=settings.forward_authorization,
        accounting=settings.accounting,
        ask_stream_usage=settings.ask_stream_usage,
        limits=limits,
        first_byte_timeout_s=settings.first_byte_timeout_s,
        stall_timeout_s=settings.stall_timeout_s,
        loading_heartbeat_s=settings.loading_heartbeat_s,
        # --workers N: each worker holds its share of the router's bounds, so that
        # all of them together hold what one router would (router.workers.share).
        max_requests=router_workers.share(settings.max_requests, settings.workers),
        budget=BodyBudget(
            router_workers.share(settings.max_bodies_bytes or default_budget(), settings.workers),
            settings.busy_retry_after_s,
        ),
        body_read_timeout_s=settings.body_read_timeout_s,
        body_min_rate=settings.body_min_rate,
        outliers=OutlierDetector(
            OutlierPolicy(
                consecutive_failures=settings.eject_after_failures,
                consecutive_5xx=settings.eject_after_5xx,
                base_ejection_s=settings.ejection_base_s,
                max_ejection_s=settings.ejection_max_s,
            )
        ),
    )

    budget = proxy.budget
    metrics.follow_bodies(lambda: budget.held, budget.limit)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheme, host, port = settings.consul_location()
        catalog = ConsulCatalog(
            f"{scheme}://{host}:{port}", settings.consul_token, settings.consul_ssl_context()
        )
        counters: ConsulCounters | None = None
        if limits is not None and limits.shared:
            calls = metrics.limits_consul_calls
            counters = ConsulCounters(
                f"{scheme}://{host}:{port}",
                settings.consul_token,
                settings.consul_ssl_context(),
                counted=lambda outcome: calls.labels(outcome=outcome).inc(),
            )
            limits.attach(counters)
        proxy.session = upstream_session(settings)
        proxy.control = control_session(settings)
        watcher = ConsulWatcher(
            catalog,
            table,
            wait_s=settings.watch_wait_s,
            backoff_max_s=settings.watch_backoff_max_s,
            planners=planners,
            keys=keys if isinstance(keys, ConsulKeys) else None,
        )
        app.state.watcher = watcher
        watcher.start()
        sampler = LoadSampler(
            lambda: (entry.endpoints for entry in table.entries()),
            lambda: proxy.control,
            settings.shared_load_interval_s,
        )
        sampler.start()
        following = asyncio.ensure_future(keys.follow()) if isinstance(keys, KeysFile) else None
        if planner is not None and usage is not None:
            await planner.start()
            usage.start()
        log.info(
            "router started: Consul at %s://%s:%d; upstream timeouts: connect %ss, first byte "
            "%ss, silence %ss; CORS origins: %s; per replica %s in flight, queue timeout %gs; "
            "request bodies held at once: at most %d bytes; routing %s; %s",
            scheme,
            host,
            port,
            settings.upstream_connect_timeout_s,
            settings.first_byte_timeout_s,
            settings.upstream_read_timeout_s,
            ", ".join(settings.cors_origins) or "none",
            settings.replica_concurrency
            or f"its /props slot count (else {settings.default_replica_concurrency})",
            settings.queue_timeout_s,
            proxy.budget.limit,
            f"{settings.routing}, other routers' load read every "
            f"{settings.shared_load_interval_s:g} s"
            if settings.shared_load_interval_s
            else f"{settings.routing}, on this router's own load",
            f"activation through the planner leader (Consul), then "
            f"{settings.fixed_planner_url or 'no fixed planner URL'}, "
            f"then the other passing planners (window {settings.activation_window_s:g} s, "
            f"usage every {settings.usage_interval_s:g} s)"
            if planner is not None
            else "activation off",
        )
        try:
            yield
        finally:
            # uvicorn has already stopped accepting and drained connections.
            log.info("shutdown: cancelling Consul watches")
            await watcher.stop()
            if following is not None:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
            if planner is not None and usage is not None and activator is not None:
                log.info("shutdown: stopping usage reports and activate calls")
                await usage.stop()
                await activator.close()
                await planner.close()
            await sampler.close()
            log.info("shutdown: closing upstream connection pools")
            await proxy.first_byte.close()
            await proxy.outliers.close()
            if capacity is not None:
                await capacity.close()
            await proxy.session.close()
            await proxy.control.close()
            await proxy.bodies.close()
            if limits is not None:
                await limits.close()  # tokens still being written to the shared tallies
                await limits.give_back()  # the unused leases, to the other routers
            if counters is not None:
                await counters.close()
            await catalog.close()
            log.info("shutdown: done")

    app = RouterApp(
        title="llmgw router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # Starlette answers /health/ with a 307 to /health on the client's own Host
        # (found in review: "Host: evil.example" came back as its Location); the
        # router's paths are exact, and any other is a 404 error object.
        redirect_slashes=False,
    )
    app.state.table = table
    app.state.metrics = metrics
    app.state.proxy = proxy
    app.state.activator = activator
    app.state.planners = planners
    app.state.usage = usage
    app.state.capacity = capacity
    app.proxy = proxy
    if settings.cors_origins:
        app.entry = with_cors(app.route, settings.cors_origins)
    _add_routes(app, table, metrics, keys)
    _add_error_handlers(app)
    return app


def _add_routes(
    app: FastAPI, table: EndpointTable, metrics: RouterMetrics, keys: KeySource | None
) -> None:
    def allowed(request: Request) -> Callable[[str], bool]:
        """Which models the request's key may see (every one without router keys);
        raises InvalidApiKey (401)."""
        if keys is None:
            return lambda _: True
        header = request.headers.get("authorization")
        return keys.authenticate(None if header is None else header.encode("latin-1")).allows

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        may_see = allowed(request)
        _synced(table)
        names = [name for name in table.names() if may_see(name)]
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"} for name in names
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> JSONResponse:
        may_see = allowed(request)
        entry = table.get(model)
        # A model the key may not use is not the client's to learn about: the 404
        # the proxied routes answer (router.keys), whether it is defined or not.
        if not may_see(model):
            raise errors.ModelNotAllowed(model)
        if entry is None:
            _synced(table)
            raise errors.ModelNotFound(model)
        return JSONResponse(_model_object(entry))

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {
            "status": "ok" if table.synced else "starting",
            "models": len(table.names()),
            "models_with_endpoints": table.ready_count(),
        }
        return JSONResponse(body, status_code=200 if table.synced else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)


def _synced(table: EndpointTable) -> None:
    """Raise 503 ``router_starting`` until the models were read from Consul."""
    if not table.synced:
        raise errors.RouterStarting(
            "The router has not read its models from Consul yet. Retry in 1 s.", 1
        )


def _model_object(entry: ModelEntry) -> dict[str, object]:
    """OpenAI's model object, with what this router knows of it under ``llmgw``:
    replicas desired (``None`` when only its Consul service is known), passing,
    ejected (:mod:`router.outliers`), and the planner's parked / unplaceable record."""
    ejected = sum(1 for e in entry.endpoints if e.health.ejected)
    return {
        "id": entry.name,
        "object": "model",
        "created": 0,
        "owned_by": "llmgw",
        "llmgw": {
            "desired_replicas": entry.replicas,
            "passing_replicas": len(entry.endpoints),
            "ejected_replicas": ejected,
            "parked": None if entry.parked is None else entry.parked.model_dump(mode="json"),
            "unplaceable": None
            if entry.unplaceable is None
            else entry.unplaceable.model_dump(mode="json"),
        },
    }


def _openai_error(status: int, message: str, type_: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": None, "code": code}},
        status_code=status,
    )


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = _openai_error(exc.status_code, message, "invalid_request_error", code)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(errors.RouterError)
    async def router_error(request: Request, exc: errors.RouterError) -> JSONResponse:
        response = _openai_error(exc.status, exc.message, exc.type, exc.code)
        for key, value in exc.headers():
            response.headers[key.decode()] = value.decode()
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        message = "The router failed unexpectedly."
        return _openai_error(500, message, "server_error", "internal_error")
