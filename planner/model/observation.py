"""What the planner read of one model before deciding: one value, no I/O here.

Built by `planner.daemon.observe` (all reads, no lock held), consumed by
`planner.model.transition.decide`. Shapes are Nomad 1.6's API (api/jobs.go,
api/allocations.go): `job` is the full job (ID, Version, Stop, Meta,
JobModifyIndex, CreateIndex, SubmitTime, TaskGroups), `allocations` the
job's allocation stubs (ID, Name, NodeName, JobVersion, ClientStatus,
DesiredStatus, NextAllocation, CreateIndex, ModifyIndex, TaskStates with
their events).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw_contract import ModelRecord, Unplaceable
from planner.model.autoscale import Demand
from planner.vocab import Allocation, Job


@dataclass(frozen=True)
class Observation:
    name: str
    record: ModelRecord | None  # what `apply` recorded (git's definition); None: pruned
    job: Job | None  # None: Nomad has no such job
    versions: tuple[Job, ...] = ()  # every stored version, newest first
    allocations: tuple[Allocation, ...] = ()
    deployments: tuple[dict[str, Any], ...] = ()
    evaluation: dict[str, Any] | None = None  # the latest complete evaluation
    # Nomad's placement answer for `evaluation` (read by the daemon: it reads nodes,
    # `planner.daemon.placement_answer`): None when it placed everything or when there is
    # no evaluation.
    placement: Unplaceable | None = None
    passing: Mapping[str, int] = field(default_factory=dict)  # alloc id -> since (ns)
    stderr: Mapping[str, str] = field(default_factory=dict)  # failure key -> stderr tail
    # alloc id -> the definition hash in the Meta of the allocation's own job, read only
    # for a failed allocation of a version Nomad no longer keeps
    # (`planner.model.resurrect.unknown_failed`).
    own_definitions: Mapping[str, str] = field(default_factory=dict)
    # The routers' load for a model with `record.scaling` (`planner.daemon.demand`);
    # None: not a scaling model, or no book (a command, not the leader).
    demand: Demand | None = None
    state_index: int = 0  # Consul ModifyIndex of the document read (0: it has none)
    nomad_index: int = 0  # Nomad's index when the reads began

    @property
    def job_index(self) -> int:
        """The JobModifyIndex every job write of a plan is checked against (0: no job)."""
        return int((self.job or {}).get("JobModifyIndex") or 0)

    @property
    def job_version(self) -> int:
        return int((self.job or {}).get("Version") or 0)
