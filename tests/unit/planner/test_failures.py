"""Start failures per replica, crash-after-ready, stability and parking, with a fake clock."""

from __future__ import annotations

from datetime import UTC, datetime

from llmgw_contract import StateDocument
from planner.model.failures import (
    AllocInfo,
    Rules,
    decide_parking,
    due_stable,
    for_definition,
    headline,
    judge,
    new_failures,
    passing,
    retried,
    stabilize,
    track,
)
from tests.support.nomad_mock import TASK, S, alloc, event, run

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
RULES = Rules(park_after=5, stable_after_ns=120 * S)


def info(
    alloc_id: str = "a1",
    index: int = 0,
    node: str = "node-a",
    client: str = "running",
    desired: str = "run",
    definition: str = "d1",
) -> AllocInfo:
    return AllocInfo(alloc_id, f"m.server[{index}]", node, definition, client, desired)


def fresh(*infos: AllocInfo) -> StateDocument:
    state = for_definition(StateDocument(name="m"), "d1")
    for i in infos:
        state = track(state, i)
    return state


def count(state: StateDocument, allocation: dict) -> StateDocument:
    for failure in new_failures(state, allocation):
        state = judge(state, failure, "", RULES)
    return state


FAILING = alloc("a1", event("Received", 1), *run(2, 3), event("Restarting", 4), *run(9, 10))


def test_each_ended_start_counts_once_per_replica_and_model_even_when_replayed() -> None:
    state = count(fresh(info()), FAILING)
    assert state.consecutive_failures == 2 and state.start_failures_total == 2
    assert state.replica("a1").consecutive_failures == 2
    assert state.last_error == "Terminated: Exit Code: 1"
    assert count(state, FAILING) == state  # a replayed event, or a planner restart


def test_a_stop_or_an_operators_restart_is_not_a_failure() -> None:
    stopped = alloc(
        "a2",
        *run(1),
        event("Killing", 5),
        event("Terminated", 6, ExitCode=0, Signal=15),
        event("Killed", 7),
    )
    assert new_failures(fresh(), stopped) == []
    restarted = alloc(
        "a3",
        *run(1),
        event("Restart Signaled", 5, RestartReason="User requested restart"),
        event("Terminated", 6, ExitCode=137, Signal=9),
    )
    assert new_failures(fresh(), restarted) == []


def test_a_health_check_restart_counts() -> None:
    killed = alloc(
        "a1",
        *run(1),
        event("Restart Signaled", 100, RestartReason="healthcheck: check unhealthy"),
        event("Terminated", 101, ExitCode=137, Signal=9),
    )
    assert count(fresh(info()), killed).consecutive_failures == 1


def test_a_crash_soon_after_passing_is_a_failure_and_says_so() -> None:
    state = passing(fresh(info()), "a1", 5 * S)
    state = count(state, alloc("a1", *run(2, 20)))
    assert state.consecutive_failures == 1
    assert "15 s after it passed its health check" in state.last_error


def test_a_run_healthy_for_the_window_ends_without_a_failure_and_resets() -> None:
    state = count(fresh(info()), alloc("a1", *run(1, 2)))
    state = passing(state, "a1", 10 * S)
    ended = count(state, alloc("a1", *run(1, 2), event("Restarting", 3), *run(8, 200)))
    assert ended.consecutive_failures == 0
    assert ended.replica("a1").consecutive_failures == 0
    assert ended.start_failures_total == 1


def test_passing_entries_survive_events_seen_out_of_order() -> None:
    # The replica's second run started passing before the planner read the end of the first.
    state = passing(passing(fresh(info()), "a1", 5 * S), "a1", 40 * S)
    state = count(state, alloc("a1", *run(2, 30)))  # first run: passed at 5, crashed at 30
    assert "25 s after it passed" in state.last_error


def test_stable_once_per_run() -> None:
    state = count(fresh(info()), alloc("a1", *run(1, 2)))
    state = passing(state, "a1", 10 * S)
    assert due_stable(state, {"a1": 10 * S}, 100 * S, RULES) == []
    due = due_stable(state, {"a1": 10 * S}, 130 * S, RULES)
    assert due == [("a1", 10 * S)]
    stable = stabilize(state, "a1", 10 * S)
    assert stable.consecutive_failures == 0 and stable.replica("a1").stable_entry == 10 * S
    assert due_stable(stable, {"a1": 10 * S}, 140 * S, RULES) == []
    assert stabilize(stable, "a1", 10 * S) == stable


def five_failures(state: StateDocument, alloc_id: str = "b1") -> StateDocument:
    events = [e for i in range(5) for e in run(10 * i + 1, 10 * i + 2)]
    return count(state, alloc(alloc_id, *events))


def test_parked_at_five_when_no_replica_protects_the_model() -> None:
    state = five_failures(fresh(info("b1")))
    restarting = {"b1": info("b1")}  # still live: Nomad restarts it
    assert (
        decide_parking(
            state.model_copy(update={"consecutive_failures": 4}), restarting, frozenset(), T0, RULES
        ).parked
        is None
    )
    parked = decide_parking(state, restarting, frozenset(), T0, RULES).parked
    assert parked is not None
    assert (parked.reason, parked.definition_hash) == ("5 consecutive start failures", "d1")


def test_parked_when_nomad_stopped_every_replica_though_fewer_were_counted() -> None:
    """A count lost with a wiped KV (or runs that crashed past their stability window):
    Nomad gave up on every replica, so nothing starts again; parking says so."""
    state = five_failures(fresh(info("b1"))).model_copy(update={"consecutive_failures": 2})
    stopped = {"b1": info("b1", client="failed")}
    parked = decide_parking(state, stopped, frozenset(), T0, RULES).parked
    assert parked is not None and parked.reason.startswith("every replica stopped by Nomad")
    # A replacement placed in its stead (a forced reschedule) is not stopped.
    replaced = {"b1": AllocInfo("b1", "m.server[0]", "node-a", "d1", "failed", "run", True)}
    assert decide_parking(state, replaced, frozenset(), T0, RULES).parked is None


