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
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze() -> int:
    """Collect once, then freeze what is left; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("cycle collector: %d startup objects frozen", frozen)
    return frozen
