"""Pure parking, placement and idle logic, driven with a fake clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from planner.failures import (
    count_failure,
    decide_parking,
    mark_healthy,
    new_failures,
    retried,
    stderr_summary,
)
from planner.idle import idle_models
from planner.placement import WarningLog, evaluation_reason, metric_reason, should_warn
from planner.state import ModelState

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
S = 10**9


def event(kind: str, at: int, **extra: object) -> dict:
    return {"Type": kind, "Time": at * S, "DisplayMessage": extra.pop("msg", kind), **extra}


def alloc(alloc_id: str, *events: dict, status: str = "failed") -> dict:
    return {"ID": alloc_id, "JobID": "m", "ClientStatus": status,
            "TaskStates": {"llama-server": {"Events": list(events)}}}


FAILING = alloc("a1", event("Received", 1), event("Started", 2),
                event("Terminated", 3, msg="Exit Code: 1", ExitCode=1),
                event("Restarting", 4), event("Started", 9),
                event("Terminated", 10, msg="Exit Code: 1", ExitCode=1))


def count_all(state: ModelState, allocation: dict) -> ModelState:
    for failure in new_failures(state, allocation):
        state = count_failure(state, failure, "")
    return state


def test_each_ended_start_counts_once_even_when_replayed() -> None:
    state = count_all(ModelState(name="m"), FAILING)
    assert state.consecutive_failures == 2
    assert state.last_error == "Terminated: Exit Code: 1"
    assert count_all(state, FAILING) == state  # a replayed event, or a planner restart


def test_a_stop_is_not_a_failure() -> None:
    stopped = alloc("a2", event("Started", 1), event("Killing", 5),
                    event("Terminated", 6, ExitCode=0, Signal=15), event("Killed", 7))
    assert new_failures(ModelState(name="m"), stopped) == []


def test_healthy_allocation_resets_and_its_later_crash_does_not_count() -> None:
    state = count_all(ModelState(name="m"), FAILING)
    state = mark_healthy(state, "a3", now_ns=20 * S)
    assert state.consecutive_failures == 0
    crash = alloc("a3", event("Started", 15), event("Terminated", 30, ExitCode=137, Signal=9),
                  status="running")
    assert new_failures(state, crash) == []
    # A failure older than the reset, seen late (the planner was down), does not count.
    late = alloc("a4", event("Started", 11), event("Terminated", 12, ExitCode=1))
    assert new_failures(state, late) == []


def test_parked_at_exactly_the_threshold_and_lifted_by_retry() -> None:
    state = ModelState(name="m", consecutive_failures=4, last_error="boom")
    assert decide_parking(state, "h1", T0).parked is None
    parked = decide_parking(state.model_copy(update={"consecutive_failures": 5}), "h1", T0)
    assert parked.parked is not None
    assert (parked.parked.reason, parked.parked.definition_hash) == \
        ("5 consecutive start failures", "h1")
    again = retried(parked)
    assert again.parked is None and again.consecutive_failures == 0


def test_stderr_summary_keeps_the_cause_first() -> None:
    tail = ("0.01 I loading\n0.02 E llama_model_load: error loading model: unknown model "
            "architecture: 'kev'\n0.03 E failed to load model\n0.04 E exiting due to model "
            "loading error\n")
    summary = stderr_summary(tail).splitlines()
    assert "unknown model architecture: 'kev'" in summary[0]


def test_metric_reasons_read_like_an_operator_would_say_them() -> None:
    gpu = {"NodesEvaluated": 1, "NodesFiltered": 1, "ConstraintFiltered": {"missing devices": 1}}
    assert metric_reason(gpu) == \
        'no node has an nvidia/gpu device: 1 of 1 node filtered ("missing devices")'
    memory = {"NodesEvaluated": 3, "DimensionExhausted": {"memory": 2}, "NodesExhausted": 2}
    assert metric_reason(memory) == "memory exhausted on 2 of 3 nodes"
    assert metric_reason({"NodesEvaluated": 0, "NodesAvailable": {}}).startswith("no ready node")
    assert evaluation_reason({"FailedTGAllocs": {"server": memory}}) == \
        "memory exhausted on 2 of 3 nodes"
    assert evaluation_reason({"FailedTGAllocs": None}) is None


def test_placement_warning_once_then_on_change_or_every_ten_minutes() -> None:
    log, now, warned = WarningLog(), T0, 0
    for minute in range(0, 25):
        now = T0 + timedelta(minutes=minute)
        if should_warn(log, "no gpu", now):
            warned += 1
            log = WarningLog("no gpu", now)
    assert warned == 3  # at 0, 10 and 20 minutes, not once per evaluation
    assert should_warn(log, "memory exhausted", now + timedelta(seconds=1))


def test_idle_models_after_idle_after_without_use() -> None:
    records = {"od": {"on_demand": {"idle_after": 60}}, "always": {"on_demand": None},
               "fresh": {"on_demand": {"idle_after": 60}}}
    counts = {"od": 1, "always": 1, "fresh": 1}
    states = {"od": ModelState(name="od", last_used_at=(T0 - timedelta(seconds=61)).isoformat()),
              "fresh": ModelState(name="fresh", last_used_at=T0.isoformat())}
    assert idle_models(records, counts, states, T0) == ["od"]
    assert idle_models(records, {**counts, "od": 0}, states, T0) == []


# Real llama-server stderr (trimmed): a missing file and a file that is not GGUF.
MISSING = """\
0.00.004.312 I srv    load_model: loading model '/m/nope.gguf'
0.00.004.400 E gguf_init_from_file: failed to open GGUF file '/m/x' (No such file or directory)
0.00.004.420 E llama_model_load: error loading model: llama_model_loader: failed to load model
0.00.004.500 E srv  llama_server: exiting due to model loading error
"""
GARBAGE = MISSING.replace("failed to open GGUF file '/m/x' (No such file or directory)",
                          "invalid magic characters: '??B?', expected 'GGUF'")


def test_stderr_summary_names_what_tells_the_failures_apart() -> None:
    assert stderr_summary(MISSING).splitlines()[0] == \
        "gguf_init_from_file: failed to open GGUF file '/m/x' (No such file or directory)"
    assert "invalid magic characters" in stderr_summary(GARBAGE).splitlines()[0]
    repeated = MISSING + MISSING.replace("0.00.004", "0.00.009")
    assert stderr_summary(repeated) == stderr_summary(MISSING)  # repeats collapse
