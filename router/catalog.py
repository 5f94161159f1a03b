"""Reads what the router needs from Consul: models, their state, services, passing
endpoints, and where the planners are.

Six kinds of blocking query, and plain reads, nothing else:

- the KV prefix ``llmgw/models/`` (one :class:`llmgw_contract.ModelRecord` per
  model, written by ``planner apply``);
- the KV prefix ``llmgw/routing/`` (one :class:`llmgw_contract.RoutingDocument`
  per model, the part of its state the router acts on, rewritten by the planner
  only when that part changes; the router keeps those that are parked or
  unplaceable), scanned as it arrives and decoded only where a key's
  ``ModifyIndex`` moved (:mod:`router.states`);
- ``/v1/catalog/services`` (every service and its tags): the models whose
  ``llmgw-<model>`` service has an instance registered, so a model that serves
  stays known when its KV record vanishes (an operator's
  ``consul kv delete -recurse llmgw/``, a restored snapshot);
- ``/v1/health/state/any`` filtered to the checks of ``llmgw-*`` services and
  of nodes (:data:`HEALTH_FILTER`): one query for every model's health, whatever
  the number of models (:func:`parse_check_states` sums it up per model);
- ``/v1/health/service/llmgw-<model>?passing``, a plain read (not blocking),
  only for a model whose checks just changed and has one passing: where its
  passing replicas listen;
- the KV key ``llmgw/leader`` (the leading planner's
  :class:`llmgw_contract.LeaderRecord`, while a session holds it), followed at
  each change by plain reads of the holder's session
  (``/v1/session/info/<id>``) and of every ``llmgw-planner`` instance, so that
  the leader's address is the one its session's check registered
  (:func:`llmgw_contract.leadership.resolve_leader`), never the key's text
  alone; and ``/v1/health/service/llmgw-planner?passing`` (every ``planner
  serve`` instance whose TTL check passes): where to send activate calls and
  usage reports (:mod:`router.planners`).

Called only by the watch loops in :mod:`router.watch`; the request path never
talks to Consul. Key and service names come from :mod:`llmgw_contract.keys`,
documents are decoded with :func:`llmgw_contract.decode`.

A small aiohttp client rather than py-consul's ``consul.aio``: that adapter
builds its connector with arguments aiohttp deprecates, returns the index as a
string and has no per-call timeout, and the router needs a few GETs. Every
aiohttp, timeout and decoding failure leaves this module as
:class:`router.errors.CatalogUnavailable`.

ACLs: the token (``CONSUL_HTTP_TOKEN``) needs the rules of acl/consul/router.hcl.
Consul filters a read those rules do not allow down to nothing, so
:meth:`ConsulCatalog.denied` asks Consul first (``/v1/internal/acl/authorize``,
:mod:`llmgw_contract.acl`; ``router serve`` refuses to start without them), and
a 403 met later (a token deleted meanwhile) is :class:`CatalogDenied` naming the rule.

TLS: for an ``https`` Consul the session verifies it and presents the client
certificate through the ``ssl.SSLContext`` that
:meth:`router.settings.RouterSettings.consul_ssl_context` builds; a failed
handshake is a :class:`CatalogUnavailable` naming the ``CONSUL_*`` files to check.

Why not one blocking ``/v1/health/service/llmgw-<model>`` per model: each holds
a connection for its whole wait, so 500 models needed 500 connections (the
client's cap of 100 starved the other watches: issue 10 found a router that
knew 123 of 500 models and never recovered). Consul 1.8 has no documented
query that returns every service's instances with their health, so the
cluster-wide checks say *which* models changed and a plain read of those few
says *where* their replicas are. The connections held are the six blocking
queries plus at most :data:`REFRESH_CONCURRENCY` short reads.

Parsing is split into pure functions (:func:`parse_models`,
:func:`parse_states`, :func:`parse_services`, :func:`parse_endpoints`,
:func:`parse_check_states`, :func:`parse_leader`) that unit tests drive with Consul's JSON shapes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import ssl
import urllib.parse
from collections import defaultdict
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from llmgw_contract import (
    LEADER_KEY,
    PLANNER_SERVICE,
    ROUTER_API_KEYS_KEY,
    SERVICE_PREFIX,
    KVPrefix,
    ModelRecord,
    RoutingDocument,
    decode,
    model_from_key,
    model_from_service,
    service_name,
)
from llmgw_contract.acl import (
    CONSUL_API_KEYS_READ,
    CONSUL_KV_READ,
    CONSUL_SERVICES_READ,
    CONSUL_SESSIONS_READ,
    ROUTER_POLICIES,
    Agent,
    Permission,
    TokenStatus,
    denial,
)
from llmgw_contract.documents import Document
from llmgw_contract.leadership import LeaderRefused, Refusal, Resolution, resolve_leader
from router.errors import CatalogDenied, CatalogUnavailable
from router.states import StateView, routed

log = logging.getLogger(__name__)

D = TypeVar("D", bound=Document)

# Every check of an llmgw-* service, and every node check (ServiceName empty:
# Consul's serfHealth and the like), which /health/service?passing also
# requires to pass. go-bexpr syntax; `matches` is in Consul 1.8's filter.
HEALTH_FILTER = f'ServiceName matches "^{SERVICE_PREFIX}" or ServiceName == ""'

# Short reads of /v1/health/service/... at once, at most: bounds the
# connections to Consul when many models change together (a router start
# with 1,000 serving models).
REFRESH_CONCURRENCY = 8

# The connection cap of the Consul client: the six blocking queries and the
# refresh reads, with room to spare; above it aiohttp would queue a request
# silently (the starvation issue 10 found).
MAX_CONSUL_CONNECTIONS = 32

# Pieces in which a streamed answer (the routing documents) is handed on as it arrives.
_PIECE_BYTES = 64 * 1024

Consume = Callable[[AsyncIterable[bytes] | None, int], Awaitable[Any]]
"""Makes a result of an answer's body, in pieces (``None``: a 404), and its index."""

