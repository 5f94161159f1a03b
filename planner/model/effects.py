"""Effects: the Nomad writes a plan asks for, as values.

A plan (`planner.model.transition.Plan`) holds at most one write of the job
(`Park`, `Unpark`, `Register`, `Deregister`, `Revert`, `Scale`) optionally
followed by an `Evaluate`. The applier (`planner.daemon.applier`) carries
them out against the job as it was read when the plan was decided: every
job write is index-checked (EnforceIndex on register and scale,
EnforcePriorVersion on revert), so a plan decided on an answer that is no
longer true does nothing and is decided again.

Each effect carries a `Reason` (a code, for metrics and tests) and `words`
(for logs, `planner status` and the router's refusal), as Nomad's
scheduler/status pairs a status with a description.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llmgw_contract import Parked
from planner.vocab import Job


class Reason(StrEnum):
    """Why an effect is asked for."""

    START_FAILURES = "start_failures"  # park: the count reached park_after
    ALL_STOPPED = "all_stopped"  # park: Nomad stopped every replica after its restarts
    UPDATE_STUCK = "update_stuck"  # revert: a failed update with no stable version
    RETRY = "retry"  # `planner retry` / the admin API's retry
    ACTIVATION = "activation"  # a request for a model with no passing replica
    IDLE = "idle"  # an on-demand model unused for its idle_after
    LOAD = "load"  # load-based scaling: demand asked for more or fewer replicas
    APPLY = "apply"  # `planner apply`: the definition in git
    PRUNE = "prune"  # `planner apply --prune`: a model no longer in git
    ENGINE = "engine"  # an engine install job (or a node that joined after it ran)


@dataclass(frozen=True)
class Effect:
    reason: Reason
    words: str


@dataclass(frozen=True)
class Park(Effect):
    """Stop the job, keeping it, with `parked` in its meta (`JobMeta.PARKED_*`)."""

    parked: Parked


@dataclass(frozen=True)
class Unpark(Effect):
    """Start the stopped (or parked) job again, without the parking meta; `renew`: as a
    new version that replaces every allocation (`planner.model.resurrect.renewed`)."""

    renew: bool = False


@dataclass(frozen=True)
class Register(Effect):
    """Register `job` (create: the job must not exist; update: still as read)."""

    job: Job


@dataclass(frozen=True)
class Deregister(Effect):
    purge: bool = False


@dataclass(frozen=True)
class Revert(Effect):
    """Register job version `version` again; only while the job is at `prior_version`."""

    version: int
    prior_version: int


@dataclass(frozen=True)
class Scale(Effect):
    group: str
    count: int


@dataclass(frozen=True)
class Evaluate(Effect):
    """A new evaluation. `force_reschedule` places again allocations Nomad stopped after
    their restart attempts: only `planner retry` (and apply's restart of a stopped job)
    may ask for it, never activation (issue 19: a 6th start), and only when each of those
    is of the job's current definition (`planner.model.resurrect`: Nomad re-places it at
    its own version)."""

    force_reschedule: bool = False


JOB_WRITES = (Park, Unpark, Register, Deregister, Revert, Scale)
