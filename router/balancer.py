"""Least-outstanding-requests choice among a model's passing endpoints, under their limits.

:func:`pick` is pure: it reads each :class:`Endpoint`'s in-flight count and
limit and returns the least loaded endpoint that has a free slot, rotating the
starting point so replicas with equal load take turns. The counts change only
in :class:`router.admission.Slots`, which grants and releases slots in pairs.
:class:`Endpoint` objects are created and retired by :mod:`router.endpoints`;
their limit is set by :mod:`router.capacity`. With prefix routing on, an
:data:`Affinity` is asked first (:mod:`router.prefix`); least-outstanding is
the fallback.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from yarl import URL

from router.catalog import ServiceAddress
from router.outliers import ReplicaHealth, not_ejected

# URLs cached per endpoint: the model routes (router.routes), with room to spare.
URL_CACHE_SIZE = 64

if TYPE_CHECKING:
    from router.prefix import PrefixChooser

Affinity = tuple["PrefixChooser", str]
"""A request's preferred placement: the chooser and the request's prefix key."""


class Endpoint:
    """One passing replica, the requests the router has in flight to it, and how
    many it may have (``limit``: llama-server's slot count, or a setting).

    The object outlives its place in the table: a request that picked it keeps
    it and releases its own slot even after the replica left.
    """

    __slots__ = ("_urls", "address", "base_url", "health", "inflight", "limit")

    def __init__(self, address: ServiceAddress, limit: int) -> None:
        self.address = address
        host = f"[{address.host}]" if ":" in address.host else address.host
        self.base_url = f"http://{host}:{address.port}"
        self.inflight = 0
        self.limit = limit
        # Passive outlier ejection (router.outliers).
        self.health = ReplicaHealth()
        self._urls: dict[str, URL] = {}

    def url(self, path: str) -> URL:
        """Absolute upstream URL for ``path`` (e.g. ``/v1/completions?x=1``), taken as
        already encoded: yarl neither decodes nor re-quotes it nor resolves dot
        segments, so the replica receives exactly ``path``. Callers pass only routes
        :mod:`router.routes` vouches for."""
        url = self._urls.get(path)
        if url is None:
            # One URL object per path, reused: yarl caches host and port on the
            # object, which aiohttp reads several times per request. Bounded:
            # paths (query strings included) are the client's to choose.
            url = URL(self.base_url + path, encoded=True)
            if len(self._urls) < URL_CACHE_SIZE:
                self._urls[path] = url
        return url

    def __repr__(self) -> str:
        return f"Endpoint({self.base_url}, inflight={self.inflight}/{self.limit})"


def usable(endpoint: Endpoint, exclude: Collection[Endpoint] = ()) -> bool:
    """It has a free slot and has not failed this request already."""
    return endpoint.inflight < endpoint.limit and not (exclude and endpoint in exclude)


def pick(
    endpoints: Sequence[Endpoint],
    start: int,
    exclude: Collection[Endpoint] = (),
    affinity: Affinity | None = None,
) -> Endpoint | None:
    """Return the endpoint with the fewest requests in flight and a free slot, or ``None``.

    ``start`` rotates the scan (callers pass a per-model counter) so that
    ties go round-robin instead of always to the first replica; an idle
    endpoint ends the scan early. Endpoints at their limit, and those in
    ``exclude`` (already failed for this request), are skipped, and so are
    ejected ones while another can be tried (:func:`router.outliers.not_ejected`).
    Given an ``affinity``, its choice among those comes first
    (:meth:`router.prefix.PrefixChooser.choose`).
    """
    endpoints = not_ejected(endpoints, exclude)
    if affinity is not None:
        chooser, key = affinity
        chosen = chooser.choose(endpoints, key, lambda e: usable(e, exclude))
        if chosen is not None:
            return chosen
    n = len(endpoints)
    best: Endpoint | None = None
    for i in range(n):
        candidate = endpoints[(start + i) % n]
        if candidate.inflight >= candidate.limit or (exclude and candidate in exclude):
            continue
        if best is None or candidate.inflight < best.inflight:
            best = candidate
            if best.inflight == 0:
                break
    return best
