"""The small types the request path shares: one passing replica and its record.

:class:`Endpoint` is one passing replica (its address, the requests the router
has in flight to it, its limit); :class:`ReplicaHealth` is its passive
outlier record; :class:`Failure` names what a replica did wrong. They sit at
the bottom of the router's request path, below :mod:`router.balancer` (which
picks among endpoints), :mod:`router.outliers` (which judges their failures)
and :mod:`router.metrics` (which counts ejections by :class:`Failure`), so
none of those three imports another to name them (the import circle
balancer → outliers → metrics → outliers, cut for issue 19; the
``acyclic_siblings`` contract in pyproject.toml keeps it cut).

:class:`Endpoint` objects are created and retired by :mod:`router.endpoints`;
their limit is set by :mod:`router.capacity`; their in-flight count changes
only in :class:`router.admission.Slots`; their health only in
:class:`router.outliers.OutlierDetector`.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum

from yarl import URL

from router.catalog import ServiceAddress

# URLs cached per endpoint: the model routes (router.routes), with room to spare.
URL_CACHE_SIZE = 64


class Failure(StrEnum):
    """What a replica did wrong (the ``reason`` label of the ejection counter)."""

    CONNECT = "connect_error"
    # Connected and sent, then the connection closed or reset before any answer.
    BROKEN = "connection_broken"
    # No first byte, and /health unanswered (or 5xx): ejected at once.
    DEAD = "liveness_failed"
    # /health answered, its work counters still for the stall timeout: ejected at once.
    STALLED = "stalled"
    HTTP_5XX = "http_5xx"


class ReplicaHealth:
    """One replica's outlier record (the rules: :mod:`router.outliers`). ``ejected``
    is the only field the hot path reads."""

    __slots__ = (
        "consecutive", "consecutive_5xx", "ejected", "ejections", "failure", "probation",
        "timer",
    )  # fmt: skip

    def __init__(self) -> None:
        self.consecutive = 0
        self.consecutive_5xx = 0
        self.ejected = False
        # Ejections in a row, without a good answer in between: the back-off multiplier.
        self.ejections = 0
        self.probation = False
        self.timer: asyncio.TimerHandle | None = None
        # What the last ejection was for: the question asked when it ends.
        self.failure: Failure | None = None


class Endpoint:
    """One passing replica, the requests the router has in flight to it, and how
    many it may have (``limit``: llama-server's slot count, or a setting).

    The object outlives its place in the table: a request that picked it keeps
    it and releases its own slot even after the replica left.
    """

    __slots__ = (
        "_urls", "address", "base_url", "health", "inflight", "limit", "others", "quiet_until",
    )  # fmt: skip

    def __init__(self, address: ServiceAddress, limit: int) -> None:
        self.address = address
        host = f"[{address.host}]" if ":" in address.host else address.host
        self.base_url = f"http://{host}:{address.port}"
        self.inflight = 0
        self.limit = limit
        # Other routers' requests in flight here, as the replica last reported them
        # (router.replicaload): balance orders by inflight + others.
        self.others = 0
        # time.monotonic() until which its load is not read (router.replicaload.hush).
        self.quiet_until = 0.0
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
        return (
            f"Endpoint({self.base_url}, inflight={self.inflight}/{self.limit}, "
            f"others={self.others})"
        )
