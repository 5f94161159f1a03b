"""Least-outstanding-requests choice among a model's passing endpoints, under their limits.

:func:`pick` is pure: it reads each :class:`Endpoint`'s in-flight counts (its own,
and the other routers' as the replica reported them) and limit and returns the
least loaded endpoint that has a free slot, rotating the starting point so
replicas with equal load take turns. The router's own counts change only in
:class:`router.admission.Slots`, which grants and releases slots in pairs; the
others' only in :mod:`router.replicaload`.
:class:`~router.endpoint.Endpoint` (:mod:`router.endpoint`) is created and retired
by :mod:`router.endpoints`; its limit is set by :mod:`router.capacity`. With prefix
routing on, an :data:`Affinity` is asked first (:mod:`router.prefix`);
least-outstanding is the fallback.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from router.endpoint import Endpoint
from router.outliers import not_ejected

if TYPE_CHECKING:
    from router.prefix import PrefixChooser

Affinity = tuple["PrefixChooser", str]
"""A request's preferred placement: the chooser and the request's prefix key."""


def usable(endpoint: Endpoint, exclude: Collection[Endpoint] = ()) -> bool:
    """It has a free slot and has not failed this request already."""
    return endpoint.inflight < endpoint.limit and not (exclude and endpoint in exclude)


def preferable(endpoint: Endpoint) -> bool:
    """Whether a prefix's replica may be preferred for this request: every router's
    requests there leave it a free slot, and, with other routers' requests there and
    more than 2 slots, a second one. Their count is as the replica last reported it
    (:mod:`router.replicaload`: an interval old, plus the time it took to answer), and
    the last slot is the one two routers take at once, one of them then waiting in the
    replica's queue. When it is not preferable, the next replica on the ring is asked,
    then least-outstanding decides (which may still fill that slot): its cache is worth
    less than a wait in its queue. A replica of 1 or 2 slots spares none (it would lose
    its affinity whenever another router had a request there). Measured
    (``bench/prefix_routing.py --routers``, 8 rounds, the same texts): the busiest
    replica's share with 3 routers 58 % without the spare slot, 54-56 % with it,
    against one router's 51-53 % (docs/benchmarks.md)."""
    spare = 1 if endpoint.others and endpoint.limit > 2 else 0
    return endpoint.inflight + endpoint.others < endpoint.limit - spare


def pick(
    endpoints: Sequence[Endpoint],
    start: int,
    exclude: Collection[Endpoint] = (),
    affinity: Affinity | None = None,
) -> Endpoint | None:
    """Return the endpoint with the fewest requests in flight and a free slot, or ``None``.

    Requests in flight are this router's and, as the replica last reported them, the
    other routers' (``others``: :mod:`router.replicaload`); the free slot is this
    router's own limit.

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
        chosen = chooser.choose(endpoints, key, lambda e: usable(e, exclude) and preferable(e))
        if chosen is not None:
            return chosen
    n = len(endpoints)
    best: Endpoint | None = None
    best_load = 0
    for i in range(n):
        candidate = endpoints[(start + i) % n]
        if candidate.inflight >= candidate.limit or (exclude and candidate in exclude):
            continue
        load = candidate.inflight + candidate.others
        if best is None or load < best_load:
            best, best_load = candidate, load
            if load == 0:
                break
    return best
