"""Idle scale-down: an on-demand model unused for `idle_after` goes back to 0.

Run by the leading `planner serve` beside the watcher. `idle_models` is the
pure decision (records, current counts, last uses, now -> names to scale to
0); `IdleScaler` polls it every `interval` seconds and acts. Polling, not
events: "nothing happened for 15 minutes" is not an event anybody sends, and
a check every few seconds costs one job read per active on-demand model (last
uses are in the leader's memory, `planner.usage`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from llmgw_contract import ModelRecord
from planner.activation import GROUP
from planner.consul_client import ConsulClient
from planner.errors import PlannerError
from planner.nomad_client import NomadClient, group_count
from planner.usage import UsageBook

log = logging.getLogger("planner.idle")


def idle_models(records: dict[str, ModelRecord], counts: dict[str, int],
                last_used: dict[str, datetime | None], now: datetime) -> list[str]:
    """On-demand models running instances and unused for their `idle_after` (seconds).
    A model with no recorded use is never idle: its use is recorded on activation, and
    a new leader counts every active model as used when it takes over."""
    idle = []
    for name, record in sorted(records.items()):
        if record.idle_after is None or counts.get(name, 0) == 0:
            continue
        used = last_used.get(name)
        if used is not None and now - used >= timedelta(seconds=record.idle_after):
            idle.append(name)
    return idle


class IdleScaler:
    def __init__(self, nomad: NomadClient, consul: ConsulClient, usage: UsageBook,
                 clock: Callable[[], datetime], interval: float = 5.0,
                 assert_leading: Callable[[], None] = lambda: None) -> None:
        self.nomad, self.consul, self.usage = nomad, consul, usage
        self.clock = clock
        self.interval = interval
        self.assert_leading = assert_leading  # raises NotLeader once deposed

    def active(self) -> dict[str, int]:
        """Current counts of the on-demand models: {name: count}."""
        return {name: group_count(self.nomad.job(name))
                for name, record in self.consul.model_records().items()
                if record.idle_after is not None}

    def check(self) -> list[str]:
        """Scale every idle on-demand model to 0; returns their names."""
        records = self.consul.model_records()
        counts = self.active()
        last = {name: self.usage.last_used(name) for name, count in counts.items() if count}
        idle = idle_models(records, counts, last, self.clock())
        for name in idle:
            self.assert_leading()
            self.nomad.scale(name, GROUP, 0, "llmgw: idle")
            log.info("model %s: scaled to 0 after %s s without requests", name,
                     records[name].idle_after)
        return idle

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.check)
            except PlannerError as exc:
                log.warning("idle check: %s", exc)
            except Exception:
                log.exception("idle check failed")
            await asyncio.sleep(self.interval)
