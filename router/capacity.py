"""Reads each joining replica's slot count, its limit of requests in flight.

llama-server generates for ``total_slots`` requests at once (its ``--parallel``;
"auto" resolves to 4: tools/server/server.cpp in llama.cpp) and reports the
figure in ``GET /props``. :class:`CapacityReader` reads it once per endpoint,
when the endpoint joins the table (``EndpointTable``'s ``on_joined``), in a
task of its own: nothing on the request path waits for it.

Until the replica answers, it is sent **one request at a time**
(:data:`UNANSWERED_LIMIT`): a replica that accepts connections and answers
nothing (wedged) then costs one request before the first-byte watch ejects it
(:mod:`router.firstbyte`), not as many as a burst can send before that verdict
(found in review: 8 requests at once, 4 sent to a wedged replica, each 10-12 s).
A live llama-server answers ``/props`` from its HTTP thread within milliseconds
of joining (it joins once its ``/health`` passed), so a healthy replica is held
to one request only that long; waiters are served when its limit rises. An
answer without a slot count (another engine, a ``/props`` behind an API key, an
error status) gives the table's default limit
(``RouterSettings.default_replica_concurrency``, 4, llama-server's own default).
No answer at all (timeout, connection failed): asked again after
:data:`RETRY_MIN_S`, doubling to :data:`RETRY_MAX_S`, while the endpoint is in the
table. A limit set by the operator (``--replica-concurrency N``) makes the router
build no reader at all.

Started and stopped by the app's lifespan (:mod:`router.app`); it shares the
control connection pool, with a short timeout of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.admission import Slots
from router.endpoint import Endpoint

log = logging.getLogger(__name__)

PROPS_PATH = "/props"
# In flight to a replica that has not answered /props yet.
UNANSWERED_LIMIT = 1
# Between two asks of a replica that did not answer (doubling).
RETRY_MIN_S = 5.0
RETRY_MAX_S = 60.0


def total_slots(doc: object) -> int:
    """``total_slots`` from a ``/props`` answer. Raises ``ValueError`` when it is
    missing or not a positive integer."""
    value = doc.get("total_slots") if isinstance(doc, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"no positive total_slots in the answer (got {value!r})")
    return value


class CapacityReader:
    """Reads ``/props`` of every joining endpoint and sets its limit.

    ``session`` returns the upstream aiohttp session (opened by the lifespan
    after this object is built).
    """

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession | None],
        timeout_s: float,
        max_limit: int = 1 << 30,
    ) -> None:
        self._session = session
        # The connections the router may open to one replica: more in flight
        # would wait in aiohttp's pool, outside the bounded queue.
        self._max_limit = max_limit
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._tasks: set[asyncio.Task[None]] = set()

    def joined(self, slots: Slots, endpoint: Endpoint) -> None:
        """Start reading ``endpoint``'s slot count (an ``EndpointTable`` ``on_joined``);
        until it answers, it takes :data:`UNANSWERED_LIMIT` requests at a time.

        Before the lifespan opened the control pool there is nothing to read
        with: the endpoint keeps its default limit.
        """
        if self._session() is None:
            return
        default = endpoint.limit
        endpoint.limit = min(UNANSWERED_LIMIT, default)
        task = asyncio.ensure_future(self.read(slots, endpoint, default))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def read(self, slots: Slots, endpoint: Endpoint, default: int) -> None:
        """Set ``endpoint.limit`` from its ``/props``: its slot count, or ``default``
        when it answered without one; asked again while it does not answer and is
        still one of ``slots``' endpoints."""
        delay = RETRY_MIN_S
        while (limit := await self._ask(endpoint, default)) is None:
            if endpoint not in slots.endpoints:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
        if limit != endpoint.limit:
            endpoint.limit = limit
            slots.capacity_changed()

    async def _ask(self, endpoint: Endpoint, default: int) -> int | None:
        """The limit ``endpoint``'s ``/props`` answer gives; ``None`` when it did not
        answer."""
        session = self._session()
        if session is None:
            return default
        try:
            async with session.get(
                endpoint.url(PROPS_PATH), timeout=self._timeout, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                slot_count = total_slots(await resp.json(content_type=None))
        except (aiohttp.ClientResponseError, ValueError, RecursionError) as exc:
            log.info(
                "%s: no slot count from %s (%s); limit %d requests in flight",
                endpoint.base_url,
                PROPS_PATH,
                exc,
                default,
            )
            return default
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info(
                "%s: no answer from %s (%r); one request at a time until it answers",
                endpoint.base_url,
                PROPS_PATH,
                exc,
            )
            return None
        log.info("%s: %d slots (from %s)", endpoint.base_url, slot_count, PROPS_PATH)
        return min(slot_count, self._max_limit)

    async def close(self) -> None:
        """Cancel reads still running (shutdown)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
