"""Where the planner that holds the leader lock can be reached: from Consul's registry,
never from the text in `llmgw/leader` alone.

Followers forward admin writes, with the admin token, to the leader
(`planner.api.admin`), and routers send their activate calls and usage reports to it
(`router.planners`). The key's value (a `LeaderRecord`) is written by the lock
holder, but any token with `key_prefix "llmgw/" write` can rewrite it without
taking the lock (a plain PUT keeps the holder's session), so its address cannot
be trusted on its own. What a KV write cannot change is which session holds the
lock and what that session is bound to. `planner.daemon.leader` binds its session to the
TTL check of its own `llmgw-planner` service instance, so the lock holder's admin
address is:

    GET /v1/kv/llmgw/leader               -> Session (the lock holder's session ID)
    GET /v1/session/info/<Session>        -> Node, Checks / ServiceChecks:
                                             one `service:llmgw-planner-<id>` check
    GET /v1/health/service/llmgw-planner  -> the instance `llmgw-planner-<id>` on that
                                             Node carrying that check: its Address, Port
                                             and Meta[`llmgw_scheme`]

`resolve_leader` is that rule as a pure function over those answers (Consul's
JSON shapes, 1.8 and later), for both planner and router. It returns the
registered URL (`LeaderRoute`) only when the key's value agrees with the
registration (same planner id, same scheme://host:port); anything else is a
`LeaderRefused` naming why, and the caller sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from llmgw_contract.documents import LeaderRecord, decode
from llmgw_contract.keys import PLANNER_SERVICE

# The admin API's default port (`planner serve --port`), for a URL that names none.
ADMIN_PORT = 4650
# Service meta key that records whether a planner's admin API speaks http or https:
# the registration carries the scheme, so a rewritten key cannot downgrade it.
SCHEME_META = "llmgw_scheme"
SCHEMES = ("http", "https")
# A planner instance's service ID is this prefix and its id (`planner.daemon.leader`).
SERVICE_ID_PREFIX = f"{PLANNER_SERVICE}-"
CHECK_PREFIX = f"service:{SERVICE_ID_PREFIX}"


@dataclass(frozen=True)
class AdminURL:
    """A planner admin API's base URL, normalised: scheme, lower-case host, port."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 (RFC 3986 3.2.2)
        return f"{self.scheme}://{host}:{self.port}"


def parse_admin_url(text: str) -> AdminURL:
    """`scheme://host[:port]` (no path, query, user or fragment; port default 4650).

    Raises ValueError saying what is wrong."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a URL ({exc})") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{text!r}: the scheme must be http or https")
    if not parts.hostname:
        raise ValueError(f"{text!r}: no host")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{text!r}: expected scheme://host:port, with nothing after it")
    return AdminURL(parts.scheme, parts.hostname.lower(), port or ADMIN_PORT)


class Refusal(StrEnum):
    """Why writes are not forwarded to the lock holder (the `code` of the 503)."""

    RECORD_INVALID = "leader_record_invalid"  # the key's value is no LeaderRecord
    SESSION_GONE = "leader_session_gone"  # the holder's session is no more (a change)
    SESSION_UNBOUND = "leader_session_unbound"  # not bound to one llmgw-planner check
    UNREGISTERED = "leader_unregistered"  # no llmgw-planner instance carries that check
    MISMATCH = "leader_mismatch"  # the key names another planner or address

    @property
    def transient(self) -> bool:
        """A lock changing hands, not a forged or broken record: worth a retry."""
        return self is Refusal.SESSION_GONE


@dataclass(frozen=True)
class LeaderRoute:
    """The lock holder's registered admin API: the only place writes may go."""

    planner_id: str
    url: str  # str(AdminURL) of its registration
    node: str
    session: str


@dataclass(frozen=True)
class LeaderRefused:
    """A lock holder exists but its address cannot be trusted; nothing may be sent."""

    code: Refusal
    reason: str


Resolution = LeaderRoute | LeaderRefused | None


