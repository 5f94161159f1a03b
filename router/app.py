"""The router's ASGI app: :func:`create_app` wires table, watches, proxy and routes.

Called by :mod:`router.cli` (which runs it under uvicorn) and by tests. Nothing
starts at import or at :func:`create_app`; the lifespan opens the upstream
aiohttp pool, the Consul watches, the planner client (activation, usage
reports) and, with API keys, the task that follows the keys file on startup,
and closes them, with the replicas' ``/props`` reads (:mod:`router.capacity`),
in named steps, on shutdown.

Routes:

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``:
  :class:`router.proxy.Proxy`, a plain ASGI handler that :class:`RouterApp`
  calls before any of Starlette's middleware, routing or dependency injection.
- ``GET /v1/models``: defined models (Consul KV records and ``llmgw-<model>``
  services) in OpenAI's list shape; with router API keys (:mod:`router.keys`),
  a key is needed and only its models are listed.
- ``GET /health``: 200 once the model list was read from Consul, else 503.
- ``GET /metrics``: Prometheus exposition, the certificate expiry series of every
  configured certificate file included (:mod:`llmgw_contract.certificates`).

Every error, including FastAPI's own 404/405/500, leaves in OpenAI's
error-object shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw_contract.certificates import CertificateCollector
from router import errors
from router.activation import Activator
from router.capacity import CapacityReader
from router.catalog import ConsulCatalog
from router.endpoints import EndpointTable
from router.keys import KeysFile
from router.metrics import RouterMetrics
from router.plannerapi import PlannerAPI
from router.planners import PlannerCandidates
from router.prefix import PrefixChooser
from router.proxy import PROXY_PATHS, NoEndpoint, Proxy, Receive, Scope, Send
from router.refusals import refuse_at_once
from router.settings import RouterSettings
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PROXY_PATHS:
            await self.proxy(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def upstream_session(settings: RouterSettings) -> aiohttp.ClientSession:
    """The one aiohttp session every proxied request shares.

    Relays bytes verbatim (no decompression, no cookies; the proxy sets
    Accept-Encoding itself) and times out on connect and on silence, never on total
    duration: a long generation is not an error.
    """
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections,
        limit_per_host=0,
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
        capacity = CapacityReader(lambda: proxy.session, settings.props_timeout_s)
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
        planners = PlannerCandidates(settings.planner_url, metrics)
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
    keys = KeysFile(settings.api_keys_file) if settings.api_keys_file else None
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
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheme, host, port = settings.consul_location()
        catalog = ConsulCatalog(
            f"{scheme}://{host}:{port}", settings.consul_token, settings.consul_ssl_context()
        )
        proxy.session = upstream_session(settings)
        watcher = ConsulWatcher(
            catalog,
            table,
            wait_s=settings.watch_wait_s,
            backoff_max_s=settings.watch_backoff_max_s,
            planners=planners,
        )
        app.state.watcher = watcher
        watcher.start()
        following = None if keys is None else asyncio.ensure_future(keys.follow())
        if planner is not None and usage is not None:
            await planner.start()
            usage.start()
        log.info(
            "router started: Consul at %s://%s:%d; upstream timeouts: connect %ss, silence %ss; "
            "per replica %s in flight, queue timeout %gs; routing %s; %s",
            scheme,
            host,
            port,
            settings.upstream_connect_timeout_s,
            settings.upstream_read_timeout_s,
            settings.replica_concurrency
            or f"its /props slot count (else {settings.default_replica_concurrency})",
            settings.queue_timeout_s,
            settings.routing,
            f"activation through the planner leader (Consul), then {settings.planner_url}, "
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
            log.info("shutdown: closing upstream connection pool")
            if capacity is not None:
                await capacity.close()
            await proxy.session.close()
            await catalog.close()
            log.info("shutdown: done")

    app = RouterApp(
        title="llmgw router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.table = table
    app.state.metrics = metrics
    app.state.proxy = proxy
    app.state.activator = activator
    app.state.planners = planners
    app.state.usage = usage
    app.state.capacity = capacity
    app.proxy = proxy
    _add_routes(app, table, metrics, keys)
    _add_error_handlers(app)
    return app


def _add_routes(
    app: FastAPI, table: EndpointTable, metrics: RouterMetrics, keys: KeysFile | None
) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        names = table.names()
        if keys is not None:
            header = request.headers.get("authorization")
            key = keys.authenticate(None if header is None else header.encode("latin-1"))
            names = [name for name in names if key.allows(name)]
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
            for name in names
        ]
        return JSONResponse({"object": "list", "data": data})

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


def _openai_error(status: int, message: str, type_: str, code: str | None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": None, "code": code}},
        status_code=status,
    )


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
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
        return _openai_error(500, "The router failed unexpectedly.", "server_error", None)
