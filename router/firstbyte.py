"""Waiting for a replica's first byte: a dead replica is given up fast, a busy one never.

Why not a plain timeout on the response headers: llama-server sends a
non-streaming answer's headers only when the generation has ended, and a
stream's only once its first token is out, so a cap on the first byte would
cut every long generation (and, retried, run it twice). A wedged replica and a
busy one look the same from the request. Two questions tell them apart, each
answered by a different part of llama-server (llama.cpp tools/server, the
build the bootstrap pins: ``server.cpp`` routes, ``server-context.cpp``
handlers):

- **Is its HTTP server alive?** ``GET /health`` is answered by the HTTP
  thread pool alone (``get_health`` touches no task queue; a pool of at least
  slots + 4 threads, and the router keeps one free: :mod:`router.admission`),
  so a replica busy with a long prompt answers it at once. No answer within
  the probe window, a refused connection or a 5xx there (llama-server's 503
  "loading" or 500 "error" state): the replica is **dead**. The request is
  cancelled, the proxy ejects the replica at once (:mod:`router.outliers`,
  ``liveness_failed``) and, since nothing went to the client yet, tries
  another replica (:mod:`router.proxy`). Any other answer: the request keeps
  waiting with a new first-byte deadline, and is asked about again every
  timeout minus the window, until the headers come or the long silence
  timeout (``upstream_read_timeout_s``) ends it; it is never sent again.
- **Does its inference loop still make progress?** Not a question of
  answering: the pinned llama.cpp answers ``/slots`` and ``/metrics`` from its
  queue's worker even while a batch step runs (``yield_to_queue``; measured
  at most 18 ms into prompt steps of 5 to 27 s), so a decode stuck forever answers them too.
  What a stuck loop cannot do is count: while requests wait on a replica
  whose HTTP server is alive, its ``GET /metrics`` (the planner starts every
  replica with ``--metrics``) is read once a probe window, and its work
  counters (``llamacpp:n_decode_total``, ``prompt_tokens_total``,
  ``tokens_predicted_total``) are compared. Unchanged for the **stall
  timeout** (300 s by default: longer than one batch step, and one 8k-token
  step of ``-b 8192 -ub 8192`` on a CPU takes minutes, during which nothing
  counts) while requests kept waiting, the replica is **stalled**: a warning
  in the log and an ejection with reason ``stalled``, so new requests go
  elsewhere. The requests waiting on it are neither cut nor sent again (it
  may still run them); the silence timeout ends them. A replica without
  ``/metrics`` (501) is not judged.

Defaults (:mod:`router.settings`): a first-byte timeout of 10 s, so the
probe starts 5 s after the request went out and a replica that accepts
connections and never answers costs that one request at most 10 s (plus a
sweep's tick) before another replica answers it (case C21); after its
ejection :mod:`router.outliers` asks ``/health`` again before sending it
anything, so it costs no further request while it stays dead.

Used only by :mod:`router.proxy`: one :class:`FirstByteWatch` per proxy, one
:class:`Attempt` per try on a replica, one timer for them all, and probes only
for requests still waiting past half their timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.endpoint import Endpoint, Failure

log = logging.getLogger(__name__)

# Answered by llama-server's HTTP thread (alive); its work counters (progress).
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# The counters that move with every batch step (llama.cpp server_task_result_metrics).
PROGRESS_COUNTERS = (
    b"llamacpp:n_decode_total",
    b"llamacpp:prompt_tokens_total",
    b"llamacpp:tokens_predicted_total",
)
# The probe's share of the first-byte timeout: ample for an HTTP thread's answer
# on a loaded node, and it leaves the rest to the replica.
MAX_PROBE_WINDOW_S = 5.0


def probe_window_s(first_byte_timeout_s: float) -> float:
    """Seconds before the first-byte deadline that the liveness probe starts (and
    its timeout): half the timeout, at most :data:`MAX_PROBE_WINDOW_S`."""
    return min(MAX_PROBE_WINDOW_S, first_byte_timeout_s / 2)


async def alive(session: aiohttp.ClientSession, endpoint: Endpoint, timeout_s: float) -> bool:
    """``True`` when ``endpoint`` answers ``GET /health`` within ``timeout_s`` with a
    status below 500 (llama-server answers 200; 503 while loading, 500 in its error
    state: both mean it serves nothing)."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(
            endpoint.url(HEALTH_PATH), timeout=timeout, allow_redirects=False
        ) as response:
            await response.read()
            return response.status < 500
    except (aiohttp.ClientError, TimeoutError):
        return False


