"""Nomad's words as the planner uses them, written once: the shapes of its answers and
the names it gives things (api/jobs.go, api/allocations.go, nomad/structs/structs.go).
Every layer may import this module; it imports nothing of the planner."""

from __future__ import annotations

from typing import Any

# A job as Nomad's API returns it (ID, Version, Stop, Meta, TaskGroups, JobModifyIndex,
# CreateIndex, SubmitTime, ...): kept as the JSON it is, not re-modelled.
Job = dict[str, Any]
Allocation = dict[str, Any]

# The task group of a model job (planner/jobspecs/model.nomad.hcl).
GROUP = "server"


def group_count(job: Job | None) -> int:
    """Replicas the job asks for now (0 for a missing or stopped job)."""
    if job is None or job.get("Stop"):
        return 0
    return sum(tg.get("Count", 0) for tg in job.get("TaskGroups") or [])
