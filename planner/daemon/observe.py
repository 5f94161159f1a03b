"""observe: every read of one model, before anything is decided, with no lock held.

Called by the model's worker (`planner.daemon.workers`) before each decision
(`planner.model.transition.decide`), and again whenever the applier answers
`Stale`. The order matters: the state document is read FIRST, so its
ModifyIndex (`Observation.state_index`, the check-and-set of the plan's
write) is older than every Nomad read; a writer that changed the document
after the Nomad reads were made is refused by that check, and the model is
observed again.

Reads, in order (Nomad 1.6's HTTP API):

  KV   llmgw/state/<name> (StateStore.read), llmgw/models/<name> (the record)
  Nomad  current index; /v1/job/<name>; /v1/job/<name>/versions (only when a
         version is not cached); /v1/job/<name>/allocations (stubs: JobVersion,
         TaskStates); /v1/job/<name>/deployments; /v1/job/<name>/evaluations (the
         latest complete one, and its placement answer: `planner.model.unplaceable`);
         the stderr tail of each start failure the document has not counted yet
         (`NomadClient.task_stderr_tail`: once counted, never read again; none for a
         document not stored yet, which takes Nomad's failures as history);
         /v1/allocation/<id> of each failed allocation a forced reschedule would
         place again whose version Nomad no longer keeps (its own job's definition,
         `own_definitions`; at most `resurrect.MAX_OWN_READS`).

Job versions never change, so they are cached per job incarnation (its
CreateIndex: a purged job created again starts its versions over) and read
again only when the job, an allocation or a deployment names a version not
cached; the cache keeps only the versions Nomad listed last time, and forgets a
job once Nomad has none (`VersionCache`): one entry per model at most.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from llmgw_contract import KVPrefix, ModelRecord, StateDocument, decode, kv_key
from planner.agents.consul import ConsulClient
from planner.agents.nomad import Job, NomadClient
from planner.agents.state import StateStore
from planner.daemon import placement_answer as unplaced
from planner.errors import NomadRejected
from planner.model.autoscale import Demand
from planner.model.failures import start_failures
from planner.model.observation import Observation
from planner.model.resurrect import unknown_failed
from planner.model.rollout import definition_of
from planner.model.unplaceable import waited_for

log = logging.getLogger("planner.observe")

COMPLETE = "complete"  # an evaluation the scheduler finished (structs.EvalStatusComplete)


@dataclass
class _Versions:
    create_index: int
    by_version: dict[int, Job] = field(default_factory=dict)

    def covers(self, wanted: set[int]) -> bool:
        """Every wanted version is cached, or older than the oldest Nomad still kept
        (versions only grow: one pruned never comes back)."""
        oldest = min(self.by_version, default=0)
        return {v for v in wanted if v >= oldest} <= set(self.by_version)


class VersionCache:
    """Job versions per model, for the job incarnation seen last (thread-safe: workers of
    different models share it). Bounded: one entry per model that has a job, holding
    only the versions Nomad listed at the last read (it keeps 6 by default,
    JobTrackedVersions in nomad/structs/structs.go)."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Versions] = {}
        self._lock = threading.Lock()
        self.reads = 0  # /versions calls made, for tests

    def versions(self, nomad: NomadClient, job: Job, wanted: set[int]) -> tuple[Job, ...]:
        """Every version of `job` Nomad keeps, newest first; read from Nomad only when
        one of `wanted` (the job's own version among them) is not cached."""
        name, created = job["ID"], int(job.get("CreateIndex") or 0)
        with self._lock:
            known = self._jobs.get(name)
            if known is not None and known.create_index == created and known.covers(wanted):
                return _newest_first(known.by_version)
        try:
            listed = nomad.versions(name)
        except NomadRejected:
            listed = []  # purged between the job's read and this one
        self.reads += 1
        mine = {
            int(v.get("Version") or 0): v
            for v in listed
            if int(v.get("CreateIndex") or 0) == created
        }
        mine.setdefault(int(job.get("Version") or 0), job)
        with self._lock:
            self._jobs[name] = _Versions(created, mine)
        return _newest_first(mine)

    def forget(self, name: str) -> None:
        """The job is gone (purged): drop its versions."""
        with self._lock:
            self._jobs.pop(name, None)

    def keep_only(self, names: set[str]) -> None:
        with self._lock:
            for name in set(self._jobs) - names:
                del self._jobs[name]

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v.by_version) for v in self._jobs.values())


def _newest_first(by_version: Mapping[int, Job]) -> tuple[Job, ...]:
    return tuple(by_version[v] for v in sorted(by_version, reverse=True))


def read_record(consul: ConsulClient, name: str) -> ModelRecord | None:
    """The model's record (llmgw/models/<name>), None when there is none or it does not
    decode (logged)."""
    _, text = consul.get_indexed(kv_key(KVPrefix.MODELS, name))
    if not text:
        return None
    try:
        return decode(ModelRecord, text)
    except ValueError as exc:
        log.error("model %s: unreadable record: %s", name, exc)
        return None


