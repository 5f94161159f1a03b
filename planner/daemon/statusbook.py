"""The leader's current status of every defined model, kept fresh for `/metrics`.

Run by the leading `planner serve` (`planner.daemon.serve`). A scrape must not read
Nomad and Consul for every model (500 models would be 1,500 API calls), and a
parked model must show in Prometheus within a scrape of being parked, so the
book keeps one `Row` per defined model and refreshes a model as soon as the
watcher changes it (`mark`), plus every model every `FULL_REFRESH_S` as a
safety net (a change nothing announced: a job stopped by hand, say). It also
follows the model records' keys (a blocking query): a model applied or pruned
is marked at once, and one whose record is gone leaves the book, so its series
go too (a pruned job's last Nomad event can come before `apply` deletes its
record).

`wanted_replicas` is what the model should have now, the figure an alert
compares with what is ready (issue 8): an always-on model wants its
definition's replicas even while parked or stopped; an on-demand model wants
its replicas while someone asked for it within its `idle_after`, served or
not, and 0 when idle.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from llmgw_contract import KVPrefix, ModelRecord, ModelState, StateDocument, UsageRecord
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.agents.state import StateStore
from planner.agents.statusreads import observed
from planner.daemon.usage import UsageBook
from planner.errors import PlannerError
from planner.model.status import ModelStatus, observe
from planner.model.unplaceable import settled_shortfall

log = logging.getLogger("planner.daemon.statusbook")

FULL_REFRESH_S = 60.0


@dataclass(frozen=True)
class Row:
    """One model as /metrics publishes it."""

    status: ModelStatus
    wanted: int  # replicas it should have now
    # Nomad's answer left replicas unplaced and stands (settled, or a provisional
    # answer that followed a settled one: `Unplaceable.stands`), and the model does
    # not serve on what it has: a scaling model short of its scale-up serves (issue 22,
    # "never unplaceable for a model that serves"), and says so in `unplaced` alone.
    unplaceable: bool
    unplaced: int = 0  # replicas the job asks for that Nomad left unplaced


def wanted_replicas(
    record: ModelRecord, last_used: datetime | None, now: datetime, scaled: int | None = None
) -> int:
    """Replicas the model should have now (see the module docstring); a scaling model
    the count its job asks for (`scaled`: load-based scaling's), at least its floor."""
    if record.scaling is not None and scaled is not None:
        floor = record.replicas if record.scaling.min > 0 else 0
        if record.idle_after is None or scaled > 0:
            return min(max(scaled, floor), record.scaling.max)
    if record.idle_after is None:
        return record.replicas
    asked = last_used is not None and now - last_used < timedelta(seconds=record.idle_after)
    return record.replicas if asked else 0


def row(
    record: ModelRecord,
    status: ModelStatus,
    state: StateDocument,
    last_used: datetime | None,
    now: datetime,
) -> Row:
    short = settled_shortfall(state)
    if short is None or status.state == ModelState.PARKED:
        return Row(status, wanted_replicas(record, last_used, now, status.desired), False)
    serves = record.scaling is not None and status.state == ModelState.SERVING
    return Row(
        status,
        wanted_replicas(record, last_used, now, status.desired),
        not serves,
        max(short.desired - short.placed, 0),
    )


class StatusBook:
    """Rows of every defined model; refreshed on `mark(name)` and every FULL_REFRESH_S."""

    def __init__(
        self,
        nomad: NomadClient,
        consul: ConsulClient,
        usage: UsageBook,
        clock: Callable[[], datetime],
        full_every: float = FULL_REFRESH_S,
    ) -> None:
        self.nomad, self.consul, self.usage = nomad, consul, usage
        self.clock = clock
        self.full_every = full_every
        self.store = StateStore(consul)
        self._rows: dict[str, Row] = {}
        self._dirty: set[str] = set()
        self._lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def rows(self) -> list[Row]:
        """Every model's row, by name (a copy: scrapes never see a half-made list)."""
        with self._lock:
            return [self._rows[name] for name in sorted(self._rows)]

    def mark(self, name: str) -> None:
        """The model changed: refresh its row soon. Safe from any thread."""
        with self._lock:
            self._dirty.add(name)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self) -> None:
        """Refresh every row now, then marked rows as they come and all of them every
        `full_every` seconds; until cancelled (the book is emptied then)."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        records = asyncio.create_task(self._follow_records(), name="status-book-records")
        try:
            await self._refresh(None)
            while True:
                try:
                    async with asyncio.timeout(self.full_every):
                        await self._wake.wait()
                    self._wake.clear()
                    with self._lock:
                        names, self._dirty = self._dirty, set()
                    await self._refresh(names)
                except TimeoutError:
                    await self._refresh(None)
        finally:
            records.cancel()
            await asyncio.gather(records, return_exceptions=True)
            with self._lock:
                self._rows.clear()
            self._loop = self._wake = None

    async def _follow_records(self) -> None:
        """Mark every model whose record appears or goes (blocking query on the keys)."""
        index: int | None = None
        names: set[str] | None = None
        while True:
            try:
                new_index, now = await asyncio.to_thread(
                    self.consul.watch_names, KVPrefix.MODELS, index
                )
            except PlannerError as exc:
                log.warning("record watch: %s; again in 2 s", exc)
                index = None
                await asyncio.sleep(2)
                continue
            index = new_index if index is None or new_index >= index else None
            for name in now ^ names if names is not None else ():
                self.mark(name)
            names = now

    async def _refresh(self, names: set[str] | None) -> None:
        try:
            await asyncio.to_thread(self.refresh, names)
        except PlannerError as exc:
            log.warning("status refresh: %s", exc)
            if names:
                with self._lock:
                    self._dirty |= names

    def refresh(self, names: set[str] | None = None) -> None:
        """Recompute the rows of `names` (None: every model, dropping pruned ones)."""
        records = self.consul.model_records()
        now = self.clock()
        wanted = sorted(records) if names is None else sorted(n for n in names if n in records)
        fresh = {}
        for name in wanted:
            last_used = self.usage.last_used(name)
            state = self.store.load(name)
            usage = UsageRecord(last_used_at=last_used.isoformat()) if last_used else None
            status = observe(
                name, records[name], observed(self.nomad, self.consul, name), state, usage, now
            )
            fresh[name] = row(records[name], status, state, last_used, now)
        with self._lock:
            if names is None:
                self._rows = fresh
            else:
                self._rows.update(fresh)
                for gone in names - records.keys():
                    self._rows.pop(gone, None)
