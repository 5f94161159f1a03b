"""Idle scale-down: an on-demand model unused for `idle_after` goes back to 0.

Run by `planner serve` beside the watcher. `idle_models` is the pure decision
(records, current counts, states, now -> names to scale to 0); `IdleScaler`
polls it every `interval` seconds and acts. Polling, not events: "nothing
happened for 15 minutes" is not an event anybody sends, and a check every
few seconds costs one KV read and one job read per on-demand model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from planner.activation import GROUP
from planner.consul_client import ConsulClient
from planner.errors import PlannerError
from planner.nomad_client import NomadClient
from planner.state import ModelState, StateStore

log = logging.getLogger("planner.idle")


def idle_models(records: dict[str, dict[str, Any]], counts: dict[str, int],
                states: dict[str, ModelState], now: datetime) -> list[str]:
    """On-demand models running instances and unused for their `idle_after` (seconds).
    A model never used since it was scaled up counts from `now` on its next check,
    never as idle at once."""
    idle = []
    for name, record in sorted(records.items()):
        on_demand = record.get("on_demand")
        if not on_demand or counts.get(name, 0) == 0:
            continue
        state = states.get(name)
        if state is None or state.last_used_at is None:
            continue
        unused = now - datetime.fromisoformat(state.last_used_at)
        if unused >= timedelta(seconds=int(on_demand["idle_after"])):
            idle.append(name)
    return idle


class IdleScaler:
    def __init__(self, nomad: NomadClient, consul: ConsulClient, store: StateStore,
                 clock: Callable[[], datetime], interval: float = 5.0) -> None:
        self.nomad, self.consul, self.store = nomad, consul, store
        self.clock = clock
        self.interval = interval

    def check(self) -> list[str]:
        """Scale every idle on-demand model to 0; returns their names."""
        records = self.consul.model_records()
        counts = {}
        for name, record in records.items():
            if record.get("on_demand"):
                job = self.nomad.job(name)
                counts[name] = 0 if job is None or job.get("Stop") else \
                    sum(tg.get("Count", 0) for tg in job.get("TaskGroups") or [])
        states = {name: self.store.load(name) for name, count in counts.items() if count}
        idle = idle_models(records, counts, states, self.clock())
        for name in idle:
            self.nomad.scale(name, GROUP, 0, "llmgw: idle")
            log.info("model %s: scaled to 0 after %s s without requests", name,
                     records[name]["on_demand"]["idle_after"])
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