CheckKey = tuple[str, str, str, str]
"""One check as the health watch compares it: (node, service ID, check ID, status)."""


@dataclass(frozen=True, slots=True)
class CheckState:
    """What the cluster-wide checks say about one model's service.

    ``checks`` are its instances' checks and the node checks of the nodes they
    run on: when they are the same as last time, its passing instances are too.
    ``any_passing``: some instance has every one of its checks and its node's
    checks passing (only then is there an address worth reading).
    """

    checks: frozenset[CheckKey]
    any_passing: bool


@dataclass(frozen=True, slots=True, order=True)
class ServiceAddress:
    """Where a passing replica listens (Consul service address, else node address)."""

    host: str
    port: int


def parse_documents(
    prefix: KVPrefix, kind: type[D], entries: list[dict[str, Any]] | None
) -> dict[str, D]:
    """Turn a recursive KV read of ``prefix`` into ``{model: document}``.

    ``entries`` is Consul's JSON list (``Key``, base64 ``Value``), or ``None``
    for a 404 (no key under the prefix). Keys nested deeper than
    ``<prefix><model>`` are ignored; a value that does not decode as ``kind``
    is skipped with a warning: one bad key must not hide every other model.
    """
    found: dict[str, D] = {}
    for entry in entries or ():
        key = entry.get("Key", "")
        name = model_from_key(prefix, key)
        if name is None:
            continue
        try:
            found[name] = decode(kind, base64.b64decode(entry.get("Value") or ""))
        except (binascii.Error, ValueError) as exc:
            log.warning("skipping Consul KV key %s: %s", key, exc)
    return found


def parse_models(entries: list[dict[str, Any]] | None) -> dict[str, ModelRecord]:
    """Every model record under ``llmgw/models/``; the key names the model."""
    models = parse_documents(KVPrefix.MODELS, ModelRecord, entries)
    for name, record in models.items():
        if record.name != name:
            # The key is what the planner addresses the model by; trust it.
            log.warning("Consul KV llmgw/models/%s names %r; using the key", name, record.name)
            models[name] = record.model_copy(update={"name": name})
    return models


