"""Least-outstanding-requests choice among a model's passing endpoints.

:func:`pick` is pure: it reads each :class:`Endpoint`'s in-flight count and
returns the least loaded one, rotating the starting point so replicas with
equal load take turns. :class:`InFlight` is the only place that changes those
counts, always in pairs. Called by :mod:`router.proxy` for every request;
:class:`Endpoint` objects are created and retired by :mod:`router.endpoints`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from types import TracebackType

from prometheus_client import Gauge
from yarl import URL

from router.catalog import ServiceAddress


class Endpoint:
    """One passing replica and the requests the router has in flight to it.

    The object outlives its place in the table: a request that picked it keeps
    it and decrements its own count even after the replica left.
    """

    __slots__ = ("_urls", "address", "base_url", "inflight")

    def __init__(self, address: ServiceAddress) -> None:
        self.address = address
        host = f"[{address.host}]" if ":" in address.host else address.host
        self.base_url = f"http://{host}:{address.port}"
        self.inflight = 0
        self._urls: dict[str, URL] = {}

    def url(self, path: str) -> URL:
        """Absolute upstream URL for request ``path`` (e.g. ``/v1/completions``)."""
        url = self._urls.get(path)
        if url is None:
            # One URL object per path, reused: yarl caches host and port on the
            # object, which aiohttp reads several times per request.
            url = self._urls[path] = URL(self.base_url + path)
        return url

    def __repr__(self) -> str:
        return f"Endpoint({self.base_url}, inflight={self.inflight})"


def pick(
    endpoints: Sequence[Endpoint], start: int, exclude: Collection[Endpoint] = ()
) -> Endpoint | None:
    """Return the endpoint with the fewest requests in flight, or ``None``.

    ``start`` rotates the scan (callers pass a per-model counter) so that
    ties go round-robin instead of always to the first replica; an idle
    endpoint ends the scan early. Endpoints in ``exclude`` (already failed for
    this request) are skipped.
    """
    n = len(endpoints)
    best: Endpoint | None = None
    for i in range(n):
        candidate = endpoints[(start + i) % n]
        if exclude and candidate in exclude:
            continue
        if best is None or candidate.inflight < best.inflight:
            best = candidate
            if best.inflight == 0:
                break
    return best


class InFlight:
    """Counts one request against an endpoint and its model's gauge, for as long as
    the ``with`` block runs, whatever way it exits."""

    __slots__ = ("_endpoint", "_gauge")

    def __init__(self, endpoint: Endpoint, gauge: Gauge) -> None:
        self._endpoint = endpoint
        self._gauge = gauge

    def __enter__(self) -> Endpoint:
        self._endpoint.inflight += 1
        self._gauge.inc()
        return self._endpoint

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._endpoint.inflight -= 1
        self._gauge.dec()
