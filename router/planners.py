"""Which planner the router calls: the ordered list of planner addresses to try.

``planner serve`` runs as several instances; only the leader acts, and the
others forward writes to it (or answer 503 ``no_leader`` during an election).
So the router does not depend on one address: :class:`PlannerCandidates`
keeps three sources, written by the Consul watches in :mod:`router.watch`
and read by :mod:`router.plannerapi` on every call:

1. the leader's admin address: where the planner whose session holds the lock
   on Consul KV ``llmgw/leader`` registered its ``llmgw-planner`` instance
   (:func:`router.catalog.parse_leader`,
   :func:`llmgw_contract.leadership.resolve_leader`). The key's own text is
   only cross-checked: a record that names another planner or address than
   the registration (a KV write can rewrite it without taking the lock) is
   refused, logged and counted in
   ``llmgw_router_planner_leader_refusals_total{code}``, and no leader is
   listed until the key changes; a record no session holds names a planner
   that lost the lead, maybe a dead one;
2. the configured ``--planner-url`` (``LLMGW_PLANNER_URL``): the only source
   before the watches' first reads, and the one an operator controls (none
   with ``LLMGW_PLANNER_URL=none``: the router job's way);
3. the passing instances of the Consul service ``llmgw-planner`` (every
   ``planner serve`` registers its admin address with a 6 s TTL check), as
   ``<scheme>://<address>:<port>`` with the configured URL's scheme
   (``RouterSettings.planner_scheme``).

:meth:`PlannerCandidates.ordered` lists them in that order without repeats,
except that the planner that answered last (:meth:`PlannerCandidates.answered`)
comes right after the leader: it is reachable, and while the leader is unknown
(an election, Consul unreachable) it spares each call the connect timeout of
a dead configured address. A remembered planner that no source lists any more
is dropped (it stopped and deregistered).

A change of the planner that answers is logged once (info) and counted in
``llmgw_router_planner_switches_total``; one event loop, no lock.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Iterable

from llmgw_contract.leadership import LeaderRefused, Resolution
from router.catalog import ServiceAddress
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


def base_url(url: str) -> str:
    """``url`` without trailing slashes, so one planner is one candidate."""
    return url.rstrip("/")


class PlannerCandidates:
    """The planners a call may go to, best first."""

    def __init__(
        self, configured_url: str | None, metrics: RouterMetrics, scheme: str | None = None
    ) -> None:
        """``configured_url``: None for no fixed planner; ``scheme``: the instances'
        (default: the configured URL's, else http)."""
        self.configured = base_url(configured_url) if configured_url else None
        self._scheme = scheme or urllib.parse.urlsplit(configured_url or "").scheme or "http"
        self._metrics = metrics
        self.leader: str | None = None
        self.instances: tuple[str, ...] = ()
        self.current: str | None = None  # the planner that answered last

    def set_leader(self, resolution: Resolution) -> None:
        """Where the lock holder registered, as resolved now (``None``: no session holds
        the lock; a refusal: its record disagrees with the registration)."""
        if isinstance(resolution, LeaderRefused):
            log.warning(
                "not calling the planner llmgw/leader names: %s (%s)",
                resolution.reason,
                resolution.code,
            )
            self._metrics.planner_leader_refusals.labels(resolution.code.value).inc()
            leader = None
        else:
            leader = base_url(resolution.url) if resolution is not None else None
        if leader != self.leader:
            log.debug("planner leader in Consul: %s", leader or "none")
        self.leader = leader

    def set_instances(self, addresses: Iterable[ServiceAddress]) -> None:
        """The passing ``llmgw-planner`` instances, in the catalog's (sorted) order."""
        self.instances = tuple(f"{self._scheme}://{_host(a.host)}:{a.port}" for a in addresses)

    def ordered(self) -> list[str]:
        """Base URLs to try, in order: leader, last to answer, configured, instances."""
        known = [u for u in (self.leader, self.configured, *self.instances) if u]
        remembered = self.current if self.current in known else None
        return list(dict.fromkeys(u for u in (self.leader, remembered, *known) if u))

    def answered(self, url: str) -> None:
        """``url`` answered a call (any HTTP status): remember it; log and count a switch."""
        if url == self.current:
            return
        if self.current is None:
            log.info("planner calls go to %s%s", url, self._role(url))
        else:
            log.info("planner calls switched from %s to %s%s", self.current, url, self._role(url))
            self._metrics.planner_switches.inc()
        self.current = url

    def _role(self, url: str) -> str:
        if url == self.leader:
            return " (the leader: the lock holder of Consul llmgw/leader, as registered)"
        if url == self.configured:
            return " (the configured --planner-url)"
        return " (a passing llmgw-planner instance)"


def _host(host: str) -> str:
    """An IPv6 literal goes in brackets in a URL (RFC 3986 3.2.2)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
