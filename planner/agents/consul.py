"""The planner's only door to Consul: KV documents, health, and its own service and session.

Called by `apply` (model records), `state` (state documents, check-and-set),
`status` (health), the watcher (passing checks), `leader` (the planner's
service, its TTL check and the leadership session) and `usage`. Raises only
`planner.errors` types: ConsulUnavailable when Consul cannot be reached or
fails (or the TLS handshake fails: the message names the CONSUL_* files to
check), Rejected when it refuses a request, PermissionDenied (naming the ACL rule the
call needs, `planner.agents.access`) when it denies the token one; `denied` asks for rules
before acting.

TLS: an https:// address (`Settings.consul_url`: CONSUL_HTTP_ADDR with https://,
or CONSUL_HTTP_SSL=true) is verified with CONSUL_CACERT (else the system's CAs)
and presents CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY (`planner.spec.settings.ClientTLS`).

The KV layout and documents are the contract's (`llmgw_contract.keys`,
`llmgw_contract.documents`).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import urlparse

import consul
import consul.exceptions
import requests
from consul.callback import CB

from llmgw_contract import (
    EngineRecord,
    KVPrefix,
    ModelRecord,
    UsageRecord,
    alloc_from_service_id,
    decode,
    encode,
    kv_key,
    model_from_key,
)
from llmgw_contract.acl import (
    CONSUL_KV_READ,
    CONSUL_KV_WRITE,
    CONSUL_PLANNER_SERVICE_WRITE,
    CONSUL_SERVICES_READ,
    CONSUL_SESSION_WRITE,
    Agent,
    Permission,
    TokenStatus,
)
from llmgw_contract.documents import Document
from planner.agents.access import denied_error
from planner.errors import ConsulUnavailable, NotLeader, Rejected, no_answer
from planner.spec.settings import CONSUL_TLS_VARS, ClientTLS
from planner.vocab import ServiceHealth

D = TypeVar("D", bound=Document)

log = logging.getLogger("planner.consul")


@contextmanager
def _translated(
    action: str, tls_failure: Callable[[BaseException], str | None], address: str = ""
) -> Iterator[None]:
    """py-consul's and requests' errors as the planner's; `action` ("" for none) prefixes
    the message, `address` names the agent a connection failed to (CONSUL_HTTP_ADDR)."""
    try:
        yield
    except (
        consul.exceptions.ACLPermissionDenied,
        consul.exceptions.BadRequest,
        consul.exceptions.ACLDisabled,
    ) as exc:
        raise Rejected(f"{action}: Consul refused ({exc})") from exc
    except (consul.exceptions.ConsulException, requests.RequestException, OSError) as exc:
        if failure := tls_failure(exc):
            raise ConsulUnavailable(f"{action}: {failure}") from exc
        prefix = f"{action}: " if action else ""
        if isinstance(exc, (requests.RequestException, OSError)):
            raise ConsulUnavailable(
                prefix + no_answer("Consul", "CONSUL_HTTP_ADDR", address, exc)
            ) from exc
        raise ConsulUnavailable(f"{prefix}Consul failed ({exc})") from exc


def _b64(text: str) -> str:
    """A KV value as ``/v1/txn`` takes it."""
    return base64.b64encode(text.encode()).decode()


def _failed_ops(exc: Exception) -> set[int] | None:
    """The indexes of the operations a rolled-back transaction names (Consul answers 409
    with {"Errors": [{"OpIndex", "What"}]}), or None for any other error."""
    code, _, body = str(exc).partition(" ")
    if code != "409":
        return None
    try:
        return {int(e["OpIndex"]) for e in json.loads(body).get("Errors") or []}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class ConsulClient:
    """Thin wrapper over py-consul for the calls the planner makes."""

    def __init__(
        self, address: str, token: str | None = None, tls: ClientTLS | None = None
    ) -> None:
        """`address`: host:port or http(s)://host:port. Raises ValueError (naming the
        setting) when a configured TLS file is unusable."""
        url = urlparse(address if "://" in address else f"http://{address}")
        self.address = f"{url.scheme}://{url.netloc}"
        self.tls = tls or ClientTLS("Consul", CONSUL_TLS_VARS)
        if url.scheme == "https":
            self.tls.context()  # loads the files once: a bad one fails here, not per call
        self._api = consul.Consul(
            host=url.hostname or "127.0.0.1",
            port=url.port or 8500,
            scheme=url.scheme,
            token=token,
            verify=self.tls.verify,
            cert=self.tls.cert,
        )

    def _call(self, needs: Permission, action: str, fn: Callable[[], Any]) -> Any:
        """Run `fn`, translating its errors; a 403 is PermissionDenied naming `needs`,
        the ACL rule Consul checks for this call."""
        try:
            with _translated(action, lambda exc: self.tls.failure(self.address, exc), self.address):
                return fn()
        except Rejected as exc:
            if isinstance(exc.__cause__, consul.exceptions.ACLPermissionDenied):
                detail = str(exc.__cause__)
                raise denied_error(
                    Agent.CONSUL, [needs.rule], self._token_status(detail), action, detail
                ) from exc.__cause__
            raise

    def _token_status(self, detail: str) -> TokenStatus:
        """Consul answers "ACL not found" for a token it does not know."""
        if "ACL not found" in detail:
            return TokenStatus.UNKNOWN
        return TokenStatus.VALID if self._api.token else TokenStatus.EMPTY

    def denied(self, needs: list[Permission]) -> tuple[list[Permission], TokenStatus, str] | None:
        """Which of `needs` this client's token is denied, in one call to Consul's
        /v1/internal/acl/authorize (`llmgw_contract.acl`): None when all are allowed
        (or Consul enforces no ACLs), else (the denied ones, the token's status,
        Consul's words for an unknown token). Raises ConsulUnavailable when Consul
        cannot be asked."""
        if not needs:
            return None
        body = json.dumps([p.authorize_request() for p in needs])

        def ask() -> Any:
            return self._api.http.post(
                CB.json(),
                "/v1/internal/acl/authorize",
                data=body,
                headers=self._api.prepare_headers(),
            )

        try:
            # No action in a message: an agent that does not answer is no ACL matter.
            with _translated("", lambda exc: self.tls.failure(self.address, exc), self.address):
                answers = ask()
        except Rejected as exc:
            cause = exc.__cause__
            if isinstance(cause, consul.exceptions.ACLDisabled):
                return None
            if isinstance(cause, consul.exceptions.ACLPermissionDenied):
                return list(needs), self._token_status(str(cause)), str(cause)
            raise
        denied = [p for p, a in zip(needs, answers or [], strict=False) if not a.get("Allow")]
        return (denied, self._token_status(""), "") if denied else None

    # --- KV ----------------------------------------------------------------------

    def get_indexed(self, key: str) -> tuple[int, str | None]:
        """(ModifyIndex, text) of `key`; (0, None) when it does not exist (a
        check-and-set with index 0 then creates it only if still absent)."""
        _, item = self._call(CONSUL_KV_READ, f"read {key}", lambda: self._api.kv.get(key))
        if not item:
            return 0, None
        value = item["Value"]
        return int(item["ModifyIndex"]), value.decode() if value else None

    def get_indexed_texts(self, prefix: str) -> dict[str, tuple[int, str]]:
        """Every non-empty value under `prefix` and its ModifyIndex: {key: (index, text)}."""
        _, items = self._call(
            CONSUL_KV_READ, f"read {prefix}", lambda: self._api.kv.get(prefix, recurse=True)
        )
        return {
            item["Key"]: (int(item["ModifyIndex"]), item["Value"].decode())
            for item in items or []
            if item["Value"]
        }

    def get_texts(self, prefix: str) -> dict[str, str]:
        """Every non-empty value under `prefix`: {key: text}."""
        return {key: text for key, (_, text) in self.get_indexed_texts(prefix).items()}

    def put_text(self, key: str, text: str) -> None:
        self._call(CONSUL_KV_WRITE, f"write {key}", lambda: self._api.kv.put(key, text))

    def cas_put(self, key: str, text: str, index: int) -> bool:
        """Write `key` only if its ModifyIndex is still `index` (0: only if absent).
        False when another writer changed it first."""
        return bool(
            self._call(
                CONSUL_KV_WRITE, f"write {key}", lambda: self._api.kv.put(key, text, cas=index)
            )
        )

    def cas_put_with(
        self,
        key: str,
        text: str | None,
        index: int,
        *,
        also: Mapping[str, str | None] | None = None,
        fence: tuple[str, str] | None = None,
    ) -> bool:
        """One transaction (``/v1/txn``): `key` set to `text` only if its ModifyIndex is
        still `index` (0: only if absent; `text` None: only checked, not written), every
        key of `also` set to its text (None: deleted) with it, and, with `fence` (lock
        key, session), a check that the session still holds that lock (Consul's
        `check-session` verb): a deposed leader's write fails whatever it believes. All
        or nothing. False on a check-and-set conflict; raises NotLeader when the session
        does not hold the lock."""
        ops: list[dict[str, Any]] = []
        if fence is not None:
            ops.append({"KV": {"Verb": "check-session", "Key": fence[0], "Session": fence[1]}})
        if text is None:
            ops.append({"KV": {"Verb": "check-index", "Key": key, "Index": index}})
        else:
            ops.append({"KV": {"Verb": "cas", "Key": key, "Index": index, "Value": _b64(text)}})
        for other, value in (also or {}).items():
            op = {"Verb": "delete", "Key": other} if value is None else {
                "Verb": "set", "Key": other, "Value": _b64(value)
            }  # fmt: skip
            ops.append({"KV": op})

        def put() -> bool:
            try:
                self._txn(ops)
            except consul.exceptions.ClientError as exc:
                failed = _failed_ops(exc)
                if failed is None:
                    raise
                if fence is not None and 0 in failed:
                    raise NotLeader(
                        f"write {key}: this planner's session no longer holds {fence[0]}"
                    ) from None
                return False
            return True

        return bool(self._call(CONSUL_KV_WRITE, f"write {key}", put))

    def lock_holder(self, lock_key: str) -> str | None:
        """The session holding the lock on `lock_key` now, or None when nobody does."""
        _, item = self._call(CONSUL_KV_READ, f"read {lock_key}", lambda: self._api.kv.get(lock_key))
        return str(item["Session"]) if item and item.get("Session") else None

    def holds(self, lock_key: str, session: str) -> bool:
        """Whether `session` holds the lock on `lock_key` now."""
        _, item = self._call(CONSUL_KV_READ, f"read {lock_key}", lambda: self._api.kv.get(lock_key))
        return bool(item) and item.get("Session") == session

    def delete_key(self, key: str) -> None:
        self._call(CONSUL_KV_WRITE, f"delete {key}", lambda: self._api.kv.delete(key))

    def delete_keys(self, *keys: str) -> None:
        """Delete every key of `keys` in one transaction (all or none)."""
        ops = [{"KV": {"Verb": "delete", "Key": key}} for key in keys]
        self._call(CONSUL_KV_WRITE, f"delete {', '.join(keys)}", lambda: self._txn(ops))

    def _txn(self, ops: list[dict[str, Any]]) -> None:
        """PUT `ops` to ``/v1/txn``; raises py-consul's errors (a 409 lists the failed
        operations: :func:`_failed_ops`). Not py-consul's `txn.put`: it sends no token
        (py-consul 1.8), so with ACLs every operation was "Permission denied" (found by
        test_acl.py)."""
        self._api.http.put(
            CB.json(), "/v1/txn", data=json.dumps(ops), headers=self._api.prepare_headers()
        )

    # --- model records ---------------------------------------------------------------

    def documents(self, prefix: KVPrefix, kind: type[D]) -> dict[str, D]:
        """Every document of type `kind` under `prefix`: {model name: document}. One that
        does not decode is skipped with an error in the log (one bad key must not hide
        the others); keys nested deeper than `<prefix><name>` are ignored."""
        found = {}
        for key, text in self.get_texts(prefix).items():
            name = model_from_key(prefix, key)
            if name is None:
                continue
            try:
                found[name] = decode(kind, text)
            except ValueError as exc:
                log.error("skipping %s: %s", key, exc)
        return found

    def model_records(self) -> dict[str, ModelRecord]:
        """Every applied model record: {name: record}."""
        return self.documents(KVPrefix.MODELS, ModelRecord)

    def usage_records(self) -> dict[str, UsageRecord]:
        """The leader's coarse copies of when each model was last asked for."""
        return self.documents(KVPrefix.USAGE, UsageRecord)

    def put_model_record(self, record: ModelRecord) -> None:
        self.put_text(kv_key(KVPrefix.MODELS, record.name), encode(record))

    def delete_model_record(self, name: str) -> None:
        self.delete_key(kv_key(KVPrefix.MODELS, name))

    # --- engine records ---------------------------------------------------------------

    def engine_records(self) -> dict[str, EngineRecord]:
        """Every defined engine's record (llmgw/engines/<name>): {name: record}."""
        return self.documents(KVPrefix.ENGINES, EngineRecord)

    def engine_record(self, name: str) -> tuple[int, EngineRecord | None]:
        """(ModifyIndex, record) of one engine; (0, None) when it has none (and None
        with its index when the key does not hold a record)."""
        index, text = self.get_indexed(kv_key(KVPrefix.ENGINES, name))
        if text is None:
            return index, None
        try:
            return index, decode(EngineRecord, text)
        except ValueError as exc:
            log.error("engine %s: its KV record does not decode: %s", name, exc)
            return index, None

    def put_engine_record(self, record: EngineRecord, index: int) -> bool:
        """Write an engine's record checked against the ModifyIndex read (0: only if
        absent); False when another writer changed it first."""
        return self.cas_put(kv_key(KVPrefix.ENGINES, record.name), encode(record), index)

    # --- health ---------------------------------------------------------------------

    def passing_checks(self, index: int | None, wait: str = "5s") -> tuple[int, list[Any]]:
        """Blocking query on every passing check: returns once the set changed after
        `index` (or after `wait`; short, so a shutdown never waits long on it)."""
        new_index, checks = self._call(
            CONSUL_SERVICES_READ,
            "watch passing checks",
            lambda: self._api.health.state("passing", index=index, wait=wait),
        )
        return int(new_index), checks or []

    def service_health(self, service: str) -> ServiceHealth:
        """Instances of `service` registered anywhere, and those whose checks all pass."""
        _, nodes = self._call(
            CONSUL_SERVICES_READ,
            f"read health of {service}",
            lambda: self._api.health.service(service),
        )
        passing = [
            node for node in nodes if all(check["Status"] == "passing" for check in node["Checks"])
        ]
        allocs = frozenset(
            a for node in passing if (a := alloc_from_service_id(node["Service"]["ID"]))
        )
        return ServiceHealth(total=len(nodes), passing=len(passing), passing_allocs=allocs)

    # --- the planner's own service and session (leader election) ------------------

    def register_ttl_service(
        self,
        name: str,
        service_id: str,
        address: str,
        port: int,
        ttl: str,
        deregister_after: str,
        meta: dict[str, str] | None = None,
    ) -> str:
        """Register a service with a TTL check that starts passing; returns the check ID
        (`service:<service_id>`). Consul removes the service `deregister_after` once the
        check stays critical (a planner that died without deregistering)."""
        check = consul.Check.ttl(ttl)
        check["DeregisterCriticalServiceAfter"] = deregister_after
        check["Status"] = "passing"
        self._call(
            CONSUL_PLANNER_SERVICE_WRITE,
            f"register service {service_id}",
            lambda: self._api.agent.service.register(
                name, service_id=service_id, address=address, port=port, check=check, meta=meta
            ),
        )
        return f"service:{service_id}"

    def knows_service(self, service_id: str, check_id: str) -> bool:
        """Whether this agent lists the service `service_id` and its check `check_id`
        (`/v1/agent/services`, `/v1/agent/checks`): False after the agent lost its state
        (a restarted dev agent, a rebuilt Consul), which then refuses a session bound to
        the check ("Missing check ... registration") and a pass of it."""
        services = self._call(
            CONSUL_PLANNER_SERVICE_WRITE, "list this agent's services", self._api.agent.services
        )
        if service_id not in (services or {}):
            return False
        checks = self._call(
            CONSUL_PLANNER_SERVICE_WRITE, "list this agent's checks", self._api.agent.checks
        )
        return check_id in (checks or {})

    def deregister_service(self, service_id: str) -> None:
        self._call(
            CONSUL_PLANNER_SERVICE_WRITE,
            f"deregister service {service_id}",
            lambda: self._api.agent.service.deregister(service_id),
        )

    def pass_ttl(self, check_id: str) -> None:
        self._call(
            CONSUL_PLANNER_SERVICE_WRITE,
            f"update check {check_id}",
            lambda: self._api.agent.check.ttl_pass(check_id),
        )

    def create_session(self, name: str, checks: list[str], lock_delay_s: int) -> str:
        """A session bound to `checks` (invalidated as soon as one goes critical), with
        the `release` behaviour: its locks are released, the keys stay."""
        return str(
            self._call(
                CONSUL_SESSION_WRITE,
                "create session",
                lambda: self._api.session.create(
                    name=name, checks=checks, lock_delay=lock_delay_s, behavior="release"
                ),
            )
        )

    def destroy_session(self, session_id: str) -> None:
        self._call(
            CONSUL_SESSION_WRITE, "destroy session", lambda: self._api.session.destroy(session_id)
        )

    def session_info(self, session_id: str) -> dict[str, Any] | None:
        """`/v1/session/info/<id>`'s entry (Node, Checks ...), or None: no such session."""
        _, info = self._call(
            CONSUL_SESSION_WRITE,
            f"read session {session_id}",
            lambda: self._api.session.info(session_id),
        )
        return info or None

    def service_instances(self, service: str) -> list[dict[str, Any]]:
        """`/v1/health/service/<service>`: every instance, passing or not, with its node
        and checks."""
        _, nodes = self._call(
            CONSUL_SERVICES_READ,
            f"read instances of {service}",
            lambda: self._api.health.service(service),
        )
        return list(nodes or [])

    def acquire(self, key: str, text: str, session_id: str) -> bool:
        """Try to take the lock on `key` for `session_id`, writing `text` when taken."""
        return bool(
            self._call(
                CONSUL_KV_WRITE,
                f"acquire {key}",
                lambda: self._api.kv.put(key, text, acquire=session_id),
            )
        )

    def release(self, key: str, session_id: str) -> None:
        self._call(
            CONSUL_KV_WRITE,
            f"release {key}",
            lambda: self._api.kv.put(key, None, release=session_id),
        )

    def watch_names(
        self, prefix: KVPrefix, index: int | None, wait: str = "5s"
    ) -> tuple[int, set[str]]:
        """Blocking read of the model names with a key under `prefix`: returns once the
        keys changed after `index` (or after `wait`)."""
        new_index, keys = self._call(
            CONSUL_KV_READ,
            f"watch {prefix}",
            lambda: self._api.kv.get(prefix, keys=True, index=index, wait=wait),
        )
        return int(new_index), {n for k in keys or [] if (n := model_from_key(prefix, k))}

    def watch_key(self, key: str, index: int | None, wait: str = "5s") -> tuple[int, Any]:
        """Blocking read of one key: (index, item with Session, Value, ModifyIndex or None)."""
        new_index, item = self._call(
            CONSUL_KV_READ, f"watch {key}", lambda: self._api.kv.get(key, index=index, wait=wait)
        )
        return int(new_index), item