def parse_states(entries: list[dict[str, Any]] | None) -> dict[str, RoutingDocument]:
    """The routing documents under ``llmgw/routing/`` that are parked or unplaceable.

    Those are all the router acts on, so the table holds nothing for a model
    that is fine.
    """
    states: dict[str, RoutingDocument] = {}
    for name, doc in parse_documents(KVPrefix.ROUTING, RoutingDocument, entries).items():
        kept = routed(doc)
        if kept is not None:
            states[name] = kept
    return states


def parse_services(services: dict[str, Any] | None) -> frozenset[str]:
    """The models with an ``llmgw-<model>`` service in a ``/v1/catalog/services``
    answer (``{service: [tags]}``); other services, the planner's own included,
    are ignored."""
    names = (model_from_service(service) for service in services or ())
    return frozenset(name for name in names if name)


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


def parse_check_states(checks: list[dict[str, Any]] | None) -> dict[str, CheckState]:
    """Sum up a ``/v1/health/state/any`` answer (Consul's check list) per model.

    Models whose service has no check registered are absent: Consul counts an
    instance with no check as passing, but every llmgw job registers one
    (planner/jobspecs/model.nomad.hcl), so such an instance is none of ours.
    """
    node_checks: dict[str, set[CheckKey]] = defaultdict(set)
    by_model: dict[str, set[CheckKey]] = defaultdict(set)
    for check in checks or ():
        node = check.get("Node") or ""
        service = check.get("ServiceName") or ""
        key = (node, check.get("ServiceID") or "", check.get("CheckID") or "",
               check.get("Status") or "")  # fmt: skip
        if not service:
            node_checks[node].add(key)
        elif (model := model_from_service(service)) is not None:
            by_model[model].add(key)
    states: dict[str, CheckState] = {}
    for model, keys in by_model.items():
        nodes = {key[0] for key in keys}
        failing_nodes = {n for n in nodes if any(k[3] != "passing" for k in node_checks[n])}
        failing = {(k[0], k[1]) for k in keys if k[3] != "passing"}
        any_passing = any((k[0], k[1]) not in failing and k[0] not in failing_nodes for k in keys)
        every = keys.union(*(node_checks[n] for n in nodes))
        states[model] = CheckState(frozenset(every), any_passing)
    return states


def parse_leader(
    entries: list[dict[str, Any]] | None,
    sessions: list[dict[str, Any]] | None = None,
    instances: list[dict[str, Any]] | None = None,
) -> Resolution:
    """Where the planner holding ``llmgw/leader`` registered, from Consul's answers: the
    key (``entries``), ``/v1/session/info/<its Session>`` (``sessions``) and
    ``/v1/health/service/llmgw-planner`` (``instances``).

    ``None`` for a 404 (no planner ever led) and a key no session holds (the lock
    was released: its record stays behind naming a planner that may be dead); a
    :class:`llmgw_contract.leadership.LeaderRoute` when the record agrees with the
    registration; else a :class:`llmgw_contract.leadership.LeaderRefused` (see
    :func:`llmgw_contract.leadership.resolve_leader`).
    """
    entry = (entries or [{}])[0]
    holder = entry.get("Session")
    try:
        value = base64.b64decode(entry.get("Value") or "", validate=True)
    except (binascii.Error, ValueError) as exc:
        return (
            LeaderRefused(
                Refusal.RECORD_INVALID, f"the value of {LEADER_KEY} is not base64 ({exc})"
            )
            if holder
            else None
        )
    return resolve_leader(holder, value, (sessions or [None])[0], instances)


