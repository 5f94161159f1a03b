"""Passive outlier ejection: a replica that keeps failing gets no new requests for a while.

Why: a replica can pass its Consul health check and still never answer (a
wedged llama-server whose HTTP thread serves ``/health``), or refuse every
connection for the second before Consul notices it died. Consul is the
authority on which replicas exist; this module only adds what the request
path itself observes, as Envoy's outlier detection does
(envoyproxy.io, "Outlier detection": consecutive 5xx, consecutive
local-origin failures, ejection time = base x times ejected, capped).

The rules, per replica (:class:`router.endpoint.ReplicaHealth`, one per
:class:`router.endpoint.Endpoint`, so it ends with the endpoint: a replica
that leaves Consul's passing list and comes back is a new endpoint, with a
clean record):

- a **dead** replica (no first byte, and its ``/health`` went unanswered or
  answered 5xx: :mod:`router.firstbyte`) is ejected at once, and so is a
  **stalled** one (its HTTP server answers, but its work counters stood still
  for the stall timeout while requests waited on it);
- a **connect error** is a local failure too, and so is a **broken connection**
  (connected and sent, then closed or reset before any answer);
  ``consecutive_failures`` of them in a row (default 2) eject it;
- an answer with a **5xx status** other than 501 (llama-server's "not
  supported by this server", a property of the route, not of the replica)
  counts separately; ``consecutive_5xx`` in a row (default 5, Envoy's) eject it;
- any other answer resets both counts;
- an ejection lasts ``base_ejection_s`` x the times it was ejected in a row
  (30 s, 60 s, 90 s ..., at most ``max_ejection_s``, 300 s); then, given a
  ``check`` (the proxy's: :meth:`router.firstbyte.FirstByteWatch.check`), it is
  asked the question it failed (``/health`` for a dead one; for a stalled one
  with requests still on it, whether its work counters moved) before any
  request goes to it: still failing, it is ejected again for longer, so a
  replica that stays dead costs no request after the first; passing, or
  without a check, it returns **on probation**: its first failure ejects it
  again for longer, its first good answer clears its record; meanwhile it takes one request at a
  time (a circuit breaker's half-open state), so a burst does not all meet a
  replica still wedged (a new user saw 4 of 10 do so);
- an ejected replica, or one on probation with a request in flight, gets no
  new request while any other replica of the model, not held back and not
  already failed for that request, passes (:func:`not_ejected`, the filter
  :func:`router.balancer.pick` applies); when every replica is held back, all
  of them are used, as Envoy's panic mode does.

Each ejection is one log line and one increment of
``llmgw_router_replica_ejections_total{model,reason}``;
``llmgw_router_ejected_replicas{model}`` counts the passing replicas ejected
now (read at scrape time by :class:`router.admission.Slots`).

Called by :mod:`router.proxy` (:meth:`OutlierDetector.answered`,
:meth:`~OutlierDetector.failed`); everything runs on the one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.endpoint import Endpoint, Failure

if TYPE_CHECKING:
    from router.metrics import ModelMetrics

log = logging.getLogger(__name__)


# Failures a check designed for them found: one is proof enough.
_AT_ONCE = frozenset({Failure.DEAD, Failure.STALLED})


# llama-server answers 501 for a route its flags turned off (--embeddings,
# --reranking): the request's fault, never the replica's.
_NOT_A_FAILURE_5XX = frozenset({501})


class Capacity(Protocol):
    """What the detector tells when an ejected replica returns
    (:class:`router.admission.Slots`)."""

    endpoints: Sequence[Endpoint]

    def capacity_changed(self) -> None: ...


Check = Callable[["Endpoint", Failure], Awaitable[bool]]
"""Asks a returning replica the question it failed; ``True`` when it passes now."""


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """The thresholds and durations; seconds throughout."""

    consecutive_failures: int = 2
    consecutive_5xx: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0

    def ejection_s(self, times: int) -> float:
        """How long the ``times``-th ejection in a row lasts."""
        return min(self.base_ejection_s * times, self.max_ejection_s)


def not_ejected(
    endpoints: Sequence[Endpoint], exclude: Collection[Endpoint] = ()
) -> Sequence[Endpoint]:
    """``endpoints`` without the ejected ones and those on probation with a request
    in flight, unless that leaves none outside ``exclude`` (then all of them).
    Returns ``endpoints`` itself when none is ejected or on probation: no
    allocation on the common path."""
    for endpoint in endpoints:
        if endpoint.health.ejected or endpoint.health.probation:
            break
    else:
        return endpoints
    kept = tuple(e for e in endpoints if not _held_back(e))
    if any(e not in exclude for e in kept):
        return kept
    return endpoints


def _held_back(endpoint: Endpoint) -> bool:
    health = endpoint.health
    return health.ejected or (health.probation and endpoint.inflight > 0)


class OutlierDetector:
    """Applies :class:`OutlierPolicy` to what the proxy observes."""

    def __init__(self, policy: OutlierPolicy | None = None, check: Check | None = None) -> None:
        self.policy = policy or OutlierPolicy()
        self.check = check
        self._checks: set[asyncio.Task[None]] = set()

    def answered(
        self,
        model: str,
        metrics: ModelMetrics,
        slots: Capacity,
        endpoint: Endpoint,
        status: int,
    ) -> None:
        """The replica sent its response headers with ``status``."""
        health = endpoint.health
        if status >= 500 and status not in _NOT_A_FAILURE_5XX:
            health.consecutive_5xx += 1
            if health.probation or health.consecutive_5xx >= self.policy.consecutive_5xx:
                self._eject(model, metrics, slots, endpoint, Failure.HTTP_5XX)
            return
        if health.consecutive or health.consecutive_5xx or health.probation or health.ejections:
            health.consecutive = health.consecutive_5xx = health.ejections = 0
            if health.probation:
                health.probation = False
                log.info("model %s: replica %s answers again", model, endpoint.base_url)

    def failed(
        self,
        model: str,
        metrics: ModelMetrics,
        slots: Capacity,
        endpoint: Endpoint,
        failure: Failure,
    ) -> None:
        """The connection could not be made, or a liveness check failed (:class:`Failure`)."""
        health = endpoint.health
        health.consecutive += 1
        if (
            failure in _AT_ONCE
            or health.probation
            or health.consecutive >= self.policy.consecutive_failures
        ):
            self._eject(model, metrics, slots, endpoint, failure)

    def _eject(
        self,
        model: str,
        metrics: ModelMetrics,
        slots: Capacity,
        endpoint: Endpoint,
        failure: Failure,
    ) -> None:
        health = endpoint.health
        if health.ejected:
            return  # requests that were in flight when it was ejected
        health.ejections += 1
        duration = self.policy.ejection_s(health.ejections)
        health.ejected = True
        health.failure = failure
        health.probation = False
        health.consecutive = health.consecutive_5xx = 0
        metrics.ejections[failure].inc()
        log.warning(
            "model %s: replica %s ejected for %g s (%s; ejection %d in a row); "
            "its Consul check still decides whether it exists",
            model,
            endpoint.base_url,
            duration,
            failure,
            health.ejections,
        )
        loop = asyncio.get_running_loop()
        health.timer = loop.call_later(duration, self._return, model, metrics, slots, endpoint)

    def _return(
        self, model: str, metrics: ModelMetrics, slots: Capacity, endpoint: Endpoint
    ) -> None:
        health = endpoint.health
        health.timer = None
        failure = health.failure
        if self.check is None or failure is None or failure not in _AT_ONCE:
            self._probation(model, slots, endpoint)
            return
        if endpoint not in slots.endpoints:
            # It left Consul's passing list: its record ends with it.
            health.ejected = False
            return
        task = asyncio.ensure_future(self._recheck(model, metrics, slots, endpoint, failure))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _recheck(
        self,
        model: str,
        metrics: ModelMetrics,
        slots: Capacity,
        endpoint: Endpoint,
        failure: Failure,
    ) -> None:
        assert self.check is not None
        if await self.check(endpoint, failure):
            self._probation(model, slots, endpoint)
            return
        log.info("model %s: replica %s still fails (%s)", model, endpoint.base_url, failure)
        endpoint.health.ejected = False
        self._eject(model, metrics, slots, endpoint, failure)

    def _probation(self, model: str, slots: Capacity, endpoint: Endpoint) -> None:
        health = endpoint.health
        health.ejected = False
        health.probation = True
        log.info(
            "model %s: replica %s back on probation (its next failure ejects it again)",
            model,
            endpoint.base_url,
        )
        slots.capacity_changed()

    async def close(self) -> None:
        """Cancel the checks of returning replicas in flight (shutdown)."""
        tasks = list(self._checks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
