"""Per-model workers (planner.daemon.workers): serial per model, parallel across models,
coalesced, re-decided on Stale, bounded. observe/decide/apply are stand-ins that
record what they were asked (the workers' contract is only their order)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import pytest

from llmgw_contract import StateDocument
from planner.daemon.applier import Applied, Stale
from planner.daemon.workers import Outcome, Skipped, Workers
from planner.model.effects import Reason, Scale
from planner.model.observation import Observation
from planner.model.transition import Event, Plan

WAIT = 10.0  # a bound for a condition, never a sleep


class Model:
    """observe/decide/apply of a fake world: counts, optional gates, Stale on demand."""

    def __init__(self) -> None:
        self.observed: Counter[str] = Counter()
        self.decided: list[tuple[str, Event]] = []
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.stale_left: Counter[str] = Counter()
        self.running: Counter[str] = Counter()
        self.overlap = False
        self.lock = threading.Lock()

    def gate(self, name: str) -> threading.Event:
        self.gates[name], self.entered[name] = threading.Event(), threading.Event()
        return self.gates[name]

    def observe(self, name: str) -> tuple[StateDocument, Observation]:
        with self.lock:
            self.running[name] += 1
            self.overlap |= self.running[name] > 1
            self.observed[name] += 1
        try:
            if name in self.gates:
                self.entered[name].set()
                assert self.gates[name].wait(WAIT)
        finally:
            with self.lock:
                self.running[name] -= 1
        return StateDocument(name=name), Observation(name=name, record=None, job=None)

    def decide(self, document: StateDocument, observation: Observation, event: Event) -> Plan:
        self.decided.append((document.name, event))
        effects = (Scale(Reason.IDLE, "idle", "server", 0),) if event == Event.IDLE else ()
        return Plan(document, effects)

    def apply(
        self, name: str, before: StateDocument, plan: Plan, observation: Observation
    ) -> Applied:
        with self.lock:
            if self.stale_left[name]:
                self.stale_left[name] -= 1
                raise Stale(f"model {name}: moved")
        return Applied(plan.state)


@pytest.fixture
def model() -> Model:
    return Model()


@pytest.fixture
def workers(model: Model) -> Workers:
    workers = Workers(model.observe, model.decide, model.apply)
    yield workers
    for gate in model.gates.values():
        gate.set()
    workers.stop()


def wait(predicate: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(int(WAIT / 0.01)):
        if predicate():
            return
        done.wait(0.01)
    pytest.fail("condition not reached")


def test_a_slow_model_never_delays_another_models_tick(model: Model, workers: Workers) -> None:
    slow = model.gate("slow")
    workers.mark("slow")
    assert model.entered["slow"].wait(WAIT)  # its observe hangs, as on a slow Nomad
    ticked = threading.Event()
    workers._done = lambda name, outcome: ticked.set() if name == "fast" else None
    workers.mark("fast", Event.TICK)
    assert ticked.wait(WAIT)  # done while "slow" is still stuck in Nomad
    assert ("fast", Event.TICK) in model.decided and not slow.is_set()
    slow.set()


def test_a_burst_for_one_model_is_one_more_pass_never_two_at_once(
    model: Model, workers: Workers
) -> None:
    gate = model.gate("m")
    workers.mark("m")
    assert model.entered["m"].wait(WAIT)
    for _ in range(100):
        workers.mark("m")
    workers.mark("m", Event.TICK)  # kept apart: only a TICK pass judges stability
    workers.mark("m", Event.TICK)
    gate.set()
    wait(lambda: workers.pending() == 0)
    assert model.observed["m"] == 3
    assert model.decided == [("m", Event.OBSERVED), ("m", Event.OBSERVED), ("m", Event.TICK)]
    assert not model.overlap


def test_stale_observes_and_decides_again_then_gives_up(model: Model, workers: Workers) -> None:
    model.stale_left["m"] = 2
    outcome = workers.submit("m", Event.ACTIVATE).result(WAIT)
    assert isinstance(outcome, Outcome) and outcome.attempts == 3
    assert model.observed["m"] == 3
    model.stale_left["m"] = 99
    with pytest.raises(Stale):
        workers.submit("m", Event.ACTIVATE).result(WAIT)
    assert workers.given_up == 1 and model.observed["m"] == 3 + workers.max_attempts


def test_a_refusal_is_logged_naming_the_model_once(
    model: Model, workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    """The applier's Stale names the model itself; the worker's line names it once (it
    read "model m: model m: moved")."""
    model.stale_left["m"] = 1
    with caplog.at_level("INFO", logger="planner.workers"):
        workers.submit("m", Event.ACTIVATE).result(WAIT)
    [line] = [r.getMessage() for r in caplog.records if "observing again" in r.getMessage()]
    assert line == "model m: moved (attempt 1 of 5); observing again"


def test_a_guard_that_says_no_writes_nothing(model: Model, workers: Workers) -> None:
    applied: list[str] = []
    workers._apply = lambda name, before, plan, obs: applied.append(name) or Applied(plan.state)
    asks = iter([True, False])  # still idle when deciding, used again before writing
    with pytest.raises(Skipped):
        workers.submit("m", Event.IDLE, guard=lambda: next(asks)).result(WAIT)
    assert applied == []


def test_a_command_covers_pending_observations_but_not_a_tick(
    model: Model, workers: Workers
) -> None:
    gate = model.gate("m")
    workers.mark("m")
    assert model.entered["m"].wait(WAIT)
    workers.mark("m")
    workers.mark("m", Event.TICK)
    future = workers.submit("m", Event.ACTIVATE)
    gate.set()
    future.result(WAIT)
    wait(lambda: workers.pending() == 0)
    assert model.decided == [("m", Event.OBSERVED), ("m", Event.ACTIVATE), ("m", Event.TICK)]


def test_submissions_of_one_event_share_a_pass(model: Model, workers: Workers) -> None:
    gate = model.gate("m")
    workers.mark("m")
    assert model.entered["m"].wait(WAIT)
    futures = [workers.submit("m", Event.ACTIVATE) for _ in range(20)]
    gate.set()
    outcomes = {id(f.result(WAIT)) for f in futures}
    assert len(outcomes) == 1
    assert model.decided.count(("m", Event.ACTIVATE)) == 1


def test_memory_is_one_slot_per_busy_model_and_none_at_rest(model: Model, workers: Workers) -> None:
    for i in range(200):
        workers.mark(f"m{i}")
    wait(lambda: workers.pending() == 0)
    assert sum(model.observed.values()) == 200


def test_commands_need_submit_and_a_stopped_pool_refuses(model: Model, workers: Workers) -> None:
    with pytest.raises(ValueError):
        workers.mark("m", Event.ACTIVATE)
    workers.stop()
    with pytest.raises(Exception, match="stopped leading"):
        workers.submit("m", Event.ACTIVATE).result(WAIT)


def test_a_retry_whose_writes_landed_before_a_refused_document_says_so() -> None:
    """Issue 19's third QA (D2): the retry lifted parking, its document's check-and-set
    lost to the watcher's write, and the pass decided again on the unparked job:
    "nothing to retry" was all the operator read. The landed plan is kept and said."""
    from planner.daemon.retry import answered

    landed = Plan(StateDocument(name="m"), summary="parking lifted; the job is starting again")
    attempts = iter([Stale("model m: its state document changed meanwhile", landed), None])

    def apply(name: str, before: StateDocument, plan: Plan, observation: Observation) -> Applied:
        refusal = next(attempts)
        if refusal is not None:
            raise refusal
        return Applied(plan.state)

    model = Model()
    workers = Workers(
        model.observe,
        lambda d, o, e: Plan(d, summary="not parked, unplaceable or stopped; nothing to retry"),
        apply,
    )
    try:
        _, words = answered(workers.submit("m", Event.RETRY), "m")
    finally:
        workers.stop()
    assert words == "parking lifted; the job is starting again"
