"""Load-based scaling as a decision (pure): how many replicas a model's demand asks for,
and whether to scale now (issue 22).

Called by `planner.model.transition.decide` on a TICK pass of a model whose record has
`scaling` (`llmgw_contract.ScalingBounds`); the effect is the ordinary `Scale`, written
by the applier against the job as read (EnforceIndex), in the model's one serial worker,
so a scale never overlaps an apply, a retry, an activation or the idle scaler.

The signal is `Demand`: requests in flight and waiting for the model, summed over the
latest report of every router (`planner.daemon.demand`), as a time-weighted average over
the definition's `window` and as it stands now. The rules, after KubeAI (replicas =
ceil(average of active requests / target), the average kept across restarts) and
Knative's KPA (a stable window, and a panic mode at twice the target):

  wanted  = ceil(average / target), within [max(min, 1), max]
  up      once `wanted` > replicas has held for `up_after`, or at once on a surge: the
          load stayed at least 2 x target per replica at every report of a short panic
          window that holds two reports of one router (`Demand.surge`; one momentary
          spike is not a surge), then to ceil(surge / target)
  down    once `wanted` < replicas has held for `down_after`, and only when this
          leader's reports cover the whole window (a new leader's first report is not
          a window) and no router went silent within `down_after` (`Demand.lost`: its
          load is unknown, not gone; a router that stops says goodbye instead)
  held    while a deployment of the job runs (Nomad refuses a scale then: "job scaling
          blocked due to active deployment"), while no router reports (nothing says
          the load ended), and for an idle on-demand model (count 0: activation's)

What it keeps (`llmgw_contract.ScalingState`, in the state document so a new leader
goes on from it): the average and when it was taken (saved when a decision is made,
when a since-marker moves, and at most every `SAVE_EVERY_S` otherwise: the document is
watched by every router, so it is not written on every pass), since when the average
asked for more or fewer, why a wanted scale waits, and the last decision with its figures.
A new leader's first averages lean on the saved one for the part of the window it has
no reports of. Saved since-markers are wall-clock times of whoever saved them: one in
the future (clock skew), or from a state not saved for longer than `STALE_AFTER_S` (a
gap nobody watched: a leader change, a planner down), is dropped and starts again now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from llmgw_contract import ScalingBounds, ScalingDecision, ScalingState

# Knative KPA: panic when the load is twice what the replicas are meant to carry.
SURGE_FACTOR = 2.0
# The saved average is refreshed at most this often when nothing else changes.
SAVE_EVERY_S = 30.0
# A scaler with a signal saves at least every SAVE_EVERY_S (and decides every 2 s,
# `planner.daemon.watcher.SCALE_EVERY_S`): a saved average older than twice that was
# not kept by a running scaler (no signal, a leader change, a planner down).
STALE_AFTER_S = 2 * SAVE_EVERY_S


@dataclass(frozen=True)
class Demand:
    """A model's requests (in flight + waiting) over all routers reporting now.

    `average`: time-weighted over the last `covered_s` seconds (at most the window asked
    for); `now`: the latest sum; `routers`: routers whose report is still fresh (0: no
    signal); `surge`: the lowest sum over the panic window when it holds two reports
    of one router, else 0 (`planner.daemon.demand.PANIC_INTERVALS`); `lost`: routers
    that went silent without a goodbye within the hold asked for (their load is
    unknown)."""

    average: float
    now: float
    covered_s: float
    routers: int
    surge: float = 0.0
    lost: int = 0


@dataclass(frozen=True)
class Scaled:
    """The next scaling state, and the count to scale to (None: no scale now)."""

    state: ScalingState
    count: int | None = None
    words: str = ""


def wanted(load: float, bounds: ScalingBounds) -> int:
    """ceil(load / target) within [max(min, 1), max]."""
    need = math.ceil(load / bounds.target - 1e-9) if load > 0 else 0
    return min(max(need, bounds.min, 1), bounds.max)


def average_is_fresh(state: ScalingState | None, now_s: float) -> bool:
    """Whether the saved average was kept by a scaler with a signal (`STALE_AFTER_S`;
    for `status`: a held scaler never refreshes it)."""
    return state is not None and 0 <= now_s - state.average_at <= STALE_AFTER_S


def _timer(since: float, state: ScalingState, now_s: float) -> float:
    """A saved since-marker, or 0 when it cannot be trusted (see the module docstring)."""
    if since > now_s or not average_is_fresh(state, now_s):
        return 0.0
    return since


def blended(demand: Demand, saved: ScalingState, window: int, now_s: float) -> float:
    """The window's average, the part not covered by reports taken from the saved average
    when it is recent (a new leader, a planner restart)."""
    covered = min(max(demand.covered_s, 0.0), float(window))
    if covered >= window or saved.average_at <= 0 or now_s - saved.average_at > window:
        return demand.average
    return (demand.average * covered + saved.average * (window - covered)) / window


def decide(
    saved: ScalingState | None,
    bounds: ScalingBounds,
    count: int,
    demand: Demand | None,
    blocked: str | None,
    now: datetime,
) -> Scaled:
    """The scaling of a model running `count` replicas (the job's), given `demand`
    (None or no router: no signal) and `blocked` (why Nomad would refuse a scale now,
    e.g. a running deployment; None: nothing). Pure; the same inputs give the same
    answer."""
    state = saved or ScalingState()
    t = now.timestamp()
    if count == 0 or demand is None or demand.routers == 0:
        why = "" if count == 0 else "no router reports load: holding the count"
        held = state.model_copy(update={"above_since": 0.0, "below_since": 0.0, "waiting": why})
        return Scaled(held)
    average = blended(demand, state, bounds.window, t)
    want = wanted(average, bounds)
    surge = count > 0 and demand.surge >= SURGE_FACTOR * bounds.target * count
    surge_to = wanted(demand.surge, bounds) if surge else count
    above_since = _timer(state.above_since, state, t)
    below_since = _timer(state.below_since, state, t)
    above = (above_since or t) if want > count or surge_to > count else 0.0
    below = (below_since or t) if want < count and not surge else 0.0
    target_count: int | None = None
    how = ""
    if surge_to > count:
        target_count, how = surge_to, "now (a surge)"
    elif (want > count and t - above >= bounds.up_after) or (
        want < count and t - below >= bounds.down_after
    ):
        target_count, how = want, f"over {bounds.window} s"
    per_replica = (demand.surge if surge_to > count else average) / count
    update: dict[str, object] = {"above_since": above, "below_since": below, "waiting": ""}
    decision = None
    down_held = _down_held(demand, bounds)
    if target_count is not None and target_count < count and down_held:
        update["waiting"] = f"wants {target_count}: {down_held}"
    elif target_count is not None and target_count != count:
        words = (
            f"{count} -> {target_count}: {per_replica:.2g} in flight per replica "
            f"{how}, target {bounds.target:g}"
        )
        if blocked:
            update["waiting"] = f"wants {target_count}: {blocked}"
        else:
            decision = ScalingDecision(
                before=count,
                after=target_count,
                reason=words,
                at=now.isoformat(timespec="seconds"),
                average=round(average, 3),
                per_replica=round(per_replica, 3),
                direction="up" if target_count > count else "down",
            )
            update |= {"above_since": 0.0, "below_since": 0.0, "last": decision}
    moved = (
        decision is not None
        or update["above_since"] != state.above_since
        or update["below_since"] != state.below_since
        or update["waiting"] != state.waiting
        or t - state.average_at >= SAVE_EVERY_S
    )
    if moved:
        update |= {"average": round(average, 3), "average_at": t}
    next_state = state.model_copy(update=update)
    if decision is None:
        return Scaled(next_state)
    return Scaled(next_state, decision.after, decision.reason)


def _down_held(demand: Demand, bounds: ScalingBounds) -> str:
    """Why a due scale-down must wait for a fuller signal ("": it need not)."""
    if demand.lost:
        return (
            f"{demand.lost} router(s) stopped reporting within {bounds.down_after} s "
            "(their load is unknown); scaling down waits"
        )
    if demand.covered_s < bounds.window - 1e-6:
        return (
            f"{demand.covered_s:.0f} s of the {bounds.window} s window reported "
            "(a new leader); scaling down waits for the whole window"
        )
    return ""
