"""Idle scale-down: an on-demand model unused for `idle_after` goes back to 0.

Run by the leading `planner serve` beside the watcher. `idle_models` is the
pure choice (records, current counts, last uses, now -> names to scale to
0); `IdleScaler` polls it every `interval` seconds and hands each model found
idle to its worker as `Event.IDLE` (`planner.daemon.workers`): the model's
transition decides the scale-down and the applier writes it, checked against
the job as it was read (EnforceIndex), so a scale-down decided before an
activation scaled the job up is refused and decided again. The pass asks, right
before deciding and again before writing, whether the model is still unused (an
activation records its use before asking its own worker), so a replica just asked
for is never scaled away. Polling, not
events: "nothing happened for 15 minutes" is not an event anybody sends, and
a check every few seconds costs one job read per active on-demand model (last
uses are in the leader's memory, `planner.daemon.usage`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from llmgw_contract import ModelRecord
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient, group_count
from planner.daemon.activation import PASS_WAIT, Submit, not_leading
from planner.daemon.applier import Stale
from planner.daemon.usage import UsageBook
from planner.daemon.workers import Skipped
from planner.errors import PlannerError
from planner.model.effects import Scale
from planner.model.transition import Event

log = logging.getLogger("planner.daemon.idle")


def still_idle(record: ModelRecord, last_used: datetime | None, now: datetime) -> bool:
    """Unused for its idle_after (a model never used is not idle: see idle_models)."""
    return (
        record.idle_after is not None
        and last_used is not None
        and now - last_used >= timedelta(seconds=record.idle_after)
    )


def idle_models(
    records: dict[str, ModelRecord],
    counts: dict[str, int],
    last_used: dict[str, datetime | None],
    now: datetime,
) -> list[str]:
    """On-demand models running instances and unused for their `idle_after` (seconds).
    A model with no recorded use is never idle: its use is recorded on activation, and
    a new leader counts every active model as used when it takes over."""
    idle = []
    for name, record in sorted(records.items()):
        if record.idle_after is None or counts.get(name, 0) == 0:
            continue
        if still_idle(record, last_used.get(name), now):
            idle.append(name)
    return idle


class IdleScaler:
    def __init__(
        self,
        nomad: NomadClient,
        consul: ConsulClient,
        usage: UsageBook,
        clock: Callable[[], datetime],
        interval: float = 5.0,
        assert_leading: Callable[[], None] = lambda: None,
        submit: Submit = not_leading,
    ) -> None:
        """`submit` hands an event to the model's worker (the leader's `Workers.submit`)."""
        self.nomad, self.consul, self.usage = nomad, consul, usage
        self.clock = clock
        self.interval = interval
        self.assert_leading = assert_leading  # raises NotLeader once deposed
        self.submit = submit

    def active(self) -> dict[str, int]:
        """Current counts of the on-demand models: {name: count}."""
        return {
            name: group_count(self.nomad.job(name))
            for name, record in self.consul.model_records().items()
            if record.idle_after is not None
        }

    def check(self) -> list[str]:
        """Hand every idle on-demand model to its worker (Event.IDLE); returns the names
        of those it scaled down."""
        records = self.consul.model_records()
        counts = self.active()
        last = {name: self.usage.last_used(name) for name, count in counts.items() if count}
        scaled = []
        for name in idle_models(records, counts, last, self.clock()):
            self.assert_leading()
            record = records[name]
            future = self.submit(
                name,
                Event.IDLE,
                lambda n=name, r=record: still_idle(r, self.usage.last_used(n), self.clock()),
            )
            try:
                outcome = future.result(PASS_WAIT)
            except Skipped:
                continue  # asked for meanwhile
            except (Stale, concurrent.futures.TimeoutError) as exc:
                log.warning(
                    "model %s: idle scale-down not decided: %s",
                    name,
                    exc or "no pass within the wait",
                )
                continue
            if any(isinstance(e, Scale) for e in outcome.plan.effects):
                scaled.append(name)
                log.info(
                    "model %s: scaled to 0 after %s s without requests", name, record.idle_after
                )
        return scaled

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.check)
            except PlannerError as exc:
                log.warning("idle check: %s", exc)
            except Exception:
                log.exception("idle check failed")
            await asyncio.sleep(self.interval)
