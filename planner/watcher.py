"""Follow Nomad and Consul and keep every model's failure/parking/placement state.

Run by `planner serve`. Two loops:

  events  reconcile from the list APIs (jobs' allocations and evaluations),
          then follow /v1/event/stream from that index + 1; on any error,
          wait (1 s doubling to 30 s, reset after a good session) and do it
          again. Nomad's event buffer is in memory and drops slow readers,
          so the reconcile on every (re)connect is what makes it lossless.
  health  a Consul blocking query on every passing check; an llmgw
          allocation seen passing is healthy for good (it resets the count).

Both feed the pure functions in `failures` and `placement`; this module only
loads state, calls them, acts (`actions.park`) and saves. State is re-read
from Consul KV before every change, so `planner retry` from a shell and this
daemon never overwrite each other's work with a stale copy.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp

from planner import actions
from planner.consul_client import ConsulClient
from planner.errors import PlannerError
from planner.events import stream_events
from planner.failures import PARK_AFTER, count_failure, decide_parking, mark_healthy, new_failures
from planner.nomad_client import NomadClient
from planner.placement import WarningLog, evaluation_reason, should_warn
from planner.state import ModelState, StateStore, Unplaceable
from planner.status import headline

log = logging.getLogger("planner.watcher")

# Nomad's Consul service IDs: _nomad-task-<alloc id>-<task or group-name>-<service>-<port>
_SERVICE_ID = re.compile(r"^_nomad-task-([0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})-")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Watcher:
    """Keeps ModelState current from Nomad's events and Consul's health."""

    def __init__(self, nomad: NomadClient, consul: ConsulClient, store: StateStore,
                 park_after: int = PARK_AFTER, clock: Callable[[], datetime] = utcnow) -> None:
        self.nomad, self.consul, self.store = nomad, consul, store
        self.park_after = park_after
        self.clock = clock
        self.index = 0
        self._records: dict[str, dict[str, Any]] = {}
        self._warned: dict[str, WarningLog] = {}
        self._lock = threading.Lock()  # one state change at a time, whichever loop
        self.ready = asyncio.Event()  # set after the first reconcile

    # --- the two loops ---------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(self._follow_events(session), self._follow_health())

    async def _follow_events(self, session: aiohttp.ClientSession) -> None:
        delay = 1.0
        while True:
            try:
                reconciled = await asyncio.to_thread(self.reconcile)
                self.ready.set()
                start = max(reconciled, self.index) + 1
                async for event in stream_events(session, self.nomad.address, start,
                                                 self.nomad.token):
                    await asyncio.to_thread(self.handle_event, event)
                    self.index = max(self.index, event.get("Index", 0))
                    delay = 1.0
            except PlannerError as exc:
                log.warning("event stream: %s; reconcile and reconnect in %.0f s", exc, delay)
            except Exception:
                # A bug in handling one event must not end the watch for good.
                log.exception("event handling failed; reconcile and reconnect in %.0f s", delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def _follow_health(self) -> None:
        index: int | None = None
        while True:
            try:
                new_index, checks = await asyncio.to_thread(self.consul.passing_checks, index)
                # Any change of index is news; one that goes backwards means Consul's
                # state was reset, so start over instead of waiting on a future index.
                index = new_index if index is None or new_index >= index else None
                await asyncio.to_thread(self.handle_passing, checks)
            except PlannerError as exc:
                log.warning("consul health watch: %s; retry in 2 s", exc)
                index = None
                await asyncio.sleep(2)
            except Exception:
                log.exception("consul health watch failed; retry in 2 s")
                index = None
                await asyncio.sleep(2)

    # --- reconcile and events ----------------------------------------------------

    def reconcile(self) -> int:
        """Replay what the list APIs show now; returns the Nomad index it read at."""
        index = self.nomad.current_index()
        self._records = self.consul.model_records()
        for name in sorted(self._records):
            if self.nomad.job(name) is None:
                continue
            for alloc in self.nomad.allocations(name):
                self.on_allocation(alloc)
            evaluations = [e for e in self.nomad.evaluations(name)
                           if e.get("Status") == "complete"]
            if evaluations:
                self.on_evaluation(max(evaluations, key=lambda e: e.get("ModifyIndex", 0)))
        return index

    def handle_event(self, event: dict[str, Any]) -> None:
        payload = event.get("Payload") or {}
        if event.get("Topic") == "Job":
            self._records = self.consul.model_records()
        elif event.get("Topic") == "Allocation" and "Allocation" in payload:
            self.on_allocation(payload["Allocation"])
        elif event.get("Topic") == "Evaluation" and "Evaluation" in payload:
            self.on_evaluation(payload["Evaluation"])

    def _record(self, name: str) -> dict[str, Any] | None:
        if name not in self._records:
            self._records = self.consul.model_records()
        return self._records.get(name)

    def on_allocation(self, alloc: dict[str, Any]) -> None:
        """Count new start failures, note a placement, park when it is time."""
        name = alloc.get("JobID", "")
        record = self._record(name)
        if record is None:
            return
        with self._lock:
            before = self.store.load(name)
            state = before
            for failure in new_failures(state, alloc):
                detail = self.nomad.task_stderr_tail(failure.alloc_id, failure.task)
                state = count_failure(state, failure, detail)
                log.warning("model %s: start failure %d in a row: %s", name,
                            state.consecutive_failures, headline(state.last_error))
            if state.unplaceable and alloc.get("ClientStatus") in ("pending", "running"):
                log.info("model %s: placed (was unplaceable: %s)", name, state.unplaceable.reason)
                state = state.model_copy(update={"unplaceable": None})
            state = decide_parking(state, record["definition_hash"], self.clock(),
                                   self.park_after)
            # Saved before the job stops, so nobody reads "stopped" in between.
            self.store.save(state)
            if state.parked is not None and before.parked is None:
                actions.park(self.nomad, name, state.parked)
                log.error("model %s: parked after %d consecutive start failures; last error: %s",
                          name, state.consecutive_failures, headline(state.last_error))

    def on_evaluation(self, evaluation: dict[str, Any]) -> None:
        """A completed evaluation says whether the model could be placed, and if not, why."""
        name = evaluation.get("JobID", "")
        if evaluation.get("Status") != "complete" or self._record(name) is None:
            return
        reason = evaluation_reason(evaluation)
        with self._lock:
            state = self.store.load(name)
            self.store.save(self._placement(name, state, reason, evaluation.get("ID")))

    def _placement(self, name: str, state: ModelState, reason: str | None,
                   eval_id: str | None) -> ModelState:
        now = self.clock()
        if reason is None:
            if state.unplaceable:
                log.info("model %s: placed (was unplaceable: %s)", name, state.unplaceable.reason)
            return state.model_copy(update={"unplaceable": None})
        if should_warn(self._warned.get(name, WarningLog()), reason, now):
            log.warning("model %s is unplaceable: %s", name, reason)
            self._warned[name] = WarningLog(reason, now)
        old = state.unplaceable
        since = old.since if old and old.reason == reason else now.isoformat(timespec="seconds")
        return state.model_copy(update={"unplaceable": Unplaceable(
            reason=reason, since=since, eval_id=eval_id)})

    # --- health ----------------------------------------------------------------------

    def handle_passing(self, checks: list[dict[str, Any]]) -> None:
        """Mark every llmgw allocation with a passing check healthy (resets its model's count)."""
        seen = set()
        for check in checks:
            service = check.get("ServiceName", "")
            match = _SERVICE_ID.match(check.get("ServiceID", ""))
            if service.startswith("llmgw-") and match:
                seen.add((service.removeprefix("llmgw-"), match.group(1)))
        now_ns = int(self.clock().timestamp() * 1e9)
        for name, alloc_id in sorted(seen):
            with self._lock:
                state = self.store.load(name)
                if alloc_id not in state.healthy_allocs:
                    log.info("model %s: allocation %s healthy", name, alloc_id[:8])
                    self.store.save(mark_healthy(state, alloc_id, now_ns))
