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
  waiting, and the replica is asked again one first-byte timeout later, until
  the headers come or the long silence timeout
  (``upstream_read_timeout_s``) ends it;
- no answer within the window: the request is cancelled at the first-byte
  deadline (:attr:`FirstByteWatch.expired`), the proxy counts it against the
  replica (:mod:`router.outliers`) and, since nothing went to the client yet,
  tries another replica (:mod:`router.proxy`).

So a request never waits longer than the first-byte timeout on a replica that
accepts connections and never answers (case C21), and a long generation on a
healthy one is never cut. A ``--no-slots`` replica whose loop is stuck is not
caught this way; its silence timeout still ends the request.

Used only by :mod:`router.proxy`, one :class:`FirstByteWatch` per attempt:
a timer on the hot path, a probe only for a request still waiting near its
deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.balancer import Endpoint

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


class FirstByteWatch:
    """Cancels the current task when ``endpoint`` sent no first byte within
    ``timeout_s`` and does not answer a liveness probe. Always :meth:`disarm`."""

    __slots__ = (
        "_endpoint", "_probe", "_session", "_target", "_timeout_s", "_timer", "_window_s",
        "expired",
    )  # fmt: skip

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession | None],
        endpoint: Endpoint,
        timeout_s: float,
    ) -> None:
        self._session = session
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._window_s = probe_window_s(timeout_s)
        self._target = asyncio.current_task()
        self._probe: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            timeout_s - self._window_s, self._start_probe
        )
        self.expired = False

    def _start_probe(self) -> None:
        self._timer = None
        self._probe = asyncio.ensure_future(self._check())

    async def _check(self) -> None:
        session = self._session()
        if session is not None and await alive(session, self._endpoint, self._window_s):
            # Debug: a long non-streaming generation is asked once a timeout.
            log.debug(
                "replica %s: no first byte after %g s, but it answers %s: still waiting",
                self._endpoint.base_url,
                self._timeout_s - self._window_s,
                PROBE_PATH,
            )
            self._probe = None
            self._timer = asyncio.get_running_loop().call_later(
                self._timeout_s - self._window_s, self._start_probe
            )
            return
        self._probe = None
        if self._target is not None and not self._target.done():
            self.expired = True
            self._target.cancel()

    def disarm(self) -> None:
        """Stop watching; safe to call more than once."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