def resolve_leader(
    holder: str | None,
    value: str | bytes | None,
    session: dict[str, Any] | None,
    instances: list[dict[str, Any]] | None,
) -> Resolution:
    """Where the planner holding `llmgw/leader` listens, from Consul's answers.

    `holder`, `value`: the key's `Session` and its (base64-decoded) `Value`;
    `session`: `/v1/session/info/<holder>`'s entry (None when Consul has none);
    `instances`: `/v1/health/service/llmgw-planner` (all, not only passing).
    None when no session holds the key (an election); a `LeaderRoute` when the
    record agrees with the registration the session is bound to; else a
    `LeaderRefused`."""
    if not holder:
        return None
    try:
        record = decode(LeaderRecord, value or b"")
    except ValueError as exc:
        return LeaderRefused(
            Refusal.RECORD_INVALID,
            f"the value of llmgw/leader is not a leader record ({_short(exc)})",
        )
    if not session or session.get("ID") != holder:
        return LeaderRefused(
            Refusal.SESSION_GONE,
            f"the lock holder's session {holder} is gone (the lock is changing hands)",
        )
    checks = sorted(c for c in _session_checks(session) if c.startswith(CHECK_PREFIX))
    if len(checks) != 1:
        return LeaderRefused(
            Refusal.SESSION_UNBOUND,
            f"the lock holder's session {holder} "
            f"is bound to {len(checks)} {PLANNER_SERVICE} checks, not one: "
            "it is no planner's session",
        )
    check = checks[0]
    service_id = check.removeprefix("service:")
    node = str(session.get("Node") or "")
    instance = _instance(instances or [], service_id, node, check)
    if instance is None:
        return LeaderRefused(
            Refusal.UNREGISTERED,
            f"no {PLANNER_SERVICE} instance "
            f"{service_id} with check {check} is registered on node "
            f"{node!r}, the lock holder's",
        )
    registered = _registered_url(instance)
    if isinstance(registered, str):
        return LeaderRefused(
            Refusal.UNREGISTERED,
            f"{PLANNER_SERVICE} instance {service_id} on node {node!r}: {registered}",
        )
    planner_id = service_id.removeprefix(SERVICE_ID_PREFIX)
    try:
        named = parse_admin_url(record.address)
    except ValueError as exc:
        named = None
        why = str(exc)
    else:
        why = f"{named}"
    if record.id != planner_id or named != registered:
        return LeaderRefused(
            Refusal.MISMATCH,
            f"llmgw/leader names planner {record.id!r} at "
            f"{_short(why)}, but the lock holder is planner {planner_id!r}, "
            f"registered at {registered} on node {node!r}: the key was "
            "rewritten outside the lock",
        )
    return LeaderRoute(planner_id, str(registered), node, holder)


def _session_checks(session: dict[str, Any]) -> set[str]:
    """Every check ID a session is bound to: `Checks` (1.8: IDs), and `NodeChecks` /
    `ServiceChecks` (1.7+: IDs, and {"ID": ...} objects)."""
    found: set[str] = set()
    for field in ("Checks", "NodeChecks", "ServiceChecks"):
        for item in session.get(field) or ():
            check = item.get("ID") if isinstance(item, dict) else item
            if isinstance(check, str):
                found.add(check)
    return found


def _instance(
    instances: list[dict[str, Any]], service_id: str, node: str, check: str
) -> dict[str, Any] | None:
    """The one instance `service_id` of llmgw-planner on `node` that carries `check`."""
    for entry in instances:
        service = entry.get("Service") or {}
        if (
            service.get("ID") == service_id
            and service.get("Service") == PLANNER_SERVICE
            and (entry.get("Node") or {}).get("Node") == node
            and any(c.get("CheckID") == check for c in entry.get("Checks") or ())
        ):
            return entry
    return None


def _registered_url(entry: dict[str, Any]) -> AdminURL | str:
    """The instance's admin URL, or what is wrong with its registration."""
    service = entry.get("Service") or {}
    host = service.get("Address") or (entry.get("Node") or {}).get("Address")
    port = service.get("Port")
    scheme = (service.get("Meta") or {}).get(SCHEME_META) or "http"
    if not host or not isinstance(port, int) or not 0 < port < 65536:
        return f"registered without an address and port ({host!r}:{port!r})"
    if scheme not in SCHEMES:
        return f"registered with scheme {scheme!r} (expected http or https)"
    return AdminURL(scheme, str(host).strip("[]").lower(), port)


def _short(text: object) -> str:
    one = " ".join(str(text).split())
    return one if len(one) <= 200 else one[:199] + "…"