def latest_evaluation(evaluations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The complete evaluation the scheduler finished last (highest ModifyIndex)."""
    done = [e for e in evaluations if e.get("Status") == COMPLETE]
    return max(done, key=lambda e: int(e.get("ModifyIndex") or 0), default=None)


def _stderr_tails(
    nomad: NomadClient,
    document: StateDocument,
    definitions: set[str],
    allocations: list[dict[str, Any]],
    definition_of_alloc: Callable[[dict[str, Any]], str],
) -> dict[str, str]:
    """The stderr tail of every start failure not counted yet, for allocations of the
    definitions the document may judge by (key: `StartFailure.key`). By key alone, never
    by this machine's clock against the node's (issue 19, "Clocks")."""
    tails = {}
    counted = set(document.counted)
    for alloc in allocations:
        if definition_of_alloc(alloc) not in definitions:
            continue
        for failure in start_failures(alloc):
            if failure.key not in counted:
                tails[failure.key] = nomad.task_stderr_tail(failure.alloc_id, failure.task)
    return tails


def own_definitions(
    nomad: NomadClient, versions: Iterable[Job], allocations: Iterable[dict[str, Any]]
) -> dict[str, str]:
    """alloc id -> the definition hash of the allocation's own job (GET
    /v1/allocation/:id, its Job's Meta), for the failed allocations of a version Nomad
    no longer keeps (`planner.model.resurrect.unknown_failed`, bounded); one Nomad no
    longer has is left out (it is not placed again either)."""
    found = {}
    for alloc_id in unknown_failed(versions, allocations):
        full = nomad.allocation(alloc_id)
        if full is not None and full.get("Job"):
            found[alloc_id] = definition_of(full["Job"])
    return found


class Observer:
    """Reads one model at a time (any number of threads at once, one per model)."""

    def __init__(
        self,
        nomad: NomadClient,
        consul: ConsulClient,
        store: StateStore,
        datacenters: tuple[str, ...] = ("*",),
        versions: VersionCache | None = None,
        demand: Callable[[str, float, float], Demand] | None = None,
    ) -> None:
        """`demand(name, window_s, hold_s)`: the routers' load of a scaling model (the leader's
        `DemandBook.demand`); None: no load is read (`Observation.demand` None)."""
        self.nomad, self.consul, self.store = nomad, consul, store
        self.datacenters = datacenters
        self.versions = versions or VersionCache()
        self.demand = demand

    def observe(
        self, name: str, passing: Mapping[str, int], now: datetime
    ) -> tuple[StateDocument, Observation]:
        """(the document as stored, everything read of model `name`). `passing`: alloc
        id -> since (Unix ns) of this model's allocations passing their Consul check now
        (the watcher's health loop). Raises the clients' PlannerErrors (the worker
        logs them and waits for the next event)."""
        state_index, document = self.store.read(name)
        record = read_record(self.consul, name)
        nomad_index = self.nomad.current_index()
        job = self.nomad.job(name)
        if job is None:
            self.versions.forget(name)
            return document, Observation(
                name=name,
                record=record,
                job=None,
                passing=dict(passing),
                state_index=state_index,
                nomad_index=nomad_index,
            )
        allocations = self.nomad.allocations(name)
        deployments = self.nomad.deployments(name)
        wanted = {int(job.get("Version") or 0)}
        wanted |= {int(a["JobVersion"]) for a in allocations if "JobVersion" in a}
        wanted |= {
            int(d["JobVersion"])
            for d in deployments
            if d.get("JobCreateIndex") == job.get("CreateIndex") and "JobVersion" in d
        }
        versions = self.versions.versions(self.nomad, job, wanted)
        by_version = {int(v.get("Version") or 0): definition_of(v) for v in versions}
        evaluation = latest_evaluation(self.nomad.evaluations(name))
        placement = (
            unplaced.answer(
                self.nomad, record, job, evaluation, self.datacenters, now, waited_for(document)
            )
            if evaluation is not None and record
            else None
        )
        definitions = {document.definition_hash, record.definition_hash if record else ""}
        definitions.discard("")
        # A document not stored yet takes what Nomad shows as history (counted without
        # reading it: `planner.model.fold`), so nothing of it is read.
        own = own_definitions(self.nomad, versions, allocations)
        stderr = (
            _stderr_tails(
                self.nomad,
                document,
                definitions,
                allocations,
                lambda a: by_version.get(int(a.get("JobVersion", -1)), own.get(a["ID"], "")),
            )
            if state_index
            else {}
        )
        mine = {a["ID"] for a in allocations}
        scaling = record.scaling if record else None
        demand = (
            self.demand(name, scaling.window, scaling.down_after)
            if scaling is not None and self.demand is not None
            else None
        )
        return document, Observation(
            name=name,
            record=record,
            job=job,
            versions=versions,
            allocations=tuple(allocations),
            deployments=tuple(deployments),
            evaluation=evaluation,
            placement=placement,
            passing={a: s for a, s in passing.items() if a in mine},
            stderr=stderr,
            own_definitions=own,
            demand=demand,
            state_index=state_index,
            nomad_index=nomad_index,
        )


def observe(
    observer: Observer, name: str, passing: Mapping[str, int], now: datetime
) -> tuple[StateDocument, Observation]:
    """`Observer.observe` as a function (the worker's default reader)."""
    return observer.observe(name, passing, now)
