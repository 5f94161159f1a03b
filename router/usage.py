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

Each report also carries this router's load (:class:`llmgw_contract.UsageReport`):
per model, the requests in flight on its endpoints and those waiting for a slot, and
what the replicas said they run and queue when that is more (every router's and any
other client's requests: read while the model is busy, :mod:`router.replicaload`),
with the router's id (unique per process) and its interval. The planner sums the
latest report of every router to scale a model on load (issue 22), and forgets a
router that stops reporting (no fresh router at all: no signal, the planner holds the
count). So while the table has a model with ``scaling`` a report goes out every
interval, used or not (a heartbeat: "no load" is a signal too); otherwise only
when a model was used or had load at the last report.

A failed report is logged (a warning when reports start failing, an info line
when they work again, not one warning per interval) and never raised; its
models are marked again so the next report carries them.

On the way out (:meth:`UsageReporter.stop`) a router that has reported sends a
goodbye: no models, no load, an interval of
``llmgw_contract.documents.USAGE_GOODBYE_INTERVAL_S``. The planner then forgets it
at once, rather than counting its last load for three intervals and then holding
scale-downs as for a router gone silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid

from llmgw_contract import ModelLoad, UsageReport
from llmgw_contract.documents import MAX_LOAD, USAGE_GOODBYE_INTERVAL_S
from router import errors
from router.endpoints import EndpointTable
from router.plannerapi import PlannerAPI

log = logging.getLogger(__name__)

# Shutdown must not wait on a planner that does not answer.
GOODBYE_TIMEOUT_S = 2.0


class UsageReporter:
    """Periodic usage reports for one router's table."""

    def __init__(self, table: EndpointTable, api: PlannerAPI, interval_s: float) -> None:
        self.table = table
        self.api = api
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        # Unique per process: two routers on one host, or a restarted one, are not one.
        self.router_id = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._loaded = False  # the last report carried load: the next one says it ended
        self._reported = False  # a report reached the planner: a goodbye is owed

    def collect(self) -> list[str]:
        """Names used since the last call (sorted), and clear their marks."""
        used = []
        for entry in self.table.entries():
            if entry.used or entry.slots.waiting or any(e.inflight for e in entry.endpoints):
                used.append(entry.name)
            entry.used = False
        return sorted(used)

    def load(self) -> dict[str, ModelLoad]:
        """Requests per model now (models with none left out): in flight on its
        endpoints, waiting for a slot, and what its replicas said they hold when they
        hold more than this router's (others' requests: `router.replicaload`)."""
        loads = {}
        for entry in self.table.entries():
            inflight = sum(e.inflight for e in entry.endpoints)
            waiting = entry.slots.waiting
            others = sum(e.others for e in entry.endpoints)
            if inflight or waiting or others:
                loads[entry.name] = ModelLoad(
                    inflight=inflight,
                    waiting=waiting,
                    replicas=min(inflight + others, MAX_LOAD) if others else 0,
                )
        return loads

    async def report(self) -> list[str]:
        """Send one report now; returns the models reported (empty: nothing sent or it failed)."""
        models = self.collect()
        load = self.load()
        scaling = any(
            entry.record is not None and entry.record.scaling is not None
            for entry in self.table.entries()
        )
        if not models and not load and not self._loaded and not scaling:
            return []
        report = UsageReport(
            models=models, router=self.router_id, interval_s=self.interval_s, load=load
        )
        try:
            await self.api.report_usage(models, report)
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
        self._loaded = bool(load)
        self._reported = True
        return models

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop the loop, then say goodbye (see the module docstring; once, at most
        `GOODBYE_TIMEOUT_S`, a failure only logged: the planner then forgets this
        router after three intervals)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self._reported:
            return
        self._reported = False
        goodbye = UsageReport(models=[], router=self.router_id, interval_s=USAGE_GOODBYE_INTERVAL_S)
        try:
            async with asyncio.timeout(GOODBYE_TIMEOUT_S):
                await self.api.report_usage([], goodbye)
        except (errors.PlannerUnavailable, TimeoutError) as exc:
            log.info("usage goodbye not delivered: %s", exc)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.report()
            except Exception:
                # Our bug, not the planner's: keep reporting.
                log.exception("usage report failed unexpectedly")