Progress = tuple[bytes, ...]
"""A replica's work counters, as the text of their values (only equality matters)."""


def progress_of(text: bytes) -> Progress:
    """The :data:`PROGRESS_COUNTERS` in a ``/metrics`` answer, in that order (empty
    when it has none of them)."""
    values = dict.fromkeys(PROGRESS_COUNTERS, b"")
    for line in text.splitlines():
        name, _, value = line.partition(b" ")
        if name in values:
            values[name] = value.strip()
    return tuple(values.values()) if any(values.values()) else ()


async def progress(
    session: aiohttp.ClientSession, endpoint: Endpoint, timeout_s: float
) -> Progress | None:
    """``endpoint``'s work counters (:func:`progress_of`); ``()`` when it answered
    without them (``/metrics`` off: 501) or the connection failed (a question for
    :func:`alive`); ``None`` when it did not answer within ``timeout_s``."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(
            endpoint.url(METRICS_PATH), timeout=timeout, allow_redirects=False
        ) as response:
            text = await response.read()
            return progress_of(text) if response.status == 200 else ()
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
        return ()
    except TimeoutError:
        return None
    except aiohttp.ClientError:
        return ()


class Tally:
    """One replica's last counters and since when they have not changed."""

    __slots__ = ("progress", "since")

    def __init__(self, value: Progress | None, now: float) -> None:
        self.progress = value
        self.since = now


class Attempt:
    """One request waiting for a replica's first byte (see :class:`FirstByteWatch`).

    ``owner`` is the proxy's, handed back to its stall callback (the model entry)."""

    __slots__ = (
        "deadline", "endpoint", "expired", "heard", "owner", "probe_at", "probing", "task",
    )  # fmt: skip

    def __init__(self, task: asyncio.Task[object] | None, endpoint: Endpoint, owner: object,
                 now: float, timeout_s: float, window_s: float) -> None:  # fmt: skip
        self.task = task
        self.endpoint = endpoint
        self.owner = owner
        self.deadline = now + timeout_s
        self.probe_at = self.deadline - window_s
        self.probing = False
        # Its replica answered /health at least once while it waited: from then
        # on its progress is watched (stall).
        self.heard = False
        # Set when the watch cancelled the task: the proxy then retries elsewhere.
        self.expired = False


Stalled = Callable[[Attempt], None]
"""Told, once a stall timeout, one attempt waiting on a replica whose counters stood still."""


