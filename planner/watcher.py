"""Follow Nomad and Consul and keep every model's failure, parking and placement state.

Run by the leading `planner serve` (`planner.leader`), as three loops:

  events     reconcile from the list APIs (jobs, their allocations and latest
             evaluation), then follow /v1/event/stream from that index + 1; on
             any error, reconcile and reconnect with a back-off (tenacity). Nomad's
             event buffer is in memory and drops slow readers, so the reconcile on
             every (re)connect is what makes it lossless.
             Node events (and each reconcile) get engines installed on nodes that
             became schedulable after their install job ran (`planner.engines.follow`).
  health     a Consul blocking query on every passing check: which allocations
             pass now, and since when (a healthy run starts when one enters).
  tick       every second: runs that stayed healthy for the stability window
             reset their counts; every 30 s, KV records and parking lost from
             Consul (a wiped `llmgw/`) are restored from the jobs' meta.

All three feed the pure functions of `failures` and `placement`, change state
documents only through `StateStore.update` (check-and-set), and act through
`actions` (park). The model's current definition is the one its KV record
names; allocations of another definition never count.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential, wait_fixed

from llmgw_contract import (
    JobMeta,
    KVPrefix,
    ModelRecord,
    ReplicaRecord,
    StateDocument,
    alloc_from_service_id,
    kv_key,
    model_from_service,
)
from planner import actions, engines, repair, rollout
from planner import unplaceable as unplaced
from planner.consul_client import ConsulClient
from planner.engines import Engine
from planner.engines.follow import EngineFollower
from planner.errors import NomadRejected, PlannerError
from planner.events import stream_events
from planner.failures import (
    AllocInfo,
    Rules,
    decide_parking,
    due_stable,
    for_definition,
    headline,
    judge,
    new_failures,
    passing,
    stabilize,
    track,
)
from planner.jobspec import ENGINE_KIND_META
from planner.metrics import PlannerMetrics
from planner.nomad_client import Job, NomadClient, group_count
from planner.placement import WarningLog, should_warn
from planner.rollout import for_applied
from planner.state import StateStore

log = logging.getLogger("planner.watcher")

REPAIR_EVERY_S = 30.0


def utcnow() -> datetime:
    return datetime.now(UTC)


class Watcher:
    """Keeps state documents current from Nomad's events and Consul's health."""

    def __init__(self, nomad: NomadClient, consul: ConsulClient,
                 rules: Rules | None = None, clock: Callable[[], datetime] = utcnow,
                 datacenters: tuple[str, ...] = ("*",),
                 metrics: PlannerMetrics | None = None,
                 changed: Callable[[str], None] = lambda name: None,
                 fence: Callable[[], str | None] | None = None) -> None:
        """`fence` names the leader's session: every state write checks it still holds
        the lock (`planner.state`), and Nomad actions check first."""
        self.nomad, self.consul = nomad, consul
        self.store = StateStore(consul, absent=self._seed, fence=fence)
        self.rules = rules or Rules()
        self.datacenters = datacenters
        self.metrics = metrics
        self.changed = changed  # told the name of every model whose state may have changed
        self.clock = clock
        self.index = 0
        self.reconnects = 0
        self._records: dict[str, ModelRecord] = {}
        self._jobs: dict[str, Job] = {}
        self._definitions: dict[tuple[str, int], str] = {}  # (job, version) -> definition hash
        self._alloc_versions: dict[tuple[str, int], int] = {}  # (alloc, AllocModifyIndex) -> ver
        self._passing_since: dict[str, tuple[str, int]] = {}  # alloc -> (model, since ns)
        self._stabilized: set[tuple[str, int]] = set()
        self._warned: dict[str, WarningLog] = {}
        self.engines = EngineFollower(nomad, datacenters)  # engines onto new nodes
        self._lock = threading.Lock()  # one state change at a time, whichever loop
        self.ready = asyncio.Event()  # set after the first reconcile

    def _seed(self, state: StateDocument) -> StateDocument | None:
        """A model's document was missing (lost from KV; `apply` writes new models' own):
        start it with what this watcher knows now, the definition and the replicas that
        pass (since when, so a run already stable stays so). Failures before now are
        history Nomad still shows: they are not counted again (`counting_from_ns`).
        None (write nothing) for a model pruned meanwhile: the events of its purged job
        outlive its record (found by a new user: an orphan document after a prune)."""
        record = self._records.get(state.name)
        if record is None:
            return state
        if self.consul.get_indexed(kv_key(KVPrefix.MODELS, state.name))[1] is None:
            self._records.pop(state.name, None)
            return None
        log.warning("model %s: its state document was missing; counting failures from now",
                    state.name)
        state = for_definition(state, record.definition_hash)
        now = self.now_ns()
        def stable(alloc_id: str, since: int) -> bool:
            return (alloc_id, since) in self._stabilized or \
                now - since >= self.rules.stable_after_ns

        replicas = tuple(
            ReplicaRecord(alloc_id=alloc_id, definition_hash=record.definition_hash,
                          healthy_entries=(since,),
                          stable_entry=since if stable(alloc_id, since) else 0)
            for alloc_id, (model, since) in sorted(self._passing_since.items())
            if model == state.name)
        return state.model_copy(update={"replicas": replicas})

    def now_ns(self) -> int:
        return int(self.clock().timestamp() * 1e9)

    # --- the loops -------------------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(self._follow_events(session), self._follow_health(), self._tick())

    async def _follow_events(self, session: aiohttp.ClientSession) -> None:
        """Reconcile, then follow the stream; reconnect at once after a session that
        delivered events, with a back-off (1 s doubling to 30 s) while none does."""
        while True:
            retrying = AsyncRetrying(retry=retry_if_exception_type(Exception),
                                     wait=wait_exponential(multiplier=1, max=30),
                                     before_sleep=self._log_reconnect)
            async for attempt in retrying:
                with attempt:
                    await self._session(session)

    async def _session(self, session: aiohttp.ClientSession) -> None:
        """One reconcile and stream; returns (a good session, the back-off starts over)
        when the stream fails after delivering events, raises when it delivered none."""
        reconciled = await asyncio.to_thread(self.reconcile)
        self.ready.set()
        start = max(reconciled, self.index) + 1
        delivered = False
        seen = self.metrics.message_seen if self.metrics else None
        try:
            async for event in stream_events(session, self.nomad.address, start,
                                             self.nomad.token, on_message=seen,
                                             ssl=self.nomad.ssl_context):
                await asyncio.to_thread(self.handle_event, event)
                self.index = max(self.index, event.get("Index", 0))
                delivered = True
        except PlannerError as exc:
            if not delivered:
                raise
            self._count_reconnect()
            log.warning("event stream: %s; reconcile and reconnect", exc)

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
            log.error("event handling failed (%r); reconcile and reconnect in %.0f s", exc,
                      delay, exc_info=exc)

    async def _follow_health(self) -> None:
        """Follow the passing checks; on any failure, start over from a full read 2 s later."""
        retrying = AsyncRetrying(retry=retry_if_exception_type(Exception), wait=wait_fixed(2),
                                 before_sleep=self._log_health_retry)
        async for attempt in retrying:
            with attempt:
                index: int | None = None
                while True:
                    new_index, checks = await asyncio.to_thread(self.consul.passing_checks,
                                                                index)
                    # Any change of index is news; one that goes backwards means Consul's
                    # state was reset, so start over instead of waiting on a future index.
                    index = new_index if index is None or new_index >= index else None
                    await asyncio.to_thread(self.handle_passing, checks)

    @staticmethod
    def _log_health_retry(retry_state: Any) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, PlannerError):
            log.warning("consul health watch: %s; again in 2 s", exc)
        else:
            log.error("consul health watch failed (%r); again in 2 s", exc, exc_info=exc)

    async def _tick(self) -> None:
        last_repair = 0.0
        while True:
            await asyncio.sleep(1.0)
            try:
                await asyncio.to_thread(self.check_stable)
                if time.monotonic() - last_repair >= REPAIR_EVERY_S:
                    await asyncio.to_thread(self.repair)
                    last_repair = time.monotonic()
            except PlannerError as exc:
                log.warning("stability check: %s", exc)
            except Exception:
                log.exception("stability check failed")

    # --- what Nomad says -----------------------------------------------------------------

    def reconcile(self) -> int:
        """Replay what the list APIs show now; returns the Nomad index it read at."""
        started = time.monotonic()
        index = self._reconcile()
        if self.metrics is not None:
            self.metrics.reconcile.observe(time.monotonic() - started)
        return index

    def _reconcile(self) -> int:
        index = self.nomad.current_index()
        repair.restore(self.nomad, self.consul, self.store)
        self._records = self.consul.model_records()
        for name in sorted(self._records):
            self._replay(name)
        self.engines.reconcile()
        return index

    def _replay(self, name: str) -> None:
        """Feed the model's job, allocations and latest evaluation through the handlers."""
        job = self.nomad.job(name)
        if job is None:
            return
        self.on_job(job)
        for alloc in self.nomad.allocations(name):
            self.on_allocation(alloc)
        evaluations = [e for e in self.nomad.evaluations(name)
                       if e.get("Status") == "complete"]
        if evaluations:
            self.on_evaluation(max(evaluations, key=lambda e: e.get("ModifyIndex", 0)))
        self._check_rollback(name)

    def _revert_if_stuck(self, name: str, job: dict[str, Any]) -> None:
        """Do what auto_revert could not: roll a failed update back to the version whose
        replicas serve (Nomad reverts only to a stable version, and an update applied
        before the previous deployment completed leaves none)."""
        if job.get("Stop"):
            return
        passing = frozenset(a for a, (m, _) in self._passing_since.items() if m == name)
        version = rollout.stuck_update(job, self.nomad.deployments(name),
                                       self.nomad.allocations(name), passing)
        if version is None:
            return
        self.store.assert_leading()
        try:
            self.nomad.revert(name, version, int(job.get("Version") or 0))
        except NomadRejected as exc:  # the job changed meanwhile: the next event decides
            log.warning("model %s: could not roll the failed update back: %s", name, exc)
            return
        log.warning("model %s: its update failed and Nomad had no stable version to roll "
                    "back to; reverted to version %d, which serves", name, version)

    def on_deployment(self, deployment: dict[str, Any]) -> None:
        """A deployment that changed may end a rolled-back update (`planner.rollout`)."""
        self._check_rollback(deployment.get("JobID", ""))

    def _check_rollback(self, name: str) -> None:
        """Record an update of `name` that Nomad rolled back: the model serves on the
        definition it runs, with `update_failed` saying which one failed and why."""
        record = self._record(name)
        job = self.nomad.job(name)
        if record is None or job is None:
            return  # purged meanwhile (its deployments' events outlive it)
        try:
            versions = self.nomad.versions(name)
        except NomadRejected:
            return  # purged between the two reads
        failed = rollout.rolled_back(versions, self.nomad.deployments(name),
                                     record.definition_hash)
        if failed is None:
            self._revert_if_stuck(name, job)
            return
        running = rollout.definition_of(job)
        # Count what the failed version's replicas did first: Nomad may fail the
        # deployment before the event with the last failed start reaches this watcher
        # (found by test: rolled back at 4 of 5), and afterwards they are not judged.
        for alloc in self.nomad.allocations(name):
            self.on_allocation(alloc)
        with self._lock:
            updated = self.store.update(name, lambda s: rollout.record_rollback(
                s, failed, running, self.clock()))
        if updated.changed:
            log.error("model %s: update to definition %s rolled back (%s); it serves on %s; "
                      "last error: %s", name, failed.definition_hash[:12], failed.reason,
                      running[:12], headline(updated.before.last_error))
            self.changed(name)

    def handle_event(self, event: dict[str, Any]) -> None:
        payload = event.get("Payload") or {}
        if event.get("Topic") == "Job" and "Job" in payload:
            self.on_job(payload["Job"])
        elif event.get("Topic") == "Allocation" and "Allocation" in payload:
            self.on_allocation(payload["Allocation"])
        elif event.get("Topic") == "Evaluation" and "Evaluation" in payload:
            self.on_evaluation(payload["Evaluation"])
        elif event.get("Topic") == "Deployment" and "Deployment" in payload:
            self.on_deployment(payload["Deployment"])
        elif event.get("Topic") == "Node" and "Node" in payload:
            self.engines.on_node(payload["Node"])

    def _record(self, name: str) -> ModelRecord | None:
        """The model's record; read again only for a job llmgw manages whose record is not
        known yet (allocations of other jobs cost nothing)."""
        if name not in self._records and name in self._jobs:
            self._records = self.consul.model_records()
        return self._records.get(name)

    def on_job(self, job: Job) -> None:
        """Remember the job (count, versions) and keep the KV copy of its parking current."""
        name = job.get("ID", "")
        if JobMeta.MODEL not in (job.get("Meta") or {}):
            self.engines.on_job(job)
            return
        self._jobs[name] = job
        known = self._records.get(name)
        if known is None or known.definition_hash != job["Meta"].get(JobMeta.DEFINITION_HASH):
            self._records = self.consul.model_records()  # `apply` writes records before jobs
        self._definitions[(name, int(job.get("Version", 0)))] = \
            job["Meta"].get(JobMeta.DEFINITION_HASH, "")
        if self._record(name) is not None:
            with self._lock:
                actions.sync_parking(self.store, name, job)
            self.changed(name)

    def _definition(self, name: str, version: int) -> str:
        """The definition hash of a job version (versions never change; cached)."""
        key = (name, version)
        if key not in self._definitions:
            for job in self.nomad.versions(name):
                self._definitions[(name, int(job.get("Version", 0)))] = \
                    (job.get("Meta") or {}).get(JobMeta.DEFINITION_HASH, "")
        return self._definitions.get(key, "")

    def _version(self, alloc: dict[str, Any]) -> int:
        """The job version an allocation runs. List stubs carry `JobVersion`; the event
        stream's allocations do not (Nomad strips their Job to keep events small,
        nomad/state/events.go), so the allocation is read once per scheduler change of
        it (`AllocModifyIndex`: an in-place update moves it to a new version)."""
        if "JobVersion" in alloc:
            return int(alloc["JobVersion"])
        key = (alloc["ID"], int(alloc.get("AllocModifyIndex", 0)))
        if key not in self._alloc_versions:
            full = self.nomad.allocation(alloc["ID"]) or {}
            self._alloc_versions[key] = int((full.get("Job") or {}).get("Version", -1))
        return self._alloc_versions[key]

    def _info(self, alloc: dict[str, Any]) -> AllocInfo:
        name = alloc.get("JobID", "")
        return AllocInfo(alloc_id=alloc["ID"], name=alloc.get("Name", ""),
                         node=alloc.get("NodeName") or alloc.get("NodeID", "")[:8],
                         definition_hash=self._definition(name, self._version(alloc)),
                         client_status=alloc.get("ClientStatus", ""),
                         desired_status=alloc.get("DesiredStatus", ""),
                         replaced=bool(alloc.get("NextAllocation")))

    def _engine(self, name: str) -> Engine:
        """The model's engine kind (its job's meta names one other than llama.cpp)."""
        meta = (self._jobs.get(name) or {}).get("Meta") or {}
        return engines.KINDS.get(meta.get(ENGINE_KIND_META) or "", engines.engine(
            engines.DEFAULT_KIND))

    def on_allocation(self, alloc: dict[str, Any]) -> None:
        """Track the replica, count its new failures, park when it is time."""
        name = alloc.get("JobID", "")
        record = self._record(name)
        if record is None:
            return
        info = self._info(alloc)
        applied = record.definition_hash
        seen = for_applied(self.store.load(name), applied)
        current = seen.definition_hash
        # I/O before the check-and-set: its change function may run more than once.
        tails = {f.key: self.nomad.task_stderr_tail(f.alloc_id, f.task)
                 for f in new_failures(seen, alloc)} if info.definition_hash == current else {}
        placed = seen.unplaceable is not None and self._all_running(name, alloc)
        log.debug("model %s: allocation %s (%s, definition %s; current %s)", name,
                  info.alloc_id[:8], info.client_status, info.definition_hash, current)

        def change(state: StateDocument) -> StateDocument:
            state = for_applied(state, applied)
            state = track(state, info)
            for failure in new_failures(state, alloc):
                if failure.key in tails:
                    state = judge(state, failure, tails[failure.key], self.rules,
                                  self._engine(name).error_lines)
            if placed:
                state = state.model_copy(update={"unplaceable": None})
            return state

        with self._lock:
            updated = self.store.update(name, change)
            self.changed(name)
            after = updated.after
            if after.consecutive_failures > updated.before.consecutive_failures:
                replica = after.replica(info.alloc_id)
                log.warning("model %s: replica %s on %s: start failure %d in a row (model: %d): "
                            "%s", name, replica.index if replica else info.name, info.node,
                            replica.consecutive_failures if replica else 0,
                            after.consecutive_failures, headline(after.last_error))
                self._maybe_park(name, after)
            elif info.stopped and info.definition_hash == after.definition_hash:
                self._maybe_park(name, after)
            if updated.before.unplaceable and after.unplaceable is None:
                log.info("model %s: placed (was unplaceable: %s)", name,
                         updated.before.unplaceable.reason)
        if info.desired_status != "run" and info.client_status in ("complete", "failed", "lost"):
            self._alloc_versions = {k: v for k, v in self._alloc_versions.items()
                                    if k[0] != info.alloc_id}

    def _all_running(self, name: str, alloc: dict[str, Any]) -> bool:
        """Every replica the job wants runs (the allocation just seen included)."""
        desired = group_count(self._jobs.get(name))
        if desired == 0 or alloc.get("ClientStatus") != "running":
            return False
        running = {a["ID"] for a in self.nomad.allocations(name)
                   if a.get("ClientStatus") == "running" and a.get("DesiredStatus") == "run"}
        return len(running | {alloc["ID"]}) >= desired

    def _maybe_park(self, name: str, state: StateDocument) -> None:
        if state.parked is not None or state.consecutive_failures == 0:
            return
        job = self.nomad.job(name)
        if job is None or job.get("Stop"):
            # Stopped by an operator (or already parked): it wants no replica, and a
            # failed one Nomad keeps at desired "run" must not read as "every replica
            # stopped" (found by test: `nomad job stop` of a model parked it).
            return
        allocs = {a["ID"]: self._info(a) for a in self.nomad.allocations(name)}
        passing_now = frozenset(a for a, (m, _) in self._passing_since.items() if m == name)
        decided = decide_parking(state, allocs, passing_now, self.clock(), self.rules)
        if decided.parked is None:
            if state.consecutive_failures >= self.rules.park_after:
                log.warning("model %s: %d consecutive start failures, not parked: a healthy "
                            "replica serves (degraded)", name, state.consecutive_failures)
            return
        if not actions.park(self.nomad, self.store, name, decided.parked):
            return
        log.error("model %s: parked (%s); last error: %s", name, decided.parked.reason,
                  headline(state.last_error))

    def on_evaluation(self, evaluation: dict[str, Any]) -> None:
        """A completed evaluation says whether every replica could be placed, and if not,
        why. While allocations are stopping somewhere (room being made), a shortfall
        is provisional: Nomad's blocked evaluation runs again when they end."""
        name = evaluation.get("JobID", "")
        record = self._record(name)
        if evaluation.get("Status") != "complete" or record is None:
            return
        now = self.clock()
        job = self._jobs.get(name) or self.nomad.job(name)
        unplaceable = unplaced.answer(self.nomad, record, job, evaluation, self.datacenters, now)
        if unplaceable and not unplaceable.provisional and \
                should_warn(self._warned.get(name, WarningLog()), unplaceable.reason, now):
            log.warning("model %s is unplaceable: %s", name, unplaceable.reason)
            self._warned[name] = WarningLog(unplaceable.reason, now)
        with self._lock:
            updated = self.store.update(name, lambda s: unplaced.with_unplaceable(s, unplaceable))
        self.changed(name)
        if updated.before.unplaceable and unplaceable is None:
            log.info("model %s: placed (was unplaceable: %s)", name,
                     updated.before.unplaceable.reason)

    # --- what Consul says ------------------------------------------------------------------

    def handle_passing(self, checks: list[dict[str, Any]]) -> None:
        """Note which model allocations pass now; one that starts passing begins a healthy run."""
        now = set()
        for check in checks:
            model = model_from_service(check.get("ServiceName", ""))
            alloc_id = alloc_from_service_id(check.get("ServiceID", ""))
            if model and alloc_id:
                now.add((model, alloc_id))
        for alloc_id in set(self._passing_since) - {a for _, a in now}:
            self.changed(self._passing_since.pop(alloc_id)[0])
            self._stabilized = {(a, t) for a, t in self._stabilized if a != alloc_id}
        at = self.now_ns()
        for model, alloc_id in sorted(now):
            if alloc_id not in self._passing_since:
                self._passing_since[alloc_id] = (model, at)
                self._entered(model, alloc_id, at)

    def _entered(self, name: str, alloc_id: str, at: int) -> None:
        record = self._record(name)
        if record is None:
            return
        alloc = self.nomad.allocation(alloc_id)
        if alloc is None:
            return
        info = self._info(alloc)
        applied = record.definition_hash
        log.info("model %s: replica %s on %s passes its health check", name,
                 info.name.partition(".")[2] or alloc_id[:8], info.node)
        with self._lock:
            self.store.update(name, lambda s: passing(track(for_applied(s, applied), info),
                                                      alloc_id, at))
        self.changed(name)

    def check_stable(self) -> None:
        """Reset the counts of replicas that passed for the whole stability window."""
        now = self.now_ns()
        by_model: dict[str, dict[str, int]] = {}
        for alloc_id, (model, since) in self._passing_since.items():
            if now - since >= self.rules.stable_after_ns and \
                    (alloc_id, since) not in self._stabilized:
                by_model.setdefault(model, {})[alloc_id] = since
        for name, since in by_model.items():
            with self._lock:
                state = self.store.load(name)
                due = due_stable(state, since, now, self.rules)
                if due:
                    def change(s: StateDocument, due: list[tuple[str, int]] = due) -> StateDocument:
                        for alloc_id, entry in due:
                            s = stabilize(s, alloc_id, entry)
                        return s
                    updated = self.store.update(name, change)
                    self.changed(name)
                    if updated.before.consecutive_failures:
                        log.info("model %s: healthy for %d s; consecutive failures reset",
                                 name, self.rules.stable_after_ns // 10**9)
            self._stabilized.update((a, s) for a, s in since.items())

    def repair(self) -> None:
        """Restore what a wiped `llmgw/` lost (`planner.repair`; check-and-set writes, so
        no lock is held for its reads of every job)."""
        repair.restore(self.nomad, self.consul, self.store)
        documents = self.consul.get_texts(KVPrefix.STATE)
        self._records = self.consul.model_records()
        for name in sorted(self._records):
            if kv_key(KVPrefix.STATE, name) not in documents:
                # Lost with the rest of `llmgw/`: replaying what Nomad shows now writes
                # it again, seeded (`_seed`), with no old failure counted twice.
                self._replay(name)
