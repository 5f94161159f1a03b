"""What the other routers have in flight on each replica, read from the replica itself.

Each router counts only its own requests in flight (:class:`router.endpoint.Endpoint`
``inflight``), and the router job runs two instances by default behind a front
with no affinity: each router alone balances its own share, and together they
pile onto one replica (issue 21, measured with ``bench/prefix_routing.py
--routers``: the busiest of two replicas held 72 % of the requests in flight with
three routers, 56 % with one). The replica knows the sum: llama-server's
``GET /metrics`` (every replica runs with ``--metrics``) has
``llamacpp:requests_processing`` and ``llamacpp:requests_deferred``, gauges of the
requests it runs and queues, every router's together. So while a model has
requests in flight (on this router, or on others as last read), :class:`LoadSampler`
reads every one of its replicas' gauges each ``interval_s`` and sets each
endpoint's ``others``: that sum less this router's own in flight there (the
larger of its counts when it asked and when answered; never below 0).
:func:`router.balancer.pick` and the prefix chooser's load bound order replicas by
``inflight + others``; the admission limit stays this router's own (``inflight <
limit``), as before. Admitting on the sum instead would hold a
router's requests in its queue on a read up to ``interval_s`` old while the other
routers, which see their own releases at once, refill every slot that frees: under
overload a router that held no slots (just started, or its load just rose) would
time its clients out while the others serve. A replica that more than one router
fills past its slots queues the excess itself, in order.

What it costs: one small GET per replica of a busy model per interval (0.1 s by
default; ``LLMGW_ROUTER_SHARED_LOAD_INTERVAL``, 0 turns it off), on the control
session, never on the request path. Why 0.1 s: the busiest replica's share of the
requests in flight with 2 and 3 routers stayed within 10 % of one router's in 2 of 6
measurements at 0.25 s, 4 of 6 at 0.1 s and 2 of 2 at 0.05 s, with the cache hit
rate and time to first token no worse at 0.1 s (``bench/prefix_routing.py
--routers``, docs/benchmarks.md). llama-server answers ``/metrics`` from its
queue's worker between batch steps (measured at most 18 ms into prompt steps of 5
to 27 s: :mod:`router.firstbyte`). A replica that does not answer within the
interval (at least :data:`READ_TIMEOUT_MIN_S`), or has no ``/metrics`` (501), counts
0 others: the router then balances on its own counts, as it did before. A read is
at most ``interval_s`` old, plus the time the slowest replica took to answer.

A replica whose client left a request still waiting for its answer is not read for
:data:`QUIET_AFTER_LEAVE_S` (:func:`hush`): llama-server notices that a client left
only when its wait for the request's next result times out (``recv_with_timeout``,
``HTTP_POLLING_SECONDS`` = 1 s, server-queue.cpp), and every result any task gets,
a ``/metrics`` read's included, starts that wait again; read every 0.1 s, a replica
ran a left 3,000-token completion to its end, 59 s (found in review, issue 21 item
8). Other traffic on the replica (another request's tokens, another router's reads)
does the same, which only llama.cpp can change: the bootstrap's build keeps one
deadline per wait (devcluster/llama_patches.py), and this pause remains for a
llama-server built elsewhere, where this router's reads are the only other results.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp

from router.endpoint import Endpoint

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
# The shortest wait for a replica's /metrics, whatever the interval: the wait the
# reads had at the 0.25 s interval measured before 0.1 s became the default; a late
# answer is still fresher than counting nobody else's requests.
READ_TIMEOUT_MIN_S = 0.25
# Seconds a replica's load is not read after a client left a request there: longer
# than llama-server's 1 s wait for a result (HTTP_POLLING_SECONDS), which must run
# out once with nothing received for it to notice the closed connection.
QUIET_AFTER_LEAVE_S = 2.0
# llama.cpp tools/server (server_task_result_metrics): gauges, every client's requests.
LOAD_GAUGES = (b"llamacpp:requests_processing", b"llamacpp:requests_deferred")


def reported_load(text: bytes) -> int | None:
    """The requests a replica runs and queues, from its ``/metrics`` text; ``None``
    when it has neither gauge."""
    total, seen = 0.0, False
    for line in text.splitlines():
        name, _, value = line.partition(b" ")
        if name in LOAD_GAUGES:
            with contextlib.suppress(ValueError):
                total += float(value.strip())
                seen = True
    return int(total) if seen else None


def hush(endpoint: Endpoint) -> None:
    """A client left a request waiting on ``endpoint``: no load read there for
    :data:`QUIET_AFTER_LEAVE_S`, so the replica can notice and stop it."""
    endpoint.quiet_until = time.monotonic() + QUIET_AFTER_LEAVE_S


def others_on(endpoint: Endpoint, reported: int | None, asked_at: int = 0) -> int:
    """The requests in flight on ``endpoint`` that are not this router's. ``asked_at``:
    this router's own count there when it asked. The replica counted at some moment
    between the question and the answer, so the larger of the two own counts is taken
    off: a request of this router's that ended meanwhile is not read as another
    router's (found in review: a lone router saw phantom others)."""
    if reported is None:
        return 0
    return max(0, reported - max(endpoint.inflight, asked_at))


class LoadSampler:
    """Keeps each busy model's endpoints' ``others`` fresh (see the module docstring).
    ``models`` gives each model's endpoints now; ``session`` the control session;
    ``interval_s`` the settings' ``shared_load_interval_s`` (its default is there)."""

    def __init__(
        self,
        models: Callable[[], Iterable[tuple[Endpoint, ...]]],
        session: Callable[[], aiohttp.ClientSession],
        interval_s: float,
    ) -> None:
        self._models, self._session, self.interval_s = models, session, interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            busy = [
                e
                for endpoints in self._models()
                if _busy(endpoints)
                for e in endpoints
                if e.quiet_until <= now
            ]
            if busy:
                await asyncio.gather(*(self._read(e) for e in busy))
            await asyncio.sleep(self.interval_s)

    async def _read(self, endpoint: Endpoint) -> None:
        reported: int | None = None
        asked_at = endpoint.inflight
        try:
            timeout = aiohttp.ClientTimeout(total=max(self.interval_s, READ_TIMEOUT_MIN_S))
            async with self._session().get(endpoint.url(METRICS_PATH), timeout=timeout) as response:
                if response.status == 200:
                    reported = reported_load(await response.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("no load read from %s: %r", endpoint.base_url, exc)
        endpoint.others = others_on(endpoint, reported, asked_at)


def _busy(endpoints: tuple[Endpoint, ...]) -> bool:
    """More than one replica to choose from, and requests in flight on one of them
    (this router's, or others' as last read)."""
    return len(endpoints) > 1 and any(e.inflight or e.others for e in endpoints)
