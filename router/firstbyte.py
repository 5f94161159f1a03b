"""The first-byte timeout: a replica that sends nothing in time is asked whether it is alive.

Why not a plain timeout on the response headers: llama-server sends a
non-streaming answer's headers only when the generation has ended, so a
60 s cap on the first byte would cut every generation longer than a minute
(and, retried, run it twice). A wedged replica and a busy one look the same
from the request; they differ in whether the server's inference loop still
answers. ``GET /slots`` is served through that loop (llama-server posts it to
its task queue, tools/server in llama.cpp), unlike ``/health``, which its HTTP
thread answers even when the loop is stuck. So:

- :data:`probe window <probe_window_s>` before the first-byte deadline the
  router sends ``GET /slots`` to the replica on its control session, with that
  window as its timeout;
- any HTTP answer (``200``; ``501`` from a server started with ``--no-slots``;
  ``401`` behind an API key) proves the replica is alive: the request keeps
  waiting, with a new first-byte deadline from the answer (so the replica is
  asked again every timeout minus the window), until the headers come or the
  long silence timeout (``upstream_read_timeout_s``) ends it; requests
  waiting on the same replica share one question, and an answer younger than
  the window serves them all;
- no answer within the window: the request is cancelled at the first-byte
  deadline (:attr:`FirstByteWatch.expired`), the proxy counts it against the
  replica (:mod:`router.outliers`) and, since nothing went to the client yet,
  tries another replica (:mod:`router.proxy`).

So a request never waits longer than the first-byte timeout on a replica that
accepts connections and never answers (case C21), and a long generation on a
healthy one is never cut. A ``--no-slots`` replica whose loop is stuck is not
caught this way; its silence timeout still ends the request.

Used only by :mod:`router.proxy`: one :class:`FirstByteWatch` per proxy, one
:class:`Attempt` per try on a replica, one timer for them all, and a probe
only for a request still waiting near its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.endpoint import Endpoint

log = logging.getLogger(__name__)

PROBE_PATH = "/slots"
# The probe's share of the first-byte timeout: long enough for a busy replica
# to answer between two decoding steps, short enough to leave the rest to it.
MAX_PROBE_WINDOW_S = 5.0


def probe_window_s(first_byte_timeout_s: float) -> float:
    """Seconds before the first-byte deadline that the liveness probe starts (and
    its timeout): half the timeout, at most :data:`MAX_PROBE_WINDOW_S`."""
    return min(MAX_PROBE_WINDOW_S, first_byte_timeout_s / 2)


async def alive(session: aiohttp.ClientSession, endpoint: Endpoint, timeout_s: float) -> bool:
    """``True`` when ``endpoint`` answers ``GET /slots`` (any status) within ``timeout_s``."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(endpoint.url(PROBE_PATH), timeout=timeout) as response:
            await response.read()
            return True
    except (aiohttp.ClientError, TimeoutError):
        return False


class Attempt:
    """One request waiting for a replica's first byte (see :class:`FirstByteWatch`)."""

    __slots__ = ("deadline", "endpoint", "expired", "probe_at", "probing", "task")

    def __init__(self, task: asyncio.Task[object] | None, endpoint: Endpoint, now: float,
                 timeout_s: float, window_s: float) -> None:  # fmt: skip
        self.task = task
        self.endpoint = endpoint
        self.deadline = now + timeout_s
        self.probe_at = self.deadline - window_s
        self.probing = False
        # Set when the watch cancelled the task: the proxy then retries elsewhere.
        self.expired = False


class FirstByteWatch:
    """Watches every attempt waiting for its first byte, with one timer for all.

    Measured: a timer per request (``loop.call_later`` and its cancel, on uvloop)
    cost 4 us, about 5% of the router's CPU per request; registering an attempt
    here costs a dict insert and delete. The sweep runs every quarter of the
    probe window while any attempt waits, so a probe starts at most that late,
    and its timeout is what is left to the deadline.

    ``session`` returns the control session the probes go on (``None``: no probe,
    a plain timeout). :meth:`start` before sending, :meth:`stop` once the
    headers came or the attempt failed; :meth:`close` cancels probes (shutdown).
    """

    def __init__(
        self, session: Callable[[], aiohttp.ClientSession | None], timeout_s: float
    ) -> None:
        self._session = session
        self.timeout_s = timeout_s
        self._window_s = probe_window_s(timeout_s)
        self._tick_s = self._window_s / 4
        self._waiting: dict[Attempt, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._probes: set[asyncio.Task[None]] = set()
        # One liveness question per replica at a time, however many requests wait
        # on it; an answer younger than the window serves every request's turn.
        self._asking: dict[Endpoint, asyncio.Task[bool]] = {}
        self._answered: dict[Endpoint, float] = {}

    def start(self, endpoint: Endpoint) -> Attempt:
        """Watch the current task's attempt on ``endpoint``."""
        loop = asyncio.get_running_loop()
        attempt = Attempt(
            asyncio.current_task(), endpoint, loop.time(), self.timeout_s, self._window_s
        )
        self._waiting[attempt] = None
        if self._timer is None:
            self._timer = loop.call_later(self._tick_s, self._sweep)
        return attempt

    def stop(self, attempt: Attempt) -> None:
        """The attempt is over (first byte, failure, or cancelled)."""
        self._waiting.pop(attempt, None)

    def _sweep(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._answered:
            stale = [e for e, at in self._answered.items() if now - at >= self._window_s]
            for endpoint in stale:
                del self._answered[endpoint]
        if not self._waiting:
            return
        for attempt in self._waiting:
            if not attempt.probing and now >= attempt.probe_at:
                attempt.probing = True
                # What is left to the deadline, but never less than half the
                # window: a sweep that ran late must not make an alive replica
                # look dead.
                timeout_s = max(attempt.deadline - now, self._window_s / 2)
                probe = loop.create_task(self._probe(attempt, timeout_s))
                self._probes.add(probe)
                probe.add_done_callback(self._probes.discard)
        self._timer = loop.call_later(self._tick_s, self._sweep)

    async def _alive(self, endpoint: Endpoint, timeout_s: float) -> bool:
        asking = self._asking.get(endpoint)
        if asking is None:
            session = self._session()
            if session is None:
                return False
            asking = self._asking[endpoint] = asyncio.ensure_future(
                alive(session, endpoint, timeout_s)
            )
            asking.add_done_callback(lambda _: self._asking.pop(endpoint, None))
        # Shielded: one waiter cancelled must not cancel the others' answer.
        return await asyncio.shield(asking)

    async def _probe(self, attempt: Attempt, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        answered = self._answered.get(attempt.endpoint)
        if answered is not None and loop.time() - answered < self._window_s:
            alive = True
        else:
            alive = await self._alive(attempt.endpoint, timeout_s)
            if alive:
                self._answered[attempt.endpoint] = loop.time()
        if alive:
            if attempt in self._waiting:
                # Debug: a long non-streaming generation is asked once a timeout.
                log.debug(
                    "replica %s: no first byte yet, but it answers %s: still waiting",
                    attempt.endpoint.base_url,
                    PROBE_PATH,
                )
                now = loop.time()
                attempt.deadline = now + self.timeout_s
                attempt.probe_at = attempt.deadline - self._window_s
                attempt.probing = False
            return
        if attempt in self._waiting and attempt.task is not None and not attempt.task.done():
            self._waiting.pop(attempt, None)
            attempt.expired = True
            attempt.task.cancel()

    async def close(self) -> None:
        """Stop the sweep and cancel probes in flight."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        probes = [*self._probes, *self._asking.values()]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
