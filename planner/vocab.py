"""Nomad's (and Consul's) words as the planner uses them, written once: the shapes of
their answers and the names the planner gives things (Nomad's api/jobs.go,
api/allocations.go, nomad/structs/structs.go; Consul's api/health.go). Every layer
may import this module; it imports nothing of the planner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A job as Nomad's API returns it (ID, Version, Stop, Meta, TaskGroups, JobModifyIndex,
# CreateIndex, SubmitTime, ...): kept as the JSON it is, not re-modelled.
Job = dict[str, Any]
Allocation = dict[str, Any]

# The task group of a model job (planner/jobspecs/model.nomad.hcl).
GROUP = "server"
# Deployment statuses during which Nomad refuses a scale (nomad/structs: running,
# pending, paused, and 1.6's initializing/blocked/unblocking are all "active").
ACTIVE_DEPLOYMENT = frozenset(
    {"running", "pending", "paused", "initializing", "blocked", "unblocking"}
)


def group_count(job: Job | None) -> int:
    """Replicas the job asks for now (0 for a missing or stopped job)."""
    if job is None or job.get("Stop"):
        return 0
    return sum(tg.get("Count", 0) for tg in job.get("TaskGroups") or [])


def with_count(job: Job, group: str, count: int) -> Job:
    """A copy of `job` whose task group `group` asks for `count` replicas (what Nomad's
    scale endpoint writes, for a register: api/jobs.go Scale)."""
    groups = [
        {**tg, "Count": count} if tg.get("Name") == group else tg
        for tg in job.get("TaskGroups") or []
    ]
    return {**job, "TaskGroups": groups}


@dataclass(frozen=True)
class ServiceHealth:
    """Instances of one Consul service: how many exist, how many pass every check, and
    the Nomad allocations of those that pass (/v1/health/service/:service)."""

    total: int
    passing: int
    passing_allocs: frozenset[str] = frozenset()