class FirstByteWatch:
    """Watches every attempt waiting for its first byte, with one timer for all.

    Measured: a timer per request (``loop.call_later`` and its cancel, on uvloop)
    cost 4 us, about 5% of the router's CPU per request; registering an attempt
    here costs a dict insert and delete. The sweep runs every quarter of the
    probe window while any attempt waits, so a probe starts at most that late,
    and its timeout is what is left to the deadline.

    ``session`` returns the control session the probes go on (``None``: no probe,
    a plain timeout). ``stalled`` hears of a replica whose counters stood still
    for ``stall_timeout_s`` while requests waited (see the module's docstring).
    :meth:`start` before sending, :meth:`stop` once the headers came or the
    attempt failed; :meth:`close` cancels probes (shutdown).
    """

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession | None],
        timeout_s: float,
        stall_timeout_s: float = 300.0,
        stalled: Stalled | None = None,
    ) -> None:
        self._session = session
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._stalled = stalled
        self._window_s = probe_window_s(timeout_s)
        self._tick_s = self._window_s / 4
        self._waiting: dict[Attempt, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._probes: set[asyncio.Task[None]] = set()
        # One liveness question per replica at a time, however many requests wait
        # on it; an answer younger than the window serves every request's turn.
        self._asking: dict[Endpoint, asyncio.Task[bool]] = {}
        self._answered: dict[Endpoint, float] = {}
        # Progress, per replica that requests wait on: one read at a time, at most
        # one a window, and the counters at a stall (compared when it returns).
        self._reading: dict[Endpoint, asyncio.Task[None]] = {}
        self._read_at: dict[Endpoint, float] = {}
        self._tallies: dict[Endpoint, Tally] = {}
        self._stalled_at: dict[Endpoint, Progress | None] = {}

    def start(
        self, endpoint: Endpoint, owner: object = None, task: asyncio.Task[object] | None = None
    ) -> Attempt:
        """Watch ``task``'s attempt (the current task's when not given) on ``endpoint``.
        The proxy passes its task: one ``current_task`` (a ``getpid`` system call on
        Python 3.11, see :meth:`router.streaming.DisconnectWatches.watch`) a request."""
        if task is None:
            task = asyncio.current_task()
            assert task is not None, "start() outside a task"
        loop = task.get_loop()
        attempt = Attempt(task, endpoint, owner, loop.time(), self.timeout_s, self._window_s)
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
        watched = {a.endpoint for a in self._waiting if a.heard}
        if len(watched) != len(self._tallies) or not watched.issuperset(self._tallies):
            # A replica nobody waits on any more: its stall window starts afresh.
            for endpoint in [e for e in self._tallies if e not in watched]:
                del self._tallies[endpoint]
        if len(self._read_at) > len(watched):
            for endpoint in [e for e in self._read_at if e not in watched]:
                del self._read_at[endpoint]
        if not self._waiting:
            return
        for endpoint in watched:
            if (
                endpoint not in self._reading
                and now - self._read_at.get(endpoint, -self._window_s) >= self._window_s
            ):
                self._read_at[endpoint] = now
                self._reading[endpoint] = self._spawn(self._read_progress(endpoint))
        for attempt in self._waiting:
            if not attempt.probing and now >= attempt.probe_at:
                attempt.probing = True
                # What is left to the deadline, but never less than half the
                # window: a sweep that ran late must not make an alive replica
                # look dead.
                timeout_s = max(attempt.deadline - now, self._window_s / 2)
                self._spawn(self._probe(attempt, timeout_s))
        self._timer = loop.call_later(self._tick_s, self._sweep)

    def _spawn(self, coroutine: object) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)  # type: ignore[arg-type]
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)
        return task

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
                    HEALTH_PATH,
                )
                now = loop.time()
                attempt.heard = True
                attempt.deadline = now + self.timeout_s
                attempt.probe_at = attempt.deadline - self._window_s
                attempt.probing = False
            return
        if attempt in self._waiting and attempt.task is not None and not attempt.task.done():
            self._waiting.pop(attempt, None)
            attempt.expired = True
            attempt.task.cancel()

    async def _read_progress(self, endpoint: Endpoint) -> None:
        try:
            session = self._session()
            if session is None:
                return
            value = await progress(session, endpoint, self._window_s)
            now = asyncio.get_running_loop().time()
            tally = self._tallies.get(endpoint)
            if value == ():
                self._tallies.pop(endpoint, None)  # nothing to judge by
                return
            if tally is None or (value is not None and value != tally.progress):
                self._tallies[endpoint] = Tally(value, now)
                return
            if now - tally.since < self.stall_timeout_s:
                return
            waiting = [a for a in self._waiting if a.endpoint is endpoint and a.heard]
            tally.since = now  # told once a stall timeout, not once a read
            if not waiting or self._stalled is None:
                return
            log.warning(
                "replica %s: its HTTP server answers %s, but its work counters (%s) have "
                "not moved for %g s while %d request(s) waited on it: inference loop stalled",
                endpoint.base_url,
                HEALTH_PATH,
                METRICS_PATH,
                self.stall_timeout_s,
                len(waiting),
            )
            self._stalled_at[endpoint] = tally.progress
            self._stalled(waiting[0])
        finally:
            self._reading.pop(endpoint, None)

    async def check(self, endpoint: Endpoint, failure: Failure) -> bool:
        """Ask a replica ejected for ``failure`` the question it failed, within the
        probe window (:attr:`router.outliers.OutlierDetector.check`): a dead one
        must answer ``/health``; a stalled one must have counted since, unless the
        router has no request on it any more (an idle replica counts nothing)."""
        session = self._session()
        if session is None:
            return True
        if failure is not Failure.STALLED:
            return await alive(session, endpoint, self._window_s)
        before = self._stalled_at.pop(endpoint, None)
        if endpoint.inflight == 0:
            return True
        now = await progress(session, endpoint, self._window_s)
        return now == () or (now is not None and now != before)

    async def close(self) -> None:
        """Stop the sweep and cancel probes in flight."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        probes = [*self._probes, *self._asking.values()]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
