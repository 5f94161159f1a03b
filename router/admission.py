"""Per-replica concurrency limits, and the bounded, fair wait for a free slot.

Why: a burst of 1,000 requests on one llama-server took every one of its HTTP
threads, its ``/health`` went unanswered, and Nomad's ``check_restart`` killed
the busy, healthy server (issue 7, case C18). llama-server generates for
``total_slots`` requests at once and parks the rest on HTTP threads; the router
sends each replica at most its ``limit`` (:attr:`router.endpoint.Endpoint.limit`,
read by :mod:`router.capacity`) and holds the rest here, where a waiting
request costs a future, not a replica's thread.

One :class:`Slots` per model, on its :class:`router.endpoints.ModelEntry`;
everything runs on the one event loop, so nothing here locks. The proxy
(:mod:`router.proxy`) calls:

- :meth:`Slots.take`: the hot path. With nobody waiting, the least-loaded
  endpoint under its limit (:func:`router.balancer.pick`) gets the request;
  the slot is counted at once.
- :meth:`Slots.wait`: every endpoint is full (or others already wait). The
  request joins the model's FIFO and is handed a slot directly when one frees
  (:meth:`Slots.release`), when the endpoint set changes (:meth:`Slots.replace`,
  called by the endpoint table) or when a limit rises
  (:meth:`Slots.capacity_changed`). It waits at most the queue timeout, then
  raises ``TimeoutError``. A client that leaves cancels its task and so leaves
  the queue. Hand-off (rather than waking everyone to race for the slot) keeps
  the order strict and costs one wake-up per freed slot.
- :class:`Held`: the ``with`` block that releases a granted slot whatever way
  the request ends.

Another model's queue is another :class:`Slots`: one busy model never delays
another. A request retrying after a replica refused its connection waits at
the head of the queue (it already waited its turn) and is never handed a
replica it failed on.

Invariants: an endpoint's ``inflight`` counts the slots granted to it and not
yet released; a waiter is queued exactly while its future is pending; a
granted slot is released exactly once, by :class:`Held` or, when its waiter
left at the moment it was granted, by :meth:`Slots.wait` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Collection
from types import TracebackType

from router.balancer import Affinity, pick
from router.endpoint import Endpoint
from router.metrics import ModelMetrics


class _Waiter:
    __slots__ = ("exclude", "future")

    def __init__(
        self, future: asyncio.Future[Endpoint | None], exclude: Collection[Endpoint]
    ) -> None:
        self.future = future
        self.exclude = exclude


class Slots:
    """A model's passing endpoints, the slots they have free, and who waits for one."""

    __slots__ = ("_metrics", "_turn", "_waiters", "endpoints", "inflight")

    def __init__(self, metrics: ModelMetrics) -> None:
        self.endpoints: tuple[Endpoint, ...] = ()
        self._metrics = metrics
        self._turn = 0
        self._waiters: deque[_Waiter] = deque()
        # Slots granted and not yet released, on any endpoint (one that left the
        # model included, until its requests end).
        self.inflight = 0
        # Read at scrape time: nothing to count on the path every request (or
        # waiter) takes. A gauge's inc and dec were 2 of the router's 48 us of its
        # own CPU per request (bench/proxy_cpu.py).
        metrics.queued.set_function(self._waiters.__len__)
        metrics.inflight.set_function(lambda: self.inflight)
        metrics.ejected.set_function(self._ejected)

    def _ejected(self) -> int:
        """Passing endpoints ejected now (router.outliers), for the gauge."""
        return sum(1 for e in self.endpoints if e.health.ejected)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot now."""
        return len(self._waiters)

    def take(
        self,
        exclude: Collection[Endpoint] = (),
        *,
        first: bool = False,
        affinity: Affinity | None = None,
    ) -> Endpoint | None:
        """A slot on the least-loaded endpoint with room (or the one ``affinity``
        prefers), counted; ``None`` if none has room or (unless ``first``) other
        requests already wait: they go first, to whichever replica frees a slot."""
        if self._waiters and not first:
            return None
        self._turn += 1
        endpoint = pick(self.endpoints, self._turn, exclude, affinity)
        if endpoint is not None:
            endpoint.inflight += 1
            self.inflight += 1
        return endpoint

    async def wait(
        self, timeout_s: float, exclude: Collection[Endpoint] = (), *, first: bool = False
    ) -> Endpoint | None:
        """Queue for a slot (at the head if ``first``) for at most ``timeout_s`` seconds.

        Returns the endpoint whose slot was granted (counted), or ``None`` when
        the model lost every endpoint (or every one not in ``exclude``): the
        caller checks the model again. Raises ``TimeoutError`` when no slot
        came in time; cancellation (the client left) takes the waiter out.
        """
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), exclude)
        if first:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        # A slot may be free for this waiter only (the head waits for other replicas).
        self._dispatch()
        started = loop.time()
        # A plain timer rather than asyncio.timeout(): half the cost on the
        # path every request takes while the replicas are full.
        timer = loop.call_at(started + timeout_s, self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            future = waiter.future
            if future.cancelled():
                self._forget(waiter)
            elif future.exception() is None and (granted := future.result()) is not None:
                self.release(granted)  # granted as its client left: pass the slot on
            raise
        finally:
            timer.cancel()
            self._metrics.queue_wait.observe(loop.time() - started)

    def release(self, endpoint: Endpoint) -> None:
        """Give back a slot on ``endpoint`` and hand it (or another) to the next waiter."""
        endpoint.inflight -= 1
        self.inflight -= 1
        if self._waiters:
            self._dispatch()

    def replace(self, endpoints: tuple[Endpoint, ...]) -> None:
        """The model's passing endpoints changed: serve waiters from the new set, or
        wake them all to check the model again when none is left."""
        self.endpoints = endpoints
        if not self._waiters:
            return
        if endpoints:
            self._dispatch()
            return
        while self._waiters:
            future = self._waiters.popleft().future
            if not future.done():
                future.set_result(None)

    def capacity_changed(self) -> None:
        """An endpoint's limit changed (it may have risen): serve waiters."""
        if self._waiters:
            self._dispatch()

    def describe(self) -> str:
        """The endpoints' load and limits and the queue, for a refusal message."""
        loads = ", ".join(f"{e.inflight}/{e.limit}" for e in self.endpoints) or "none"
        return (
            f"{len(self.endpoints)} passing replica(s) with requests in flight/limit "
            f"{loads}; {len(self._waiters)} request(s) waiting"
        )

    def _dispatch(self) -> None:
        """Hand free slots to waiters, oldest first. A waiter that must not go back
        to the replicas it failed on is skipped while only those have room."""
        waiters = self._waiters
        skipped = 0
        while len(waiters) > skipped:
            waiter = waiters[skipped]
            if waiter.future.done():
                del waiters[skipped]
                continue
            self._turn += 1
            endpoint = pick(self.endpoints, self._turn, waiter.exclude)
            if endpoint is None:
                if not waiter.exclude:
                    return  # no room anywhere
                if all(e in waiter.exclude for e in self.endpoints):
                    del waiters[skipped]
                    waiter.future.set_result(None)  # nothing left for it to try
                else:
                    skipped += 1
                continue
            del waiters[skipped]
            endpoint.inflight += 1
            self.inflight += 1
            waiter.future.set_result(endpoint)

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self._forget(waiter)
            waiter.future.set_exception(TimeoutError())

    def _forget(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)


class Held:
    """The slot a request was granted on an endpoint, released when the ``with``
    block exits, whatever way (the grant itself counted it)."""

    __slots__ = ("_endpoint", "_slots")

    def __init__(self, slots: Slots, endpoint: Endpoint) -> None:
        self._slots = slots
        self._endpoint = endpoint

    def __enter__(self) -> Endpoint:
        return self._endpoint

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._slots.release(self._endpoint)
