"""`planner status`: what each applied model should have, and what it has.

Called by the CLI. `observe` is pure (a model's record, its Nomad job and
allocations, its Consul health -> one ModelStatus); `gather` reads the
agents once per model and calls it.

States, as `planner status`, `planner models` and the admin API show them:
  parked       stopped after too many start failures in a row (planner.state)
  unplaceable  Nomad can place it on no node; the reason is the scheduler's
  serving      every desired instance passes its Consul check
  failing      not all pass, and starts have been failing (count, last error)
  loading      placed and starting; not all instances pass yet
  idle         desired 0 on purpose (replicas: 0)
  stopped      the job is missing or stopped while the definition wants replicas
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from planner.consul_client import ConsulClient, ServiceHealth
from planner.failures import LOG_PREFIX
from planner.nomad_client import Job, NomadClient
from planner.state import ModelState, StateStore

# Task events that end a start (Nomad's TaskEvent types, structs.go). "Not
# Restarting" is left out: it follows one of these and says less than it.
FAILURE_EVENTS = frozenset({"Driver Failure", "Failed Validation", "Setup Failure",
                            "Failed Artifact Download", "Terminated"})
SATISFIED = frozenset({"serving", "idle"})


@dataclass(frozen=True)
class ModelStatus:
    """One row of `planner status`; `as_dict` is the admin API's and `--output json`'s shape."""

    name: str
    state: str
    desired: int
    running: int
    ready: int  # instances passing their Consul check
    consecutive_failures: int
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


def headline(last_error: str | None) -> str:
    """One line of a last error for a table and a log: the task event and the first
    stderr line kept with it (failures.stderr_summary puts the cause first)."""
    if not last_error:
        return ""
    first, *rest = last_error.splitlines()
    return f"{first} | {LOG_PREFIX.sub('', rest[0]).strip()}" if rest else first


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


def _on_demand_idle(row: dict[str, Any], record: dict[str, Any], state: ModelState,
                    now: datetime) -> ModelStatus:
    """Desired 0 satisfies an on-demand model only if nobody asked for it lately: asked
    for and placed nowhere is a model short of what it should have."""
    idle_after = int(record["on_demand"]["idle_after"])
    if state.last_used_at:
        asked = (now - datetime.fromisoformat(state.last_used_at)).total_seconds()
        if asked < idle_after:
            return ModelStatus(**row, state="loading", reason=f"asked for {asked:.0f} s ago; "
                               "no instance yet", last_error=state.last_error, since=None)
    return ModelStatus(**row, state="idle", reason=f"on demand: starts on request, stops "
                       f"{idle_after} s after the last one", last_error=None,
                       since=state.last_used_at)


def observe(name: str, record: dict[str, Any], job: Job | None,
            allocations: list[dict[str, Any]], health: ServiceHealth,
            state: ModelState | None = None, now: datetime | None = None) -> ModelStatus:
    """Pure: one model's state from what Nomad, Consul and the planner's own state say."""
    state = state or ModelState(name=name)
    running = sum(1 for a in allocations if a.get("ClientStatus") == "running")
    wanted = int(record.get("replicas", 0))
    desired = 0 if job is None or job.get("Stop") else \
        sum(tg.get("Count", 0) for tg in job.get("TaskGroups") or [])
    row = {"name": name, "desired": desired, "running": running, "ready": health.passing,
           "consecutive_failures": state.consecutive_failures}
    failure = last_failure(allocations)
    last_error, error_at = (state.last_error, state.last_error_at) if state.last_error \
        else failure or (None, None)
    if state.parked:
        return ModelStatus(**row, state="parked", reason=state.parked.reason,
                           last_error=state.parked.last_error, since=state.parked.since)
    if state.unplaceable and health.passing < max(desired, 1):
        return ModelStatus(**row, state="unplaceable", reason=state.unplaceable.reason,
                           last_error=last_error, since=state.unplaceable.since)
    if desired == 0 and record.get("on_demand"):
        return _on_demand_idle(row, record, state, now or datetime.now(UTC))
    if desired == 0:
        stopped = (job is None or bool(job.get("Stop"))) and wanted > 0
        reason = ("job not registered" if job is None else "job stopped") if stopped \
            else "0 replicas wanted"
        return ModelStatus(**row, state="stopped" if stopped else "idle", reason=reason,
                           last_error=None, since=None)
    ready = f"{health.passing} of {desired} ready"
    if health.passing >= desired:
        return ModelStatus(**row, state="serving", reason=ready, last_error=None, since=None)
    if state.consecutive_failures or (failure and _newest_failed(allocations)):
        count = state.consecutive_failures
        reason = f"{ready}; {count} consecutive start failures" if count \
            else f"{ready}; last start failed"
        return ModelStatus(**row, state="failing", reason=reason, last_error=last_error,
                           since=error_at)
    return ModelStatus(**row, state="loading", reason=ready, last_error=None, since=None)


def _newest_failed(allocations: list[dict[str, Any]]) -> bool:
    if not allocations:
        return False
    newest = max(allocations, key=lambda a: a.get("CreateIndex", 0))
    states = (newest.get("TaskStates") or {}).values()
    return newest.get("ClientStatus") == "failed" or any(s.get("Failed") for s in states) or \
        any(s.get("Restarts", 0) > 0 and s.get("State") != "running" for s in states)


def model_status(nomad: NomadClient, consul: ConsulClient, name: str,
                 record: dict[str, Any], state: ModelState | None) -> ModelStatus:
    job = nomad.job(name)
    allocations = nomad.allocations(name) if job is not None else []
    return observe(name, record, job, allocations, consul.service_health(f"llmgw-{name}"), state)


def gather(nomad: NomadClient, consul: ConsulClient) -> list[ModelStatus]:
    """Status of every applied model (the KV records), sorted by name."""
    states = StateStore(consul).load_all()
    return [model_status(nomad, consul, name, record, states.get(name))
            for name, record in sorted(consul.model_records().items())]
