"""Python's cycle collector in a serving router: what exists at start is never walked again.

Called once by :mod:`router.cli` (``router serve``), after the app is built and
before it serves. Why: CPython's generation-2 collection walks every tracked
object, and the router starts with about 100,000 of them (FastAPI, pydantic,
aiohttp, uvicorn, prometheus_client and its own modules). Under load, requests
in flight at each generation-1 collection survive into generation 2, so a full
collection comes every second or two. Measured (bench/side_by_side.py, 16
connections, the shared 2-core machine): full collections every 0.4-3 s, each
taking 160-205 ms, with every request in flight waiting behind it: that pause
was the router's p99.

:func:`freeze` moves every object alive then to the permanent generation
(``gc.freeze``), which collections skip: a full collection walks only what
was made since. Those objects (modules, classes, the app, settings) live as
long as the process anyway; reference counting still frees any of them that is
dropped, and only a reference cycle among them that became garbage would stay.

It also raises the generation-0 threshold to :data:`GEN0_THRESHOLD`. The
count that triggers a young collection is allocations less deallocations, and a
collection sets it to zero while the objects of the requests in flight are
still alive: their later deallocation no longer lowers it, so at 16
connections the router's in-flight objects alone (about 45 a request) refilled
Python's default 700 every 25 requests, and found no garbage. Measured (a
``gc.callbacks`` probe in the router, bench/side_by_side.py, 16 connections,
2026-12-03): 39-44 young collections a thousand requests, 6.0-8.3 us of CPU a
request, and a reference-cycle sweep of the requests' objects (``DEBUG_SAVEALL``
over 2 s of load) found none; with a threshold of 5,000 there was no young
collection in 10 s. A collection that does come walks at most the threshold's
worth of young objects: 10,000 is well under a millisecond.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


# Set by freeze(): only a serving router re-freezes (settle); a process that merely
# imports the router (the unit tests) keeps the collector as Python has it.
_serving = False

# Net new tracked objects between young collections (Python's default: 700).
GEN0_THRESHOLD = 10_000


def freeze() -> int:
    """Collect once, freeze what is left and raise the young generation's threshold
    to :data:`GEN0_THRESHOLD` (the older ones' unchanged); returns how many
    objects were frozen."""
    global _serving
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, older, oldest)
    _serving = True
    frozen = gc.get_freeze_count()
    log.debug("cycle collector: %d startup objects frozen", frozen)
    return frozen


def settle() -> None:
    """The router's models changed (added or removed): freeze what is alive again.

    Each defined model holds about a hundred tracked objects that live as long as
    it does, most of them its prometheus_client series (a value and its lock per
    bucket of five histograms). Made after :func:`freeze`, every full collection
    walked them: measured with 1,000 models (bench/state_churn.py, a
    ``gc.callbacks`` probe in the router), 270,000 tracked objects, full
    collections of 40-69 ms every few seconds, and the router's p99 at 16
    connections 22-29 ms against 3.7 ms with one model. So a change of the model
    set pays one full collection at once (everything unfrozen, collected, frozen
    again: what a removed model left in a cycle is freed then, never kept), and the
    collections between changes walk only what requests make. No-op until
    :func:`freeze` ran."""
    if not _serving:
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.debug("cycle collector: %d objects frozen after a model change", gc.get_freeze_count())
