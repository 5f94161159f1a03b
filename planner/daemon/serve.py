"""`planner serve`: one planner process, leading or standing by.

Called by the CLI's `serve` command, which runs the admin app
(`planner.api.admin`) under uvicorn; the app's lifespan starts `PlannerNode.run`.
Every instance campaigns for leadership (`planner.daemon.leader`); the leader alone
runs the work that acts on Nomad and writes state:

  watcher      which models need a decision (`planner.daemon.watcher`), and their workers:
               observe, decide, apply (`planner.daemon`): start failures, parking,
               placement answers, rollbacks
  idle scaler  on-demand models back to 0, through their workers (`planner.daemon.idle`)
  activator    fresh placement attempts for the router, through their workers
               (`planner.daemon.activation`)
  usage book   when each model was last asked for (`planner.daemon.usage`)
  demand book  the routers' load per model, for load-based scaling (`planner.daemon.demand`)
  status book  every model's status, for /metrics (`planner.daemon.statusbook`)

Followers answer reads themselves and forward writes to the leader, at the
address its lock session's registration names (`planner.daemon.leader`,
`planner.api.admin`). When leadership changes hands, the new leader starts its
watcher with a reconcile from Nomad's list APIs, so nothing that happened in
between is lost, and state documents are only ever written with
check-and-set, so nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from datetime import datetime

import aiohttp

from llmgw_contract import StateDocument
from llmgw_contract.leadership import LeaderRoute
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.agents.state import StateStore
from planner.daemon.activation import Activator
from planner.daemon.demand import DemandBook
from planner.daemon.engine_install import NodeInstall, installs
from planner.daemon.idle import IdleScaler
from planner.daemon.leader import Leadership
from planner.daemon.metrics import PlannerMetrics
from planner.daemon.retry import answered
from planner.daemon.statusbook import StatusBook
from planner.daemon.usage import UsageBook
from planner.daemon.watcher import RECONCILE_EVERY_S, SCALE_EVERY_S, Watcher, utcnow
from planner.daemon.workers import Guard, Outcome
from planner.errors import NotLeader, PlannerError
from planner.model.failures import Rules
from planner.model.transition import Event

log = logging.getLogger("planner.daemon.serve")


class PlannerNode:
    """Leadership, and the work only the leader does, for one `planner serve`."""

    def __init__(
        self,
        nomad: NomadClient,
        consul: ConsulClient,
        address: str,
        rules: Rules | None = None,
        datacenters: tuple[str, ...] = ("*",),
        clock: Callable[[], datetime] = utcnow,
        idle_interval: float = 5.0,
        certificate_paths: Callable[[], Iterable[str | None]] = lambda: (),
        reconcile_every: float = RECONCILE_EVERY_S,
        scale_every: float = SCALE_EVERY_S,
    ) -> None:
        self.nomad, self.consul = nomad, consul
        self.reconcile_every = reconcile_every
        self.scale_every = scale_every
        self.rules = rules or Rules()
        self.datacenters = datacenters
        self.clock = clock
        self.leadership = Leadership(consul, address, self._on_change, on_retaken=self._repair)
        # The leader's writes: each checks, in its own transaction, that this instance
        # still holds the lock (a paused, deposed leader that resumes cannot write).
        self.store = StateStore(consul, fence=self.leadership.session)
        self.usage = UsageBook(consul, clock)
        self.demand = DemandBook(clock)
        self.book = StatusBook(nomad, consul, self.usage, clock)
        self.metrics = PlannerMetrics(
            self.book.rows, certificate_paths, self._engine_installs, self.demand.snapshot
        )
        self.activator = Activator(
            nomad,
            consul,
            self.store,
            self.usage,
            clock=clock,
            datacenters=datacenters,
            changed=self.book.mark,
            submit=self._submit,
            mark=self._mark,
        )
        self.idle = IdleScaler(
            nomad,
            consul,
            self.usage,
            clock,
            interval=idle_interval,
            assert_leading=self.store.assert_leading,
            submit=self._submit,
        )
        self.watcher: Watcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    def _submit(
        self, name: str, event: Event, guard: Guard | None = None
    ) -> concurrent.futures.Future[Outcome]:
        """Hand `event` to the model's worker (the leader's); NotLeader otherwise."""
        watcher = self.watcher
        if watcher is None:
            raise NotLeader("this planner does not lead: no worker decides for models here")
        return watcher.workers.submit(name, event, guard)

    def _mark(self, name: str) -> None:
        if self.watcher is not None:
            self.watcher.mark(name)

    def retry(self, name: str) -> tuple[StateDocument, str]:
        """Try model `name` again through its worker (`planner.daemon.retry`): the
        document written and what was done, in words. Blocks (run it in a thread).
        Raises NotLeader, Rejected (no job) or Unavailable."""
        return answered(self._submit(name, Event.RETRY), name)

    def _engine_installs(self) -> list[NodeInstall]:
        """Engines per node for the metrics: the leader's to publish, like the models'."""
        return installs(self.nomad, self.consul, self.datacenters) if self.is_leader else []

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    @property
    def ready(self) -> bool:
        """A leader that reconciled, or a follower that knows where the leader
        registered (a follower that refuses to forward is not ready)."""
        if self.is_leader:
            return self.watcher is not None and self.watcher.ready.is_set()
        return isinstance(self.leadership.route, LeaderRoute)

    async def run(self) -> None:
        """Campaign and, while leading, work; until cancelled."""
        async with aiohttp.ClientSession() as session:
            self._session = session
            try:
                await self.leadership.run()
            finally:
                await self._stop_work()

    async def stop(self) -> None:
        """Hand leadership over at once (clean shutdown)."""
        await self.leadership.resign()

    async def _on_change(self, leader: bool) -> None:
        self.metrics.leader.set(float(leader))
        self.metrics.leader_changes.inc()
        if leader:
            await self._start_work()
        else:
            await self._stop_work()

    async def _repair(self) -> None:
        """`llmgw/` was wiped under this leader: restore the records and state documents
        at once (`planner.daemon.repair`), not at the next 30 s repair, so the router
        refuses a parked model as parked again within a second, not after 404s."""
        watcher = self.watcher
        if watcher is None:
            return
        try:
            await asyncio.to_thread(watcher.repair)
        except PlannerError as exc:
            log.warning("restoring the records after a wiped llmgw/: %s", exc)

    async def _start_work(self) -> None:
        assert self._session is not None
        active = await asyncio.to_thread(self.idle.active)
        await asyncio.to_thread(self.usage.start_over, [n for n, c in active.items() if c])
        self.demand.clear()  # reports from before this term are another leader's
        self.watcher = Watcher(
            self.nomad,
            self.consul,
            self.rules,
            self.clock,
            self.datacenters,
            self.metrics,
            self.book.mark,
            fence=self.leadership.session,
            reconcile_every=self.reconcile_every,
            demand=self.demand,
            scale_every=self.scale_every,
        )
        self._tasks = [
            asyncio.create_task(self.watcher.run(self._session), name="watcher"),
            asyncio.create_task(self.idle.run(), name="idle-scaler"),
            asyncio.create_task(self.book.run(), name="status-book"),
        ]
        log.info("leading: watcher, idle scaler and status book started")

    async def _stop_work(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if tasks:
            log.info("no longer leading: watcher, idle scaler and status book stopped")
        self.watcher = None
        self.metrics.last_message.set(0)
