"""The planner's admin API (FastAPI), served by every `planner serve`.

Routes:
  GET  /health                      {"status", "role": leader|follower|candidate,
                                     "ready", "leader": {"id", "address"} | null}
  GET  /metrics                     Prometheus exposition (`planner.metrics`)
  GET  /v1/models                   [ModelStatus] (planner.status: name, state, desired,
                                    running, ready, failures, reason, last error,
                                    since, replicas with their node and failures)
  GET  /v1/models/{name}            ModelStatus; 404 for a model that was never applied
  POST /v1/models/{name}/retry      lift parking, or place stopped replicas again
  POST /v1/models/{name}/activate   a fresh placement answer: llmgw_contract.ActivationAnswer
  POST /v1/usage                    {"models": [names]} -> 204: used now (idle scale-down)

The POST routes change things and need `Authorization: Bearer <token>`
(LLMGW_ADMIN_TOKEN; the router sends it as LLMGW_PLANNER_TOKEN). Only the
leader acts: a follower forwards a POST to the leader's address (from
`llmgw/leader`) and relays its answer, or answers 503 `no_leader` with
Retry-After while an election is under way. GET routes are answered by any
instance from Nomad and Consul directly. Errors use {"error": {"message",
"type", "code"}}, the shape the router uses.

A leader that serves HTTPS (`planner serve --tls-cert`) advertises an https://
address; followers verify it with `forward_ssl` (LLMGW_PLANNER_CACERT, else the
system's CAs).
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
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from planner import actions
from planner.activation import ModelNotFound
from planner.errors import PlannerError, Rejected
from planner.serve import PlannerNode
from planner.status import gather, model_status

FORWARD_TIMEOUT_S = 30.0  # activation waits at most ~2 s for Nomad; room for a slow Nomad


def _error(status: int, code: str, message: str,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "planner_error", "code": code}},
                        status_code=status, headers=headers)


def _authorized(authorization: str | None, token: str | None) -> JSONResponse | None:
    """None when the bearer token matches; otherwise the refusal to send."""
    if not token:
        return _error(403, "admin_disabled", "no admin token is configured on this planner "
                                             "(set LLMGW_ADMIN_TOKEN)")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        return _error(401, "unauthorized", "a valid `Authorization: Bearer <token>` is required")
    return None


class Usage(BaseModel):
    models: list[str]


async def _forward(node: PlannerNode, request: Request, session: aiohttp.ClientSession) \
        -> Response:
    """Relay a write to the leader, or say that there is none right now."""
    leader = node.leadership.leader
    if leader is None or leader.id == node.leadership.id:
        return _error(503, "no_leader", "no planner holds the leader lock right now (an "
                      "election is under way); retry in a few seconds", {"Retry-After": "2"})
    headers = {k: v for k, v in request.headers.items()
               if k.lower() in ("authorization", "content-type")}
    try:
        async with session.post(leader.address.rstrip("/") + request.url.path,
                                data=await request.body(), headers=headers) as answer:
            body = await answer.read()
            return Response(body, status_code=answer.status,
                            media_type=answer.headers.get("Content-Type"))
    except aiohttp.ClientSSLError as exc:
        return _error(503, "leader_unverified", f"the leader at {leader.address} could not be "
                      f"verified ({type(exc).__name__}: {exc}); check LLMGW_PLANNER_CACERT "
                      "(the CA that signed the planners' --tls-cert)")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _error(503, "leader_unreachable", f"the leader at {leader.address} did not "
                      f"answer ({type(exc).__name__}: {exc}); retry shortly",
                      {"Retry-After": "2"})


def create_app(node: PlannerNode, token: str | None, run_node: bool = True,
               forward_ssl: ssl.SSLContext | None = None) -> FastAPI:
    """The admin app; with `run_node`, the node campaigns for its lifetime. `forward_ssl`
    verifies an https:// leader that writes are forwarded to (None: the system's CAs)."""
    nomad, consul = node.nomad, node.consul
    forwarder: dict[str, aiohttp.ClientSession] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=forward_ssl or True),
                timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)) as session:
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

    @app.exception_handler(PlannerError)
    async def planner_error(_: Request, exc: PlannerError) -> JSONResponse:
        status = 409 if isinstance(exc, Rejected) else 503
        return _error(status, type(exc).__name__, str(exc))

    @app.get("/health")
    def health() -> dict[str, Any]:
        leader = node.leadership.leader
        role = "leader" if node.is_leader else "follower" if leader else "candidate"
        return {"status": "ok", "role": role, "ready": node.ready, "id": node.leadership.id,
                "leader": None if leader is None else {"id": leader.id,
                                                       "address": leader.address}}

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = node.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    def list_models() -> list[dict[str, Any]]:
        return [row.as_dict() for row in gather(nomad, consul)]

    @app.get("/v1/models/{name}", response_model=None)
    def get_model(name: str) -> dict[str, Any] | JSONResponse:
        record = consul.model_records().get(name)
        if record is None:
            return _error(404, "model_not_found", f"model {name!r} was never applied")
        return model_status(nomad, consul, name, record).as_dict()

    @app.post("/v1/models/{name}/retry", response_model=None)
    async def retry(name: str, request: Request,
                    authorization: str | None = Header(None)) -> Any:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        if not node.is_leader:
            return await _forward(node, request, forwarder["session"])
        record = consul.model_records().get(name)
        if record is None:
            return _error(404, "model_not_found", f"model {name!r} was never applied")
        state, done = await asyncio.to_thread(actions.retry, nomad, node.store, name)
        row = await asyncio.to_thread(model_status, nomad, consul, name, record, state)
        return {**row.as_dict(), "retry": done}

    @app.post("/v1/models/{name}/activate", response_model=None)
    async def activate(name: str, request: Request,
                       authorization: str | None = Header(None)) -> Any:
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
    async def usage(body: Usage, request: Request,
                    authorization: str | None = Header(None)) -> Response | None:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        if not node.is_leader:
            return await _forward(node, request, forwarder["session"])
        known = await asyncio.to_thread(consul.model_records)
        await asyncio.to_thread(node.usage.used, [m for m in body.models if m in known])
        return None

    app.state.node = node
    return app