class ConsulCatalog:
    """Blocking reads against one Consul agent over a private aiohttp session.

    Create and close inside the running event loop (the router's lifespan).
    Every read returns ``(consul_index, parsed)``; with ``index == 0`` it
    answers at once. Every read raises :class:`CatalogUnavailable`.
    """

    def __init__(
        self, base_url: str, token: str | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        headers = {"X-Consul-Token": token} if token else {}
        self.base_url = base_url
        self._token = token
        # Separate from the upstream pool: different timeouts, and it must
        # survive until the watches are cancelled during shutdown.
        # The state documents as last read: a read decodes only what changed.
        self.state_view = StateView()
        self._session = aiohttp.ClientSession(
            base_url=base_url,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(ssl=ssl_context or True, limit=MAX_CONSUL_CONNECTIONS),
        )

    async def close(self) -> None:
        await self._session.close()

    async def models(self, index: int, wait_s: float) -> tuple[int, dict[str, ModelRecord]]:
        """Blocking read of every model record (``{name: record}``)."""
        index, body = await self._kv(KVPrefix.MODELS, index, wait_s)
        return index, parse_models(body)

    async def states(self, index: int, wait_s: float) -> tuple[int, dict[str, RoutingDocument]]:
        """Blocking read of every parked or unplaceable model's state (``{name: document}``),
        decoding only the keys that changed since the last read (:mod:`router.states`:
        unchanged documents are the same objects)."""
        return await self._get(
            f"/v1/kv/{KVPrefix.ROUTING}", {"recurse": "true"}, index, wait_s, self.state_view.read
        )

    async def services(self, index: int, wait_s: float) -> tuple[int, frozenset[str]]:
        """Blocking read of the models with a registered ``llmgw-<model>`` service."""
        index, body = await self._get("/v1/catalog/services", {}, index, wait_s)
        return index, parse_services(body)

    async def check_states(self, index: int, wait_s: float) -> tuple[int, dict[str, CheckState]]:
        """Blocking read of every model's checks (``{model: state}``), in one query."""
        index, body = await self._get(
            "/v1/health/state/any", {"filter": HEALTH_FILTER}, index, wait_s
        )
        return index, parse_check_states(body)

    async def passing(self, model: str) -> list[ServiceAddress]:
        """The passing endpoints of ``model``'s service, read at once (not blocking)."""
        return (await self._passing(service_name(model), 0, 0.0))[1]

    async def leader(self, index: int, wait_s: float) -> tuple[int, Resolution]:
        """Blocking read of ``llmgw/leader``, then where its holder registered
        (:func:`parse_leader`; ``None``: no session holds it)."""
        index, body = await self._kv(LEADER_KEY, index, wait_s, recurse=False)
        holder = (body or [{}])[0].get("Session")
        if not holder:
            return index, None
        # Plain reads, at each change of the key only: a session or a registration
        # does not change under a held lock without the key changing too (a check
        # that lapses invalidates the session, which releases the lock).
        _, sessions = await self._get(
            "/v1/session/info/" + urllib.parse.quote(str(holder), safe=""), {}, 0, 0.0
        )
        _, instances = await self._get("/v1/health/service/" + PLANNER_SERVICE, {}, 0, 0.0)
        return index, parse_leader(body, sessions, instances)

    async def api_keys(self, index: int, wait_s: float) -> tuple[int, bytes | None]:
        """Blocking read of the API keys document ``llmgw-router/api-keys`` (``None``:
        absent)."""
        index, body = await self._kv(ROUTER_API_KEYS_KEY, index, wait_s, recurse=False)
        entry = (body or [None])[0]
        if entry is None:
            return index, None
        try:
            return index, base64.b64decode(entry.get("Value") or "")
        except binascii.Error as exc:
            raise CatalogUnavailable(f"Consul KV {ROUTER_API_KEYS_KEY}: {exc}") from exc

    async def planners(self, index: int, wait_s: float) -> tuple[int, list[ServiceAddress]]:
        """Blocking read of the admin addresses of the passing ``llmgw-planner`` instances."""
        return await self._passing(PLANNER_SERVICE, index, wait_s)

    async def denied(self, needs: tuple[Permission, ...]) -> str | None:
        """Which of ``needs`` the token is denied, asked of Consul's
        ``/v1/internal/acl/authorize`` (changes nothing): ``None`` when all are allowed
        or Consul enforces no ACLs, else the sentence that names them. Raises
        :class:`CatalogUnavailable` when Consul cannot be asked."""
        body = [p.authorize_request() for p in needs]
        path = "/v1/internal/acl/authorize"
        try:
            async with asyncio.timeout(10), self._session.post(path, json=body) as resp:
                text = await resp.text()
                if resp.status == 401:  # "ACL support disabled": everything is allowed
                    return None
                if resp.status == 403:
                    return self._denial([p.rule for p in needs], text)
                if resp.status != 200:
                    raise CatalogUnavailable(f"POST {path}: HTTP {resp.status}: {text[:200]}")
                answers = await resp.json(content_type=None)
        except CatalogUnavailable:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise CatalogUnavailable(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        rules = [p.rule for p, a in zip(needs, answers or [], strict=False) if not a.get("Allow")]
        return self._denial(rules, "") if rules else None

    def _denial(self, rules: list[str], detail: str, action: str = "") -> str:
        """The sentence for `rules` denied; Consul says "ACL not found" for a token it
        does not know."""
        token = (
            TokenStatus.UNKNOWN
            if "ACL not found" in detail
            else TokenStatus.VALID
            if self._token
            else TokenStatus.EMPTY
        )
        return denial(
            Agent.CONSUL,
            rules,
            token,
            ROUTER_POLICIES[Agent.CONSUL],
            action,
            detail.strip() if token is TokenStatus.UNKNOWN else "",
        )

    async def _passing(
        self, service: str, index: int, wait_s: float
    ) -> tuple[int, list[ServiceAddress]]:
        index, body = await self._get(
            "/v1/health/service/" + service, {"passing": "true"}, index, wait_s
        )
        return index, parse_endpoints(body)

    async def _kv(
        self, key: str, index: int, wait_s: float, *, recurse: bool = True
    ) -> tuple[int, Any]:
        params = {"recurse": "true"} if recurse else {}
        return await self._get(f"/v1/kv/{key}", params, index, wait_s)

    async def _get(
        self,
        path: str,
        params: dict[str, str],
        index: int,
        wait_s: float,
        consume: Consume | None = None,
    ) -> tuple[int, Any]:
        """``(index, body)``: the JSON answer, or what ``consume`` made of the body's
        pieces as they arrived (``None`` for a 404)."""
        if index > 0:
            params = {**params, "index": str(index), "wait": f"{int(wait_s * 1000)}ms"}
        # Consul adds up to wait/16 of jitter to a blocking query.
        deadline = wait_s * 1.1 + 5.0
        try:
            async with asyncio.timeout(deadline), self._session.get(path, params=params) as resp:
                new_index = int(resp.headers.get("X-Consul-Index", "0"))
                if resp.status == 404:
                    return new_index, None if consume is None else await consume(None, new_index)
                if resp.status == 403:
                    needs = (
                        CONSUL_API_KEYS_READ
                        if path == f"/v1/kv/{ROUTER_API_KEYS_KEY}"
                        else CONSUL_KV_READ
                        if path.startswith("/v1/kv/")
                        else CONSUL_SESSIONS_READ
                        if path.startswith("/v1/session/")
                        else CONSUL_SERVICES_READ
                    )
                    raise CatalogDenied(
                        self._denial([needs.rule], await resp.text(), f"GET {path}")
                    )
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise CatalogUnavailable(f"GET {path}: HTTP {resp.status}: {text}")
                if consume is not None:
                    pieces = resp.content.iter_chunked(_PIECE_BYTES)
                    return new_index, await consume(pieces, new_index)
                return new_index, await resp.json(content_type=None)
        except (CatalogUnavailable, CatalogDenied):
            raise
        except aiohttp.ClientSSLError as exc:
            raise CatalogUnavailable(
                f"GET {path}: TLS with Consul at {self.base_url} failed ({exc}); check "
                "CONSUL_CACERT, CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY"
            ) from exc
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise CatalogUnavailable(f"GET {path}: {type(exc).__name__}: {exc}") from exc
