"""The planner's admin API (FastAPI), served by every `planner serve`.

Routes:
  GET  /health                      {"status", "role": leader|follower|candidate,
                                     "ready", "leader": {"id", "address"} (registered)
                                     | {"refused": {"code", "reason"}} | null}
  GET  /metrics                     Prometheus exposition (`planner.daemon.metrics`)
  GET  /v1/models                   [ModelStatus] (planner.model.status: name, state, desired,
                                    running, ready, failures, reason, last error,
                                    since, replicas with their node and failures)
  GET  /v1/models/{name}            ModelStatus; 404 for a model that was never applied
  POST /v1/models/{name}/retry      lift parking, or place stopped replicas again
  POST /v1/models/{name}/activate   a fresh placement answer: llmgw_contract.ActivationAnswer
  POST /v1/usage                    llmgw_contract.UsageReport -> 204: {"models": [names]}
                                    used now (idle scale-down); with "router", "interval_s"
                                    and "load" ({model: {inflight, waiting}}): that router's
                                    requests now (load-based scaling, `planner.daemon.demand`)

The POST routes change things and need `Authorization: Bearer <token>`
(LLMGW_ADMIN_TOKEN; the router sends it as LLMGW_PLANNER_TOKEN). Only the
leader acts: a follower forwards a POST, token included, to the address the
lock holder registered in Consul (`planner.daemon.leader`: the `llmgw-planner`
instance bound to the lock session's check, never the text of `llmgw/leader`
alone) and relays its answer, without following redirects. It answers 503
`no_leader` with Retry-After while an election is under way, and 503 with a
`leader_*` code (`llmgw_contract.leadership.Refusal`: `leader_mismatch` when
the key names another planner or address than the registration) when the
holder's address cannot be trusted; nothing is sent then, and
`llmgw_planner_leader_forward_refusals_total{code}` counts it. GET routes are answered by any
instance from Nomad and Consul directly. Errors use {"error": {"message",
"type", "code"}}, the shape the router uses, FastAPI's own included (422
`invalid_request`, 400, 404). A request body is bounded (`planner.api.bodybound`:
1 MiB, 413 `body_too_large`).

A leader that serves HTTPS (`planner serve --tls-cert`) registers the https
scheme; followers verify its certificate, host name included, against the
registered address with `forward_ssl` (LLMGW_PLANNER_CACERT, else the system's
CAs); a context that skips either check is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from llmgw_contract import UsageReport
from llmgw_contract.leadership import LeaderRefused
from planner.agents.statusreads import gather, model_status
from planner.api.bodybound import BodyBound
from planner.daemon import repair
from planner.daemon.activation import ModelNotFound
from planner.daemon.serve import PlannerNode
from planner.errors import PlannerError, Rejected

FORWARD_TIMEOUT_S = 30.0  # activation waits at most ~2 s for Nomad; room for a slow Nomad


def _error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "planner_error", "code": code}},
        status_code=status,
        headers=headers,
    )


def _authorized(authorization: str | None, token: str | None) -> JSONResponse | None:
    """None when the bearer token matches; otherwise the refusal to send."""
    if not token:
        return _error(
            403,
            "admin_disabled",
            "no admin token is configured on this planner (set LLMGW_ADMIN_TOKEN)",
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        return _error(401, "unauthorized", "a valid `Authorization: Bearer <token>` is required")
    return None


async def _forward(node: PlannerNode, request: Request, session: aiohttp.ClientSession) -> Response:
    """Relay a write to where the lock holder registered, or say why not."""
    route = node.leadership.route
    if isinstance(route, LeaderRefused):
        node.metrics.forward_refusals.labels(route.code.value).inc()
        return _error(
            503,
            route.code.value,
            f"this follower does not forward writes to the leader now: {route.reason}",
            {"Retry-After": "2"} if route.code.transient else None,
        )
    if route is None or route.planner_id == node.leadership.id:
        return _error(
            503,
            "no_leader",
            "no planner holds the leader lock right now (an "
            "election is under way); retry in a few seconds",
            {"Retry-After": "2"},
        )
    headers = {
        k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")
    }
    try:
        # No redirects: the token goes to the registered address and nowhere else.
        async with session.post(
            route.url + request.url.path,
            data=await request.body(),
            headers=headers,
            allow_redirects=False,
        ) as answer:
            body = await answer.read()
            return Response(
                body, status_code=answer.status, media_type=answer.headers.get("Content-Type")
            )
    except aiohttp.ClientSSLError as exc:
        return _error(
            503,
            "leader_unverified",
            f"the leader at {route.url} could not be "
            f"verified ({type(exc).__name__}: {exc}); check LLMGW_PLANNER_CACERT "
            "(the CA that signed the planners' --tls-cert, for the host name they "
            "register)",
        )
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _error(
            503,
            "leader_unreachable",
            f"the leader at {route.url} did not "
            f"answer ({type(exc).__name__}: {exc}); retry shortly",
            {"Retry-After": "2"},
        )


def _verifying(context: ssl.SSLContext | None) -> ssl.SSLContext | bool:
    """`context` for forwarding, once it is known to check the certificate and the host
    name (the token must not reach a host that merely has some valid certificate)."""
    if context is None:
        return True  # aiohttp's default: the system's CAs, host name checked
    if context.verify_mode != ssl.CERT_REQUIRED or not context.check_hostname:
        raise ValueError(
            "the context for forwarding writes to the leader must verify its "
            "certificate and host name"
        )
    return context


def create_app(
    node: PlannerNode,
    token: str | None,
    run_node: bool = True,
    forward_ssl: ssl.SSLContext | None = None,
) -> FastAPI:
    """The admin app; with `run_node`, the node campaigns for its lifetime. `forward_ssl`
    verifies an https:// leader that writes are forwarded to (None: the system's CAs);
    raises ValueError when it does not check certificates and host names."""
    nomad, consul = node.nomad, node.consul
    verify = _verifying(forward_ssl)
    forwarder: dict[str, aiohttp.ClientSession] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=verify),
            timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S),
        ) as session:
            forwarder["session"] = session
            task = asyncio.create_task(node.run(), name="planner-node") if run_node else None
            try:
                yield
            finally:
                if task is not None:
                    await node.stop()
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

    app = FastAPI(title="llmgw planner", lifespan=lifespan)

    app.add_middleware(BodyBound)

    @app.exception_handler(PlannerError)
    async def planner_error(_: Request, exc: PlannerError) -> JSONResponse:
        status = 409 if isinstance(exc, Rejected) else 503
        return _error(status, type(exc).__name__, str(exc))

    # Every error in the one shape the module docstring promises, FastAPI's own too
    # (a body too large, one that does not parse, an unknown route, a failed validation).
    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = "body_too_large" if exc.status_code == 413 else f"http_{exc.status_code}"
        return _error(exc.status_code, code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
            for e in exc.errors()[:5]
        )
        return _error(422, "invalid_request", where or "invalid request")

    @app.get("/health")
    def health() -> dict[str, Any]:
        route = node.leadership.route
        role = "leader" if node.is_leader else "follower" if route else "candidate"
        leader: dict[str, Any] | None = None
        if node.is_leader:
            leader = {"id": node.leadership.id, "address": node.leadership.address}
        elif isinstance(route, LeaderRefused):
            leader = {"refused": {"code": route.code.value, "reason": route.reason}}
        elif route is not None:
            leader = {"id": route.planner_id, "address": route.url}
        return {
            "status": "ok",
            "role": role,
            "ready": node.ready,
            "id": node.leadership.id,
            "leader": leader,
        }

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = node.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    def list_models() -> list[dict[str, Any]]:
        return [row.as_dict() for row in gather(nomad, consul)]

    @app.get("/v1/models/{name}", response_model=None)
    def get_model(name: str) -> dict[str, Any] | JSONResponse:
        record = consul.model_records().get(name) or repair.record_in_job(nomad, name)
        if record is None:
            return _error(404, "model_not_found", f"model {name!r} was never applied")
        return model_status(nomad, consul, name, record).as_dict()

    @app.post("/v1/models/{name}/retry", response_model=None)
    async def retry(name: str, request: Request, authorization: str | None = Header(None)) -> Any:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        if not node.is_leader:
            return await _forward(node, request, forwarder["session"])
        record = await asyncio.to_thread(repair.record_or_restored, nomad, consul, node.store, name)
        if record is None:
            return _error(404, "model_not_found", f"model {name!r} was never applied")
        state, done = await asyncio.to_thread(node.retry, name)
        row = await asyncio.to_thread(model_status, nomad, consul, name, record, state)
        return {**row.as_dict(), "retry": done}

    @app.post("/v1/models/{name}/activate", response_model=None)
    async def activate(
        name: str, request: Request, authorization: str | None = Header(None)
    ) -> Any:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        if not node.is_leader:
            return await _forward(node, request, forwarder["session"])
        try:
            return (await node.activator.activate(name)).model_dump(mode="json")
        except ModelNotFound as exc:
            return _error(404, "model_not_found", str(exc))

    @app.post("/v1/usage", status_code=204, response_model=None)
    async def usage(
        body: UsageReport, request: Request, authorization: str | None = Header(None)
    ) -> Response | None:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        if not node.is_leader:
            return await _forward(node, request, forwarder["session"])
        known = await asyncio.to_thread(consul.model_records)
        await asyncio.to_thread(node.usage.used, [m for m in body.models if m in known])
        node.demand.report(
            body.model_copy(update={"load": {m: v for m, v in body.load.items() if m in known}})
        )
        return None

    app.state.node = node
    return app
