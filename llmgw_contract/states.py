"""The model states and the activation answers: one vocabulary for every view.

`planner status`, `planner models`, the admin API, the planner's metrics and
the router's refusals all use these words; a replica's words are `ReplicaState`.
docs/architecture.md draws the state machine; `planner.model.status.observe` is the one
function that decides which state a model is in.
"""

from __future__ import annotations

from enum import StrEnum


class ModelState(StrEnum):
    """What an operator is told about one model, most urgent first.

    serving      every desired replica passes its health check, and none is
                 failing or in its post-failure probation
    degraded     at least one replica serves, and another keeps failing, was
                 stopped after too many failures, or fits on no node
    loading      placed and starting (or waiting for room being made); nothing
                 has failed
    failing      starts have been failing (count and last error shown), or the
                 replicas that pass have crashed within their stability window
    parked       stopped after too many consecutive start failures with no
                 healthy replica; lifted by a new definition or `planner retry`
    unplaceable  no replica can be placed: the scheduler's reason is shown
    idle         wants no replica now: `replicas: 0`, or on demand and unused
    stopped      the definition wants replicas, but its Nomad job is missing
                 or stopped
    """

    SERVING = "serving"
    DEGRADED = "degraded"
    LOADING = "loading"
    FAILING = "failing"
    PARKED = "parked"
    UNPLACEABLE = "unplaceable"
    IDLE = "idle"
    STOPPED = "stopped"


# States in which a model has what it should have (`planner status` exits 0).
SATISFIED_STATES = frozenset({ModelState.SERVING, ModelState.IDLE})


class ReplicaState(StrEnum):
    """What an operator is told about one replica (an allocation) of a model: the
    `replicas` rows of `planner status`, `planner models --output json` and the admin
    API. Not a model state: a model's state (:class:`ModelState`) is judged from its
    replicas' (`planner.model.status.observe`).

    serving      its current run passes its health check, and either never failed or
                 has passed for the stability window (its failures are forgiven)
    loading      placed and starting; nothing failed yet
    failing      failed starts, or crashed soon after passing; Nomad still restarts it
    stopped      Nomad stopped restarting it: its restart attempts ran out (5 starts);
                 only `planner retry` places it again
    """

    SERVING = "serving"
    LOADING = "loading"
    FAILING = "failing"
    STOPPED = "stopped"


class ActivationStatus(StrEnum):
    """The planner's answer to `POST /v1/models/{name}/activate` (the router asks it
    when a defined model has no passing endpoint).

    serving      a replica passes its check now; the router's table will see it
    loading      placed (or room is being made for it): wait for a passing endpoint
    parked       refused until an operator lifts it
    unplaceable  the fresh placement attempt fit on no node: refuse with the reason
    stopped      defined with `replicas: 0`, or its job is stopped: refuse, no retry
    """

    SERVING = "serving"
    LOADING = "loading"
    PARKED = "parked"
    UNPLACEABLE = "unplaceable"
    STOPPED = "stopped"
