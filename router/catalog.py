"""Reads what the router needs from Consul: models, their state, passing endpoints.

Three blocking queries, nothing else: the KV prefixes ``llmgw/models/`` (one
JSON definition per model, written by the planner) and ``llmgw/state/``
(parked / unplaceable, parsed by :mod:`router.state`), and
``/v1/health/service/llmgw-<model>?passing``. Called only by the watch loops in
:mod:`router.watch`; the request path never talks to Consul.

A small aiohttp client rather than py-consul's ``consul.aio``: that adapter
builds its connector with arguments aiohttp deprecates, returns the index as a
string and has no per-call timeout, and the router needs three GETs. Every
aiohttp, timeout and decoding failure leaves this module as
:class:`router.errors.CatalogUnavailable`.

Parsing is split into pure functions (:func:`parse_models`,
:func:`parse_endpoints`, :func:`router.state.parse_states`) that unit tests
drive with Consul's JSON shapes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from router.errors import CatalogUnavailable
from router.state import STATE_PREFIX, ModelState, parse_states

log = logging.getLogger(__name__)

MODELS_PREFIX = "llmgw/models/"
SERVICE_PREFIX = "llmgw-"


@dataclass(frozen=True, slots=True)
class ModelDefinition:
    """One defined model as the planner wrote it; unknown keys are ignored."""

    name: str
    definition_hash: str = ""
    replicas: int = 0
    source: str = ""
    profile: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True, slots=True, order=True)
class ServiceAddress:
    """Where a passing replica listens (Consul service address, else node address)."""

    host: str
    port: int


def service_name(model: str) -> str:
    """Consul service name the planner registers for ``model``."""
    return SERVICE_PREFIX + model


def parse_models(entries: list[dict[str, Any]] | None) -> dict[str, ModelDefinition]:
    """Turn a recursive KV read of :data:`MODELS_PREFIX` into ``{name: definition}``.

    ``entries`` is Consul's JSON list (``Key``, base64 ``Value``), or ``None``
    for a 404 (no key under the prefix). Keys nested deeper than
    ``llmgw/models/<name>`` and values that do not decode are skipped with a
    warning: one bad key must not hide every other model.
    """
    models: dict[str, ModelDefinition] = {}
    for entry in entries or ():
        key = entry.get("Key", "")
        name = key[len(MODELS_PREFIX) :]
        if not name or "/" in name:
            continue
        try:
            raw = base64.b64decode(entry.get("Value") or "")
            doc = json.loads(raw)
            models[name] = _definition(name, doc)
        except (binascii.Error, ValueError, TypeError) as exc:
            log.warning("skipping Consul KV key %s: not a model definition (%s)", key, exc)
    return models


def _definition(name: str, doc: Any) -> ModelDefinition:
    if not isinstance(doc, dict):
        raise TypeError("value is not a JSON object")
    if doc.get("name", name) != name:
        # The key is what the planner addresses the model by; trust it.
        log.warning("KV %s%s names model %r; using %r", MODELS_PREFIX, name, doc["name"], name)
    profile = doc.get("profile")
    return ModelDefinition(
        name=name,
        definition_hash=str(doc.get("definition_hash", "")),
        replicas=int(doc.get("replicas", 0)),
        source=str(doc.get("source", "")),
        profile=profile if isinstance(profile, dict) else {},
    )


def parse_endpoints(entries: list[dict[str, Any]] | None) -> list[ServiceAddress]:
    """Turn ``/v1/health/service/...`` JSON into sorted, de-duplicated addresses.

    Uses ``Service.Address`` and falls back to ``Node.Address`` when the
    service registered none; entries without a port are skipped.
    """
    found: set[ServiceAddress] = set()
    for entry in entries or ():
        service = entry.get("Service") or {}
        node = entry.get("Node") or {}
        host = service.get("Address") or node.get("Address")
        port = service.get("Port")
        if host and isinstance(port, int) and port > 0:
            found.add(ServiceAddress(host, port))
    return sorted(found)


class ConsulCatalog:
    """Blocking reads against one Consul agent over a private aiohttp session.

    Create and close inside the running event loop (the router's lifespan).
    """

    def __init__(self, base_url: str, token: str | None = None) -> None:
        headers = {"X-Consul-Token": token} if token else {}
        # Separate from the upstream pool: different timeouts, and it must
        # survive until the watches are cancelled during shutdown.
        self._session = aiohttp.ClientSession(
            base_url=base_url, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
        )

    async def close(self) -> None:
        await self._session.close()

    async def models(self, index: int, wait_s: float) -> tuple[int, dict[str, ModelDefinition]]:
        """Blocking read of every model definition.

        Returns ``(consul_index, {name: definition})``; with ``index == 0``
        it answers at once. Raises :class:`CatalogUnavailable`.
        """
        index, body = await self._get("/v1/kv/" + MODELS_PREFIX, {"recurse": "true"}, index, wait_s)
        return index, parse_models(body)

    async def states(self, index: int, wait_s: float) -> tuple[int, dict[str, ModelState]]:
        """Blocking read of every parked or unplaceable model's state.

        Returns ``(consul_index, {name: state})``. Raises :class:`CatalogUnavailable`.
        """
        index, body = await self._get("/v1/kv/" + STATE_PREFIX, {"recurse": "true"}, index, wait_s)
        return index, parse_states(body)

    async def passing(
        self, model: str, index: int, wait_s: float
    ) -> tuple[int, list[ServiceAddress]]:
        """Blocking read of the passing endpoints of ``model``'s service.

        Returns ``(consul_index, addresses)``. Raises :class:`CatalogUnavailable`.
        """
        index, body = await self._get(
            "/v1/health/service/" + service_name(model), {"passing": "true"}, index, wait_s
        )
        return index, parse_endpoints(body)

    async def _get(
        self, path: str, params: dict[str, str], index: int, wait_s: float
    ) -> tuple[int, Any]:
        if index > 0:
            params = {**params, "index": str(index), "wait": f"{int(wait_s * 1000)}ms"}
        # Consul adds up to wait/16 of jitter to a blocking query.
        deadline = wait_s * 1.1 + 5.0
        try:
            async with asyncio.timeout(deadline), self._session.get(path, params=params) as resp:
                new_index = int(resp.headers.get("X-Consul-Index", "0"))
                if resp.status == 404:
                    return new_index, None
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise CatalogUnavailable(f"GET {path}: HTTP {resp.status}: {text}")
                return new_index, await resp.json(content_type=None)
        except CatalogUnavailable:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise CatalogUnavailable(f"GET {path}: {type(exc).__name__}: {exc}") from exc