def test_an_update_failing_beside_the_old_version_that_serves_is_never_parked() -> None:
    """The old definition's replica serves while the new one's canary fails: Nomad rolls
    the update back; parking would stop what serves (issue "Model updates without
    downtime")."""
    state = five_failures(fresh(info("b1")))
    allocs = {"b1": info("b1", client="failed"), "old": info("old", definition="d0")}
    assert decide_parking(state, allocs, frozenset({"old"}), T0, RULES).parked is None
    # The old one no longer passing: nothing serves, the model parks.
    assert decide_parking(state, allocs, frozenset(), T0, RULES).parked is not None


def test_one_bad_replica_beside_a_healthy_one_never_parks_the_model() -> None:
    a, b = info("a1", 0, "node-a"), info("b1", 1, "node-b")
    state = five_failures(passing(fresh(a, b), "a1", 1 * S))
    assert state.replica("b1").consecutive_failures == 5
    assert state.replica("a1").consecutive_failures == 0
    allocs = {"a1": a, "b1": info("b1", 1, "node-b", client="failed")}
    assert decide_parking(state, allocs, frozenset({"a1"}), T0, RULES).parked is None
    # A replica still loading, never failed, protects it too: it may well start.
    assert decide_parking(state, allocs, frozenset(), T0, RULES).parked is None


def test_a_replica_passing_now_protects_even_after_failures_of_its_own() -> None:
    # Issue 19 changed this: a passing replica in its probation used not to protect, so
    # the model parked and the replica serving stopped. The README: parking needs "no
    # replica healthy".
    state = five_failures(fresh(info("b1")))
    state = passing(state, "b1", 100 * S)  # passes again, in probation
    allocs = {"b1": info("b1")}
    assert decide_parking(state, allocs, frozenset({"b1"}), T0, RULES).parked is None
    # Once it no longer passes (it crashed again), nothing protects the model.
    assert decide_parking(state, allocs, frozenset(), T0, RULES).parked is not None


def test_a_new_definition_starts_over_and_forgets_old_replicas() -> None:
    state = five_failures(fresh(info("b1")))
    new = for_definition(state, "d2")
    assert (new.consecutive_failures, new.replicas, new.definition_hash) == (0, (), "d2")
    assert track(new, info("b1", definition="d1")) == new  # an old replica is not tracked
    assert new.start_failures_total == 5


def test_track_drops_a_replica_the_scheduler_stopped() -> None:
    state = fresh(info("a1"))
    assert track(state, info("a1", desired="stop")).replicas == ()


def test_retried_clears_parking_and_counts() -> None:
    state = decide_parking(five_failures(fresh(info("b1"))), {}, frozenset(), T0, RULES)
    again = retried(state)
    assert again.parked is None and again.consecutive_failures == 0
    assert again.replica("b1").consecutive_failures == 0


def test_headline_drops_llama_cpp_time_prefixes() -> None:
    assert (
        headline("Terminated: Exit Code: 1\n0.00.000.100 E boom\nmore")
        == "Terminated: Exit Code: 1 | boom"
    )


def crashed(at: float, exit_code: int, signal: int = 0, **extra: object) -> dict:
    return event(
        "Terminated",
        at,
        msg=f"Exit Code: {exit_code}, Signal: {signal}",
        ExitCode=exit_code,
        Signal=signal,
        **extra,
    )


def test_a_death_by_a_signal_is_named_as_a_crash_first_whatever_stderr_said() -> None:
    """Issue 17: the parked model's last error read "Terminated: Exit Code: 139, Signal: 11
    | load: control-looking token ...", a warning as its headline."""
    tail = (
        "load: control-looking token: 212 '</s>' was not control-type; this is probably "
        "a bug in the model\nsrv  load_model: initializing slots\n"
    )
    state = fresh(info())
    [failure] = new_failures(state, alloc("a1", event("Started", 1), crashed(2, 139, 11)))
    assert failure.crashed and failure.signal == 11
    state = judge(state, failure, tail, RULES)
    assert state.last_error.splitlines()[0] == "crashed: SIGSEGV (exit 139)"
    assert "initializing slots" in state.last_error  # the last lines before the crash
    assert headline(state.last_error) == "crashed: SIGSEGV (exit 139)"


def test_a_crash_is_told_by_its_exit_status_and_a_kill_names_the_memory_limit() -> None:
    resources = {"AllocatedResources": {"Tasks": {TASK: {"Memory": {"MemoryMB": 256}}}}}
    # A shell wrapper reports its child's SIGILL as exit status 132, Signal 0.
    [ill] = new_failures(fresh(), alloc("a1", event("Started", 1), crashed(2, 132)))
    assert ill.message.startswith("crashed: SIGILL (exit 132): illegal instruction")
    [killed] = new_failures(
        fresh(), alloc("a1", event("Started", 1), crashed(2, 137, 9), **resources)
    )
    assert (
        killed.message
        == "crashed: SIGKILL (exit 137): killed (out of memory?); memory limit 256 MiB"
    )
    oom = crashed(2, 137, 9, Details={"oom_killed": "true"})
    [killed] = new_failures(fresh(), alloc("a1", event("Started", 1), oom, **resources))
    assert "out of memory (the kernel killed it" in killed.message
    [plain] = new_failures(fresh(), alloc("a1", *run(1, 2)))
    assert (plain.crashed, plain.message) == (False, "Terminated: Exit Code: 1")
