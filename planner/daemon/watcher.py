"""Follow Nomad and Consul and say which models need a decision; the workers decide.

Run by the leading `planner serve` (`planner.daemon.serve`), as three loops that only
mark models (`planner.daemon.workers`): each marked model's worker observes it
(`planner.daemon.observe`, every read, no lock), decides
(`planner.model.transition.decide`, pure) and writes through the applier
(`planner.daemon.applier`, the only writer). No loop reads a model's job or
writes its state document itself.

  events     reconcile (every model marked, engines onto new nodes), then follow
             /v1/event/stream from the index after what the reconcile covered.
             Job, Allocation, Evaluation and Deployment events mark their JobID
             (when it is a model); Node events go to the engines' follower
             (`planner.daemon.engine_follow`), and so do Job events of engine jobs.
             Nomad's broker starts a stream at the closest index it still has,
             silently (`planner.agents.events.Cursor`): a stream that starts later than
             asked (a gap) or an index that went back (a reset: Nomad's state was
             rebuilt, every cache is dropped) makes a reconcile of every model. On
             any error: reconcile and reconnect with a back-off (tenacity).
  health     a Consul blocking query on every passing check: which allocations pass
             now and since when (`PassingBook`); a model whose set changed is marked.
  scaling    every SCALE_EVERY_S: models with `scaling` (Event.TICK: load-based
             scaling, `planner.model.autoscale`)
  tick       every second: models with a replica passing for the stability window
             that no TICK pass judged yet are marked (Event.TICK); every 30 s, records
             and parking lost from Consul (a wiped `llmgw/`) are restored from the
             jobs' meta (`planner.daemon.repair`) and models without a state document are
             marked (their worker seeds one); every `reconcile_every` seconds (5 min by
             default, `planner serve --reconcile-every`), a full reconcile: the
             backstop for any event lost some other way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential, wait_fixed

from llmgw_contract import (
    JobMeta,
    ReplicaRecord,
    StateDocument,
    alloc_from_service_id,
    model_from_service,
)
from planner.agents.consul import ConsulClient
from planner.agents.events import Cursor, Verdict
from planner.agents.nomad import RERUN_WITHIN_S, NomadClient
from planner.agents.state import StateStore
from planner.daemon import repair
from planner.daemon.applier import Applied, Applier
from planner.daemon.demand import DemandBook
from planner.daemon.engine_follow import EngineFollower
from planner.daemon.metrics import PlannerMetrics
from planner.daemon.observe import Observer, VersionCache, read_record
from planner.daemon.workers import Outcome, Workers
from planner.errors import PlannerError
from planner.model import transition
from planner.model.effects import Reason, Scale
from planner.model.failures import Rules, for_definition
from planner.model.observation import Observation
from planner.model.transition import Event, Plan
from planner.vocab import group_count

log = logging.getLogger("planner.daemon.watcher")

REPAIR_EVERY_S = 30.0
SCALE_EVERY_S = 2.0  # how often models with `scaling` are decided (a TICK pass each)
RECONCILE_EVERY_S = 300.0  # the backstop's period; `planner serve --reconcile-every`

Decide = Callable[[StateDocument, Observation, Event, Rules, datetime], Plan]


def utcnow() -> datetime:
    return datetime.now(UTC)


class PassingBook:
    """Which allocations pass their Consul check now, and since when (Unix ns); one
    entry per passing allocation. Thread-safe: the health loop writes it, workers and
    the tick read copies."""

    def __init__(self) -> None:
        self._since: dict[str, tuple[str, int]] = {}  # alloc -> (model, since ns)
        self._ticked: set[tuple[str, int]] = set()  # (alloc, since) marked stable-due
        self._lock = threading.Lock()

    def update(self, now: set[tuple[str, str]], at_ns: int) -> set[str]:
        """`now`: (model, alloc) passing now; returns the models whose set changed."""
        changed = set()
        with self._lock:
            current = {alloc for _, alloc in now}
            for alloc in set(self._since) - current:
                model, since = self._since.pop(alloc)
                self._ticked.discard((alloc, since))
                changed.add(model)
            for model, alloc in sorted(now):
                if alloc not in self._since:
                    self._since[alloc] = (model, at_ns)
                    changed.add(model)
                    log.info("model %s: allocation %s passes its health check", model, alloc[:8])
        return changed

    def of(self, model: str) -> dict[str, int]:
        """alloc -> since, for `model`'s allocations passing now."""
        with self._lock:
            return {a: since for a, (m, since) in self._since.items() if m == model}

    def due(self, now_ns: int, stable_after_ns: int) -> set[str]:
        """Models with a replica passing for `stable_after_ns` whose healthy run no TICK
        pass has judged yet (`settle`): asked again every tick until one has."""
        with self._lock:
            return {
                m
                for a, (m, s) in self._since.items()
                if now_ns - s >= stable_after_ns and (a, s) not in self._ticked
            }

    def settle(self, passing: Mapping[str, int], now_ns: int, stable_after_ns: int) -> None:
        """A TICK pass judged these healthy runs (alloc -> since, as it observed them)."""
        with self._lock:
            self._ticked |= {
                (a, s)
                for a, s in passing.items()
                if now_ns - s >= stable_after_ns and self._since.get(a, ("", -1))[1] == s
            }


