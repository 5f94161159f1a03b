"""`planner status`: what each applied model should have, and what it has.

Called by the CLI. `observe` is pure (a model's record, its Nomad job and
allocations, its Consul health -> one ModelStatus); `gather` reads the
agents once per model and calls it.

States, as `planner status` and later the admin API show them:
  serving   every desired instance passes its Consul check
  loading   placed and starting; not all instances pass yet
  failing   not all pass, and the newest allocation's task failed
  idle      desired 0 on purpose (replicas: 0)
  stopped   the job is missing or stopped while the definition wants replicas
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from planner.consul_client import ConsulClient, ServiceHealth
from planner.nomad_client import Job, NomadClient

# Task events that end a start (Nomad's TaskEvent types, structs.go). "Not
# Restarting" is left out: it follows one of these and says less than it.
FAILURE_EVENTS = frozenset({"Driver Failure", "Failed Validation", "Setup Failure",
                            "Failed Artifact Download", "Terminated"})
SATISFIED = frozenset({"serving", "idle"})


@dataclass(frozen=True)
class ModelStatus:
    name: str
    state: str
    desired: int
    running: int
    passing: int
    reason: str
    last_error: str | None
    since: str | None

    @property
    def satisfied(self) -> bool:
        return self.state in SATISFIED

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nanos_to_iso(nanos: int) -> str:
    return datetime.fromtimestamp(nanos / 1e9, tz=UTC).isoformat(timespec="seconds")


def last_failure(allocations: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(message, time) of the newest failure event in the newest allocation that has one."""
    for alloc in sorted(allocations, key=lambda a: a.get("CreateIndex", 0), reverse=True):
        events = [e for state in (alloc.get("TaskStates") or {}).values()
                  for e in state.get("Events") or []]
        for event in sorted(events, key=lambda e: e.get("Time", 0), reverse=True):
            if event.get("Type") not in FAILURE_EVENTS:
                continue
            if event.get("Type") == "Terminated" and event.get("ExitCode", 0) == 0 and \
                    not event.get("Signal"):
                continue
            message = event.get("DisplayMessage") or event.get("Type")
            return f"{event['Type']}: {message}", _nanos_to_iso(event.get("Time", 0))
    return None


def observe(name: str, record: dict[str, Any], job: Job | None,
            allocations: list[dict[str, Any]], health: ServiceHealth) -> ModelStatus:
    """Pure: one model's state from what Nomad and Consul report."""
    running = sum(1 for a in allocations if a.get("ClientStatus") == "running")
    wanted = int(record.get("replicas", 0))
    if job is None or job.get("Stop"):
        reason = "job not registered" if job is None else "job stopped"
        state = "stopped" if wanted > 0 else "idle"
        return ModelStatus(name, state, 0, running, health.passing, reason, None, None)
    desired = sum(tg.get("Count", 0) for tg in job.get("TaskGroups") or [])
    failure = last_failure(allocations)
    if desired == 0:
        state, reason = "idle", "0 replicas wanted"
    elif health.passing >= desired:
        state, reason = "serving", f"{health.passing} of {desired} passing"
    elif failure is not None and _newest_failed(allocations):
        state, reason = "failing", f"{health.passing} of {desired} passing; last start failed"
    else:
        state, reason = "loading", f"{health.passing} of {desired} passing"
    last_error, since = failure if failure else (None, None)
    return ModelStatus(name, state, desired, running, health.passing, reason, last_error, since)


def _newest_failed(allocations: list[dict[str, Any]]) -> bool:
    if not allocations:
        return False
    newest = max(allocations, key=lambda a: a.get("CreateIndex", 0))
    states = (newest.get("TaskStates") or {}).values()
    return newest.get("ClientStatus") == "failed" or any(s.get("Failed") for s in states) or \
        any(s.get("Restarts", 0) > 0 and s.get("State") != "running" for s in states)


def gather(nomad: NomadClient, consul: ConsulClient) -> list[ModelStatus]:
    """Status of every applied model (the KV records), sorted by name."""
    statuses = []
    for name, record in sorted(consul.model_records().items()):
        job = nomad.job(name)
        allocations = nomad.allocations(name) if job is not None else []
        statuses.append(observe(name, record, job, allocations,
                                consul.service_health(f"llmgw-{name}")))
    return statuses
