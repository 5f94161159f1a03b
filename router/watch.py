"""Consul watches that keep the :class:`~router.endpoints.EndpointTable` fresh.

A fixed set of watches covers every model, however many are defined (a
connection each, held for its blocking query; nothing per model):

- the KV prefix ``llmgw/models/`` (model records) and ``/v1/catalog/services``
  (which models have an ``llmgw-<model>`` service registered): the table's
  models are the union of the two (:meth:`EndpointTable.set_models`,
  :meth:`EndpointTable.set_services`), so a model that serves stays defined
  when its KV record vanishes;
- the checks of every ``llmgw-*`` service and every node, in one query
  (:meth:`ConsulCatalog.check_states`). A model whose checks changed since the
  table last took its endpoints is read again (its passing instances, one
  plain read, at most :data:`router.catalog.REFRESH_CONCURRENCY` at once),
  unless none of its instances passes (then it has none, and nothing is
  read). Endpoints of a model the table does not define yet wait in the table
  until it does (the watches race at startup);
- the KV prefix ``llmgw/routing/`` (the planner's parked / unplaceable records,
  rewritten only when they change), so a parked model is refused within one
  blocking-query round trip of the planner's write. Each answer holds every
  document; only the changed ones are decoded (:mod:`router.states`), and while
  they churn the reads are spaced, at least :data:`STATE_MIN_INTERVAL_S` apart
  and so that they take at most :data:`STATE_LOOP_SHARE` of the event loop
  (:func:`state_interval`).

Why not one health watch per model: issue 10 (500 on-demand models; the
router held a long poll per model on a client capped at 100 connections,
knew 123 models and never recovered after a prune).

With the API keys in Consul (``LLMGW_API_KEYS_CONSUL``), one more follows the
KV key ``llmgw-router/api-keys`` into :class:`router.keys.ConsulKeys`, so a key
added or revoked there takes effect within one blocking-query round trip.

With on-demand activation on, two more follow the planners into
:class:`router.planners.PlannerCandidates`: the KV key ``llmgw/leader`` (who
leads now) and the health of the ``llmgw-planner`` service (which instances
pass their TTL check), so activate calls and usage reports follow a planner
failover within one blocking-query round trip of the new leader taking the lock.

Started and stopped by the app's lifespan (:mod:`router.app`).

Each watch has three layers (after kopf's watching.py):

1. one blocking read (:class:`router.catalog.ConsulCatalog`);
2. :func:`_list_then_watch`: read at index 0 (a full list), apply it, then
   block on the last index; any index change, even backwards, is applied, an
   index that went backwards restarts from 0, and an index of 0 is never
   blocked on (Consul answers index 0 at once, so it would spin);
3. :meth:`ConsulWatcher._forever`: reconnects forever with capped, jittered
   exponential backoff (tenacity: 0.2 s doubling up to the cap, full jitter),
   starting over after any read that worked, and logs every failure, including
   our own bugs, so a watch never dies silently.

When Consul is unreachable the table keeps its last contents: routing to the
endpoints we last saw passing beats refusing every request. When it comes back
having lost its state (its KV index went back: :class:`HighWater`), the records
and states it dropped are remembered until the planner writes them again
(:class:`router.endpoints.EndpointTable`), so a model served a moment ago is never
answered "does not exist".
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from llmgw_contract import LEADER_KEY, PLANNER_SERVICE, ROUTER_API_KEYS_KEY, KVPrefix
from router.catalog import REFRESH_CONCURRENCY, CheckState, ConsulCatalog
from router.endpoints import EndpointTable
from router.errors import CatalogError
from router.keys import ConsulKeys
from router.planners import PlannerCandidates

log = logging.getLogger(__name__)

Read = Callable[[int], Awaitable[tuple[int, Any]]]
Apply = Callable[[Any], Awaitable[None] | None]

# Floor between two reads of one watch: a Consul that answers at once (index
# bug, flapping service) costs at most this many requests per second.
_MIN_READ_INTERVAL_S = 0.05
_BACKOFF_INITIAL_S = 0.2
# The share of the event loop the state watch may take while the documents churn
# (issue 21: 1,000 models changing state every second): after a read that cost c
# seconds of work (router.states), the next starts no sooner than c / this.
STATE_LOOP_SHARE = 0.1
# The floor between two reads of the routing documents while they keep changing.
# Measured (bench/state_churn.py, 1,000 models, 100 routing documents changing a
# second): at the 50 ms floor of the other watches the router read 20 times a second,
# 13% of a core with no request, and Consul spent about 14% of one more encoding the
# answers. A model's refusal then reaches the router at most this much later while
# the documents churn; a change after a quiet spell is read at once.
STATE_MIN_INTERVAL_S = 0.25


def state_interval(cost_s: float) -> float:
    """Seconds from the start of one read of ``llmgw/routing/`` to the next, given
    the work the last one cost: at least :data:`STATE_MIN_INTERVAL_S`, more for a
    large answer. A write after a quiet spell is read at once (the blocking read
    waited longer than this)."""
    return max(STATE_MIN_INTERVAL_S, cost_s / STATE_LOOP_SHARE)


def next_index(previous: int, returned: int) -> int:
    """Index to block on next, per Consul's blocking-query rules.

    An index that went backwards (Consul restarted, snapshot restored) means
    our view may be from another timeline: start over from 0. A returned
    index below 1 is a Consul bug that would make every read return at once;
    block on 1 instead.
    """
    if returned < previous:
        return 0
    return max(returned, 1)


class HighWater:
    """The highest index one watch has read, across its reconnects: a read below it
    comes from a Consul that lost its state (a dev agent restarted, a rebuilt cluster,
    a restored snapshot), whose KV starts over at a low index. A KV wipe moves the
    index forward, so it is not one (Consul's tombstones keep the index)."""

    def __init__(self) -> None:
        self.high = 0

    def went_back(self, returned: int) -> bool:
        """Whether ``returned`` is below the highest index read so far; either way it
        is the new mark when it went back (the new timeline's)."""
        back = returned < self.high
        self.high = returned if back else max(self.high, returned)
        return back


async def _list_then_watch(
    read: Read,
    apply: Apply,
    on_read: Callable[[], None],
    interval: Callable[[], float] = lambda: _MIN_READ_INTERVAL_S,
) -> None:
    index = 0
    first = True
    while True:
        started = time.monotonic()
        returned, value = await read(index)
        on_read()
        if first or returned != index:
            applied = apply(value)
            if inspect.isawaitable(applied):
                await applied
        first = False
        index = next_index(index, returned)
        pause = interval() - (time.monotonic() - started)
        if pause > 0:
            await asyncio.sleep(pause)


class ConsulWatcher:
    """Owns the models, services, health and states watch tasks and, given
    ``planners``, the leader and planner-instance watch tasks."""

    def __init__(
        self,
        catalog: ConsulCatalog,
        table: EndpointTable,
        *,
        wait_s: float,
        backoff_max_s: float,
        planners: PlannerCandidates | None = None,
        keys: ConsulKeys | None = None,
    ) -> None:
        self._catalog = catalog
        self._keys = keys
        self._table = table
        self._planners = planners
        self._wait_s = wait_s
        self._backoff_max_s = backoff_max_s
        self._tasks: list[asyncio.Task[None]] = []
        # Per model, the checks its endpoints in the table were read under.
        self._applied: dict[str, CheckState] = {}

    def start(self) -> None:
        """Start every watch (a fixed number of tasks, whatever the number of models)."""
        if not self._tasks:
            self._tasks = [
                self._spawn("kv", self._watch_models()),
                self._spawn("services", self._watch_services()),
                self._spawn("health", self._watch_health()),
                self._spawn("state", self._watch_states()),
            ]
            if self._keys is not None:
                self._tasks.append(self._spawn("api-keys", self._watch_keys(self._keys)))
            if self._planners is not None:
                self._tasks += [
                    self._spawn("leader", self._watch_leader(self._planners)),
                    self._spawn("planners", self._watch_planners(self._planners)),
                ]

    async def stop(self) -> None:
        """Cancel every watch and wait for them to finish."""
        tasks = self._tasks
        self._tasks = []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def task_count(self) -> int:
        """Watch tasks running (each holds at most one blocking query)."""
        return len(self._tasks)

    def _spawn(self, name: str, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"llmgw-watch-{name}")
        task.add_done_callback(_report_unexpected_end)
        return task

    async def _watch_models(self) -> None:
        mark = HighWater()

        async def read(index: int) -> tuple[int, Any]:
            returned, records = await self._catalog.models(index, self._wait_s)
            return returned, (records, mark.went_back(returned))

        def apply(value: Any) -> None:
            self._table.set_models(value[0], consul_reset=value[1])

        await self._forever(f"Consul KV {KVPrefix.MODELS}", read, apply)

    async def _watch_services(self) -> None:
        def read(index: int) -> Awaitable[tuple[int, Any]]:
            return self._catalog.services(index, self._wait_s)

        await self._forever("Consul catalog services", read, self._table.set_services)

    async def _watch_health(self) -> None:
        def read(index: int) -> Awaitable[tuple[int, Any]]:
            return self._catalog.check_states(index, self._wait_s)

        await self._forever("Consul health of llmgw-* services", read, self._refresh)

    async def _refresh(self, states: dict[str, CheckState]) -> None:
        """Bring the table's endpoints in line with ``states``: read again only the
        models whose checks changed. A read that fails leaves that model's
        check state unrecorded, so the next round reads it again; the failure
        is raised once every read ended."""
        changed = [
            model
            for model in self._applied.keys() | states.keys()
            if states.get(model) != self._applied.get(model)
        ]
        if not changed:
            return
        gate = asyncio.Semaphore(REFRESH_CONCURRENCY)

        async def one(model: str) -> None:
            state = states.get(model)
            if state is None or not state.any_passing:
                addresses = []
            else:
                async with gate:
                    addresses = await self._catalog.passing(model)
            self._table.set_endpoints(model, addresses)
            if state is None:
                self._applied.pop(model, None)
            else:
                self._applied[model] = state

        results = await asyncio.gather(*(one(m) for m in changed), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _watch_states(self) -> None:
        mark = HighWater()

        async def read(index: int) -> tuple[int, Any]:
            returned, states = await self._catalog.states(index, self._wait_s)
            present = self._catalog.state_view.present
            return returned, (states, mark.went_back(returned), present)

        def apply(value: Any) -> None:
            self._table.set_states(value[0], consul_reset=value[1], present=value[2])

        def interval() -> float:
            return state_interval(self._catalog.state_view.cost_s)

        await self._forever(f"Consul KV {KVPrefix.ROUTING}", read, apply, interval)

    async def _watch_leader(self, planners: PlannerCandidates) -> None:
        def read(index: int) -> Awaitable[tuple[int, Any]]:
            return self._catalog.leader(index, self._wait_s)

        await self._forever(f"Consul KV {LEADER_KEY}", read, planners.set_leader)

    async def _watch_keys(self, keys: ConsulKeys) -> None:
        def read(index: int) -> Awaitable[tuple[int, Any]]:
            return self._catalog.api_keys(index, self._wait_s)

        await self._forever(f"Consul KV {ROUTER_API_KEYS_KEY}", read, keys.set_document)

    async def _watch_planners(self, planners: PlannerCandidates) -> None:
        def read(index: int) -> Awaitable[tuple[int, Any]]:
            return self._catalog.planners(index, self._wait_s)

        await self._forever(f"Consul health of {PLANNER_SERVICE}", read, planners.set_instances)

    async def _forever(
        self,
        what: str,
        read: Read,
        apply: Apply,
        interval: Callable[[], float] = lambda: _MIN_READ_INTERVAL_S,
    ) -> None:
        """Run the watch forever. A watch that fails before any read worked backs off;
        one that read and then failed starts a fresh back-off (first retry at once)."""
        while True:
            worked = False

            def succeeded() -> None:
                nonlocal worked
                worked = True

            retrying = AsyncRetrying(
                retry=retry_if_exception_type(Exception),
                wait=wait_random_exponential(
                    multiplier=_BACKOFF_INITIAL_S, max=self._backoff_max_s
                ),
                before_sleep=lambda state: _log_failure(what, state),
            )
            async for attempt in retrying:
                with attempt:
                    try:
                        await _list_then_watch(read, apply, succeeded, interval)
                    except Exception as exc:
                        if not worked:
                            raise
                        _log_failure(what, None, exc)


def _log_failure(what: str, state: RetryCallState | None, exc: BaseException | None = None) -> None:
    """Catalog errors are expected weather; anything else is our bug."""
    if state is not None and state.outcome is not None:
        exc = state.outcome.exception()
    delay = state.next_action.sleep if state is not None and state.next_action else 0.0
    if isinstance(exc, CatalogError):
        # Consul down is one fact, not one per retry of every watch (a new user saw
        # about 7 warnings a second): attempts 1, 2, 4, 8 ... warn, the rest are debug.
        attempt = state.attempt_number if state is not None else 1
        level = logging.WARNING if attempt & (attempt - 1) == 0 else logging.DEBUG
        log.log(level, "%s: %s; retrying in %.1fs (attempt %d)", what, exc, delay, attempt)
    else:
        log.error("%s: watch failed (%r); retrying in %.1fs", what, exc, delay, exc_info=exc)


def _report_unexpected_end(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    log.error("watch task %s ended, which it never should: %r", task.get_name(), exc)