class Watcher:
    """Maps Nomad's events and Consul's health to model names, for the workers."""

    def __init__(
        self,
        nomad: NomadClient,
        consul: ConsulClient,
        rules: Rules | None = None,
        clock: Callable[[], datetime] = utcnow,
        datacenters: tuple[str, ...] = ("*",),
        metrics: PlannerMetrics | None = None,
        changed: Callable[[str], None] = lambda name: None,
        fence: Callable[[], str | None] | None = None,
        reconcile_every: float = RECONCILE_EVERY_S,
        decide: Decide = transition.decide,
        demand: DemandBook | None = None,
        scale_every: float = SCALE_EVERY_S,
    ) -> None:
        """`fence` names the leader's session: every state write checks it still holds
        the lock (`planner.agents.state`), and every Nomad write checks first (the applier).
        `changed` is told each model a pass decided on (its status may have changed).
        `demand`: the routers' load (load-based scaling); every `scale_every` seconds
        the models with `scaling` get a TICK pass, which decides their count."""
        self.nomad, self.consul = nomad, consul
        self.store = StateStore(consul, absent=self._seed, fence=fence)
        self.rules = rules or Rules()
        self.datacenters = datacenters
        self.metrics = metrics
        self.changed = changed
        self.clock = clock
        self.reconcile_every = reconcile_every
        self._decide_fn = decide
        self.versions = VersionCache()
        self.scale_every = scale_every
        self.observer = Observer(
            nomad,
            consul,
            self.store,
            datacenters,
            self.versions,
            demand=demand.demand if demand is not None else None,
        )
        self.applier = Applier(nomad, self.store)
        self.workers = Workers(self._observe, self._decide, self._apply, done=self._done)
        self.passing = PassingBook()
        # Onto new nodes, from the engines' records (they outlive the install jobs).
        self.engines = EngineFollower(nomad, datacenters, self.applier, consul)
        self.index = 0  # the highest event index handled (or covered by a reconcile)
        self.reconnects = 0
        self.gaps = 0
        self.resets = 0
        self._models: set[str] = set()  # names of the models known (records or jobs)
        self._models_lock = threading.Lock()
        # Models whose placement answer was provisional, and when to look again
        # (monotonic s): the room may be made without any event of theirs, and a re-run
        # of a blocked evaluation that still cannot place leaves none (`_look_again`).
        self._recheck: dict[str, float] = {}
        self.ready = asyncio.Event()  # set after the first reconcile

    def now_ns(self) -> int:
        return int(self.clock().timestamp() * 1e9)

    # --- one model's pass (run by its worker) ---------------------------------------------

    def _observe(self, name: str) -> tuple[StateDocument, Observation]:
        return self.observer.observe(name, self.passing.of(name), self.clock())

    def _decide(self, document: StateDocument, observation: Observation, event: Event) -> Plan:
        return self._decide_fn(document, observation, event, self.rules, self.clock())

    def _apply(
        self, name: str, before: StateDocument, plan: Plan, observation: Observation
    ) -> Applied:
        if observation.state_index == 0 and observation.record is not None:
            # The document was missing and seeded (`_seed`): write it even when the plan
            # changes nothing, or the next pass would seed again, counting from later.
            before = StateDocument(name=name)
        return self.applier.apply(name, before, plan, observation)

    def _done(self, name: str, outcome: Outcome) -> None:
        observation = outcome.observation
        if outcome.event == Event.TICK:
            self.passing.settle(observation.passing, self.now_ns(), self.rules.stable_after_ns)
        for effect in outcome.plan.effects:
            if isinstance(effect, Scale) and effect.reason is Reason.LOAD and self.metrics:
                direction = "up" if effect.count > group_count(observation.job) else "down"
                self.metrics.scaling_decisions.labels(name, direction).inc()
        self._look_again(name, outcome.applied.state)
        if observation.record is None and observation.job is None:
            # Pruned: its record and job are gone; later events of the purged job are
            # not a model's (a worker's slot and its versions go with it).
            with self._models_lock:
                self._models.discard(name)
            self.versions.forget(name)
        self.changed(name)

    def _look_again(self, name: str, written: StateDocument) -> None:
        """Look at a model again `RERUN_WITHIN_S` after its document took a provisional
        placement answer: once the room being made ends and Nomad re-ran its blocked
        evaluation, the answer is settled (placed, or still short), and nothing else may
        tell this model. Judged by the document the pass wrote, not by what it observed:
        a TICK pass (stability windows, load-based scaling) observes the model but keeps
        the document's answer, and judged by its observation it called off the look
        that would have settled the answer (issue 22's fourth QA: a scale-up short of
        memory told "waiting for room" for minutes after the room ended)."""
        short = written.unplaceable
        with self._models_lock:
            if short is not None and short.provisional:
                # The first due time stands: passes every 2 s (TICKs) must not push it on.
                self._recheck.setdefault(name, time.monotonic() + RERUN_WITHIN_S)
            else:
                self._recheck.pop(name, None)

    def check_rechecks(self, now: float | None = None) -> None:
        """Mark the models whose provisional answer is due a second look at `now`
        (monotonic s; default: now)."""
        now = time.monotonic() if now is None else now
        with self._models_lock:
            due = [name for name, at in self._recheck.items() if at <= now]
            for name in due:
                del self._recheck[name]
        for name in due:
            self.mark(name)

    def _seed(self, state: StateDocument) -> StateDocument | None:
        """A model's document was missing (lost from KV; `apply` writes new models' own):
        start it with what this watcher knows now, the definition and the replicas that
        pass (since when, so a run already stable stays so). Failures before now are
        history Nomad still shows: they are not counted again (`counting_from_ns`).
        None (write nothing) for a model with no record: the events of a purged job
        outlive its record (found by a new user: an orphan document after a prune)."""
        record = read_record(self.consul, state.name)
        if record is None:
            return None
        log.warning(
            "model %s: its state document was missing; counting failures from now", state.name
        )
        state = for_definition(state, record.definition_hash)
        now = self.now_ns()
        replicas = tuple(
            ReplicaRecord(
                alloc_id=alloc_id,
                definition_hash=record.definition_hash,
                healthy_entries=(since,),
                stable_entry=since if now - since >= self.rules.stable_after_ns else 0,
            )
            for alloc_id, since in sorted(self.passing.of(state.name).items())
        )
        return state.model_copy(update={"replicas": replicas})

    # --- which models -------------------------------------------------------------------------

    def models(self) -> set[str]:
        with self._models_lock:
            return set(self._models)

    def _is_model(self, name: str) -> bool:
        with self._models_lock:
            return name in self._models

    def mark(self, name: str, event: Event = Event.OBSERVED) -> None:
        if self._is_model(name):
            self.workers.mark(name, event)

    # --- the loops -------------------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        try:
            await asyncio.gather(self._follow_events(session), self._follow_health(), self._tick())
        finally:
            self.workers.stop()

    async def _follow_events(self, session: aiohttp.ClientSession) -> None:
        """Reconcile, then follow the stream; reconnect at once after a session that
        delivered events, with a back-off (1 s doubling to 30 s) while none does."""
        while True:
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(Exception),
                wait=wait_exponential(multiplier=1, max=30),
                before_sleep=self._log_reconnect,
            )
            async for attempt in retrying:
                with attempt:
                    await self._session(session)

    async def _session(self, session: aiohttp.ClientSession) -> None:
        """One reconcile and stream; returns (a good session, the back-off starts over)
        when the stream fails after delivering events, raises when it delivered none."""
        covered = await asyncio.to_thread(self.reconcile)
        self.ready.set()
        cursor = Cursor(asked=max(covered, self.index) + 1)
        delivered = False
        seen = self.metrics.message_seen if self.metrics else None
        try:
            async for event in self.nomad.events(session, cursor.asked, on_message=seen):
                index = int(event.get("Index") or 0)
                first = cursor.first is None
                verdict = cursor.judge(index)
                if first:
                    log.info(
                        "event stream: asked for index %d, first event at %d (%s)",
                        cursor.asked,
                        index,
                        verdict,
                    )
                if verdict == Verdict.CHECK:
                    verdict = await asyncio.to_thread(self._check_reset, index)
                if verdict == Verdict.SEEN:
                    continue
                if verdict == Verdict.GAP:
                    await asyncio.to_thread(
                        self._lost,
                        "gap",
                        f"the stream started at index {index}, not at {cursor.asked}",
                    )
                await self.handle_event(event)
                self.index = max(self.index, index)
                delivered = True
        except PlannerError as exc:
            if not delivered:
                raise
            self._count_reconnect()
            log.warning("event stream: %s; reconcile and reconnect", exc)

    def _check_reset(self, index: int) -> Verdict:
        """An index lower than expected: Nomad was reset when its own index is now below
        the highest this watcher saw (then everything is read again), else the event is
        one the reconcile covered."""
        latest = self.nomad.latest_index()
        if latest >= self.index:
            return Verdict.SEEN
        self._reset(latest, f"event index {index}")
        return Verdict.NEW

    def _reset(self, latest: int, seen: str) -> None:
        self.resets += 1
        if self.metrics is not None:
            self.metrics.losses.labels("reset").inc()
        log.warning(
            "Nomad's index went back (%s; Nomad is at %d, this watcher saw %d): "
            "its state was rebuilt; dropping every cache and reading every model "
            "again",
            seen,
            latest,
            self.index,
        )
        self.index = latest
        self.versions.clear()
        self.reconcile_models()

    def _lost(self, kind: str, why: str) -> None:
        """Events may have been lost: count it and reconcile every model."""
        self.gaps += 1
        if self.metrics is not None:
            self.metrics.losses.labels(kind).inc()
        log.warning(
            "event stream: %s (Nomad's event buffer had dropped events in "
            "between); reconciling every model",
            why,
        )
        self.reconcile_models()

    def _count_reconnect(self) -> None:
        self.reconnects += 1
        if self.metrics is not None:
            self.metrics.reconnects.inc()

    def _log_reconnect(self, retry_state: Any) -> None:
        self._count_reconnect()
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        delay = retry_state.next_action.sleep if retry_state.next_action else 0
        if isinstance(exc, PlannerError):
            log.warning("event stream: %s; reconcile and reconnect in %.0f s", exc, delay)
        else:
            # A bug in handling one event must not end the watch for good.
            log.error(
                "event handling failed (%r); reconcile and reconnect in %.0f s",
                exc,
                delay,
                exc_info=exc,
            )

    async def _follow_health(self) -> None:
        """Follow the passing checks; on any failure, start over from a full read 2 s later."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Exception),
            wait=wait_fixed(2),
            before_sleep=self._log_health_retry,
        )
        async for attempt in retrying:
            with attempt:
                index: int | None = None
                while True:
                    new_index, checks = await asyncio.to_thread(self.consul.passing_checks, index)
                    # Any change of index is news; one that goes backwards means Consul's
                    # state was reset, so start over instead of waiting on a future index.
                    index = new_index if index is None or new_index >= index else None
                    self.handle_passing(checks)

    @staticmethod
    def _log_health_retry(retry_state: Any) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, PlannerError):
            log.warning("consul health watch: %s; again in 2 s", exc)
        else:
            log.error("consul health watch failed (%r); again in 2 s", exc, exc_info=exc)

    async def _tick(self) -> None:
        last_repair = last_reconcile = last_scale = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            try:
                self.check_stable()
                self.check_rechecks()
                if time.monotonic() - last_scale >= self.scale_every:
                    last_scale = time.monotonic()
                    await asyncio.to_thread(self.check_scaling)
                if time.monotonic() - last_reconcile >= self.reconcile_every:
                    last_reconcile = last_repair = time.monotonic()
                    await asyncio.to_thread(self.reconcile)
                elif time.monotonic() - last_repair >= REPAIR_EVERY_S:
                    last_repair = time.monotonic()
                    await asyncio.to_thread(self.repair)
            except PlannerError as exc:
                log.warning("tick: %s", exc)
            except Exception:
                log.exception("tick failed")

    # --- what Nomad says -----------------------------------------------------------------

    def reconcile(self) -> int:
        """Mark every model (each worker reads it whole) and follow engines onto nodes;
        returns the Nomad index every later event is newer than (`latest_index`, read
        first). An index below the one this watcher saw is a reset (`_reset`)."""
        started = time.monotonic()
        latest = self.nomad.latest_index()
        if latest < self.index:
            self._reset(latest, "at a reconcile")
        else:
            self.reconcile_models()
        self.engines.reconcile()
        if self.metrics is not None:
            self.metrics.reconcile.observe(time.monotonic() - started)
        return latest

    def reconcile_models(self) -> None:
        """Restore a wiped `llmgw/`, bring routing documents in step with their state
        (as `repair` does: a reconcile due resets the repair's timer), learn every model
        (records, and model jobs), drop the caches of models gone, and mark every model."""
        repair.restore(self.nomad, self.consul, self.store)
        self.store.sync_routing()
        names = set(self.consul.model_records())
        names |= {
            j.get("ID", "") for j in self.nomad.jobs() if JobMeta.MODEL in (j.get("Meta") or {})
        }
        with self._models_lock:
            gone = self._models - names
            self._models = names | (self._models & gone)  # the gone ones: one last pass
        self.versions.keep_only(names)
        self.workers.mark_all(names | gone)

    async def handle_event(self, event: dict[str, Any]) -> None:
        """Mark the model the event is about; engines' events go to their follower."""
        topic, payload = event.get("Topic"), event.get("Payload") or {}
        if topic == "Node" and "Node" in payload:
            await asyncio.to_thread(self.engines.on_node, payload["Node"])
            return
        if topic == "Job" and "Job" in payload:
            job = payload["Job"]
            if JobMeta.MODEL not in (job.get("Meta") or {}):
                await asyncio.to_thread(self.engines.on_job, job)
                return
            with self._models_lock:
                self._models.add(job.get("ID", ""))
            self.mark(job.get("ID", ""))
            return
        if topic in ("Allocation", "Evaluation", "Deployment") and topic in payload:
            self.mark(payload[topic].get("JobID", ""))

    def repair(self) -> None:
        """Restore what a wiped `llmgw/` lost (`planner.daemon.repair`), mark the models
        whose state document is gone (their worker seeds one from what Nomad shows,
        with no old failure counted twice), and bring routing documents in step with
        their state (`StateStore.sync_routing`: after an upgrade, an edit, a snapshot)."""
        repair.restore(self.nomad, self.consul, self.store)
        documents = self.store.sync_routing()
        for name in sorted(self.consul.model_records()):
            with self._models_lock:
                self._models.add(name)
            if name not in documents:
                self.workers.mark(name)

    # --- what Consul says ------------------------------------------------------------------

    def handle_passing(self, checks: list[dict[str, Any]]) -> None:
        """Note which model allocations pass now; mark the models whose set changed."""
        now = set()
        for check in checks:
            model = model_from_service(check.get("ServiceName", ""))
            alloc_id = alloc_from_service_id(check.get("ServiceID", ""))
            if model and alloc_id:
                now.add((model, alloc_id))
        for name in self.passing.update(now, self.now_ns()):
            self.mark(name)

    def check_scaling(self) -> None:
        """Give every model with load-based scaling a TICK pass (its worker observes,
        `planner.model.autoscale` decides; a pass already pending covers it)."""
        for name, record in sorted(self.consul.model_records().items()):
            if record.scaling is not None:
                self.mark(name, Event.TICK)

    def check_stable(self) -> None:
        """Mark the models with a replica passing for the whole stability window."""
        for name in self.passing.due(self.now_ns(), self.rules.stable_after_ns):
            self.mark(name, Event.TICK)
