"""Usage heartbeat: tells the planner, every interval, which models this router used.

The planner scales an on-demand model to 0 after its ``idle_after`` without
use; only the routers know what is used. The proxy sets ``entry.used`` on
every request for a defined model (one attribute write on the hot path; the
activator sets it too), and :class:`UsageReporter`, started and stopped by
the app's lifespan (:mod:`router.app`), every ``interval_s``:

- collects the models marked since the last report, plus those with a request
  in flight on any endpoint or waiting for a slot, so a stream longer than the
  interval (or than ``idle_after``) keeps counting without the proxy marking
  it again;
- clears the marks and sends one ``POST /v1/usage`` (:mod:`router.plannerapi`)
  if the list is not empty.

A failed report is logged (a warning when reports start failing, an info line
when they work again, not one warning per interval) and never raised; its
models are marked again so the next report carries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from router import errors
from router.endpoints import EndpointTable
from router.plannerapi import PlannerAPI

log = logging.getLogger(__name__)


class UsageReporter:
    """Periodic usage reports for one router's table."""

    def __init__(self, table: EndpointTable, api: PlannerAPI, interval_s: float) -> None:
        self.table = table
        self.api = api
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def collect(self) -> list[str]:
        """Names used since the last call (sorted), and clear their marks."""
        used = []
        for entry in self.table.entries():
            if entry.used or entry.slots.waiting or any(e.inflight for e in entry.endpoints):
                used.append(entry.name)
            entry.used = False
        return sorted(used)

    async def report(self) -> list[str]:
        """Send one report now; returns the models reported (empty: nothing sent or it failed)."""
        models = self.collect()
        if not models:
            return []
        try:
            await self.api.report_usage(models)
        except errors.PlannerUnavailable as exc:
            for name in models:
                entry = self.table.get(name)
                if entry is not None:
                    entry.used = True
            if not self._failing:
                log.warning("usage report failed (retrying every %g s): %s", self.interval_s, exc)
            self._failing = True
            return []
        if self._failing:
            log.info("usage reports reach the planner again")
        self._failing = False
        return models

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop the loop (nothing is sent on the way out: the next router's report,
        or this one's restart, marks the models again within one interval)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.report()
            except Exception:
                # Our bug, not the planner's: keep reporting.
                log.exception("usage report failed unexpectedly")
