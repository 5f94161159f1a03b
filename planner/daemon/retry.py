"""`planner retry` and the admin API's retry: a pass of the model for `Event.RETRY`.

What a retry does is decided by `planner.model.transition.decide` (`planner.model.retry`:
lift parking, roll a rolled-back definition out again, place stopped replicas again,
ask for a placement) and written by the applier (`planner.daemon.applier`), every job
write checked against the job as the pass read it: a retry that read a parked job
never registers that definition over one an `apply` registered since (Nomad refuses
the index; the pass reads again and decides on the new job).

Two callers, one pass:
- the admin API's route, on the leader: `PlannerNode.retry` submits the event to the
  model's worker (`planner.daemon.workers`), so it never overlaps the model's other
  passes;
- `planner retry` run directly (`retry`): the same pass in a worker of its own, with
  the unfenced store, no passing replicas known (a retry forgives the counts anyway)
  and the default rules.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from datetime import UTC, datetime

from llmgw_contract import StateDocument
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.agents.state import StateStore
from planner.daemon.applier import Applier, Stale
from planner.daemon.observe import Observer
from planner.daemon.workers import Outcome, Workers
from planner.errors import Unavailable
from planner.model.failures import Rules
from planner.model.transition import Event, decide

# How long a retry waits for its pass: a few reads and writes of one model, each
# bounded by the clients' own 10 s timeout; a pass still queued after this is a
# planner too busy to answer (the admin API's caller may ask again).
PASS_WAIT_S = 60.0


def answered(future: concurrent.futures.Future[Outcome], name: str) -> tuple[StateDocument, str]:
    """The document and the words of a retry's pass (`Plan.summary`). Raises Rejected
    (no job), Unavailable (the job kept changing under the decision, or no answer
    within PASS_WAIT_S) or what the clients raised."""
    try:
        outcome = future.result(PASS_WAIT_S)
    except Stale as exc:
        raise Unavailable(
            f"model {name}: its job kept changing while deciding the retry ({exc}); retry again"
        ) from exc
    except concurrent.futures.TimeoutError:
        raise Unavailable(
            f"model {name}: no decision within {PASS_WAIT_S:.0f} s (Nomad or Consul slow)"
        ) from None
    if outcome.written:
        # Issue 19's third QA (D2): the first attempt lifted parking and its document's
        # check-and-set lost to the watcher's; the second saw an unparked job and said
        # "nothing to retry". What was written is said; what the next look did, if
        # anything (a second tester read "(then, observed again: ... nothing to retry)"
        # as nothing done).
        done = "; ".join(p.summary for p in outcome.written)
        if not outcome.plan.effects:  # the next look found it done: nothing more to say
            return outcome.applied.state, done
        return outcome.applied.state, f"{done}; then {outcome.plan.summary}"
    return outcome.applied.state, outcome.plan.summary


def retry(
    nomad: NomadClient,
    consul: ConsulClient,
    name: str,
    rules: Rules | None = None,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> tuple[StateDocument, str]:
    """Try model `name` again from this process (`planner retry`): observe, decide
    `Event.RETRY`, apply; on a refused index, again (`Workers`' bounded attempts).
    Returns the document written and what was done, in words."""
    store = StateStore(consul)
    observer, applier, rules = (
        Observer(nomad, consul, store),
        Applier(nomad, store),
        rules or Rules(),
    )
    workers = Workers(
        lambda model: observer.observe(model, {}, clock()),
        lambda document, observation, event: decide(document, observation, event, rules, clock()),
        applier.apply,
        max_passes=1,
    )
    try:
        return answered(workers.submit(name, Event.RETRY), name)
    finally:
        workers.stop()
