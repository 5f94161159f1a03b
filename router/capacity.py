"""Reads each joining replica's slot count, its limit of requests in flight.

llama-server generates for ``total_slots`` requests at once (its ``--parallel``;
"auto" resolves to 4: tools/server/server.cpp in llama.cpp) and reports the
figure in ``GET /props``. :class:`CapacityReader` reads it once per endpoint,
when the endpoint joins the table (``EndpointTable``'s ``on_joined``), in a
task of its own: nothing on the request path waits for it. Until the answer,
and when the read fails (another engine, a ``/props`` behind an API key, a
timeout), the endpoint keeps the table's default limit
(``RouterSettings.default_replica_concurrency``, 4, the same as llama-server's
own default). A limit set by the operator (``--replica-concurrency N``) makes
the router build no reader at all.

Started and stopped by the app's lifespan (:mod:`router.app`); it shares the
upstream connection pool, with a short timeout of its own.
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
        """Start reading ``endpoint``'s slot count (an ``EndpointTable`` ``on_joined``).

        Before the lifespan opened the upstream pool there is nothing to read
        with: the endpoint keeps its default limit.
        """
        if self._session() is None:
            return
        task = asyncio.ensure_future(self.read(slots, endpoint))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def read(self, slots: Slots, endpoint: Endpoint) -> None:
        """Set ``endpoint.limit`` from its ``/props``; on any failure keep the default."""
        session = self._session()
        if session is None:
            return
        try:
            async with session.get(endpoint.url(PROPS_PATH), timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                limit = min(total_slots(await resp.json(content_type=None)), self._max_limit)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.info(
                "%s: no slot count from %s (%s); limit stays %d requests in flight",
                endpoint.base_url,
                PROPS_PATH,
                exc,
                endpoint.limit,
            )
            return
        if limit != endpoint.limit:
            log.info("%s: %d slots (from %s)", endpoint.base_url, limit, PROPS_PATH)
            endpoint.limit = limit
            slots.capacity_changed()

    async def close(self) -> None:
        """Cancel reads still running (shutdown)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
