"""The planner's admin API (FastAPI), served by `planner serve` beside the watcher.

Routes:
  GET  /health                      {"status": "ok", "reconciled": bool}
  GET  /v1/models                   [ModelStatus] (planner.status: name, state, desired,
                                    running, ready, consecutive_failures, reason,
                                    last_error, since)
  GET  /v1/models/{name}            ModelStatus; 404 for a model that was never applied
  POST /v1/models/{name}/retry      lift parking and start again
  POST /v1/models/{name}/activate   a fresh placement answer (planner.activation):
                                    {"name", "status": serving|loading|parked|unplaceable,
                                     "reason", "last_error", "since", "eval_id"}
  POST /v1/usage                    {"models": [names]} -> 204: used now (idle scale-down)
The POST routes change things and need `Authorization: Bearer <token>`
(LLMGW_ADMIN_TOKEN; the router sends it as LLMGW_PLANNER_TOKEN).
Errors use {"error": {"message", "type", "code"}}, the shape the router uses.
Reads go to Nomad and Consul on each call: the admin API is for operators and
the router's rare questions, not a hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from planner import actions
from planner.activation import Activator, ModelNotFound
from planner.consul_client import ConsulClient
from planner.errors import PlannerError, Rejected
from planner.idle import IdleScaler
from planner.nomad_client import NomadClient
from planner.state import StateStore
from planner.status import gather, model_status
from planner.watcher import Watcher


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "planner_error", "code": code}},
                        status_code=status)


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


def create_app(nomad: NomadClient, consul: ConsulClient, token: str | None,
               watcher: Watcher | None = None, idle: IdleScaler | None = None) -> FastAPI:
    """The admin app; the watcher's and idle scaler's loops run for its lifetime."""
    activator = Activator(nomad, consul, StateStore(consul))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with aiohttp.ClientSession() as session:
            tasks = []
            if watcher is not None:
                tasks.append(asyncio.create_task(watcher.run(session), name="watcher"))
            if idle is not None:
                tasks.append(asyncio.create_task(idle.run(), name="idle-scaler"))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="llmgw planner", lifespan=lifespan)

    @app.exception_handler(PlannerError)
    async def planner_error(_: Request, exc: PlannerError) -> JSONResponse:
        status = 409 if isinstance(exc, Rejected) else 503
        return _error(status, type(exc).__name__, str(exc))

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "reconciled": bool(watcher and watcher.ready.is_set())}

    @app.get("/v1/models")
    def list_models() -> list[dict[str, Any]]:
        return [row.as_dict() for row in gather(nomad, consul)]

    @app.get("/v1/models/{name}", response_model=None)
    def get_model(name: str) -> dict[str, Any] | JSONResponse:
        record = consul.model_records().get(name)
        if record is None:
            return _error(404, "model_not_found", f"model {name!r} was never applied")
        return model_status(nomad, consul, name, record, StateStore(consul).load(name)).as_dict()

    @app.post("/v1/models/{name}/retry", response_model=None)
    def retry(name: str, authorization: str | None = Header(None)) -> dict[str, Any] | JSONResponse:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        record = consul.model_records().get(name)
        if record is None:
            return _error(404, "model_not_found", f"model {name!r} was never applied")
        state, done = actions.retry(nomad, StateStore(consul), name)
        return {**model_status(nomad, consul, name, record, state).as_dict(), "retry": done}

    @app.post("/v1/models/{name}/activate", response_model=None)
    async def activate(name: str,
                       authorization: str | None = Header(None)) -> dict[str, Any] | JSONResponse:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        try:
            return (await activator.activate(name)).as_dict()
        except ModelNotFound as exc:
            return _error(404, "model_not_found", str(exc))

    @app.post("/v1/usage", status_code=204, response_model=None)
    async def usage(body: Usage, authorization: str | None = Header(None)) -> JSONResponse | None:
        refusal = _authorized(authorization, token)
        if refusal is not None:
            return refusal
        await asyncio.to_thread(activator.used, body.models)
        return None

    app.state.activator = activator
    return app
