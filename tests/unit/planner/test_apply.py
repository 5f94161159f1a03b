"""The apply decision: create, update, unchanged, parked, prune."""

from __future__ import annotations

import json

from llmgw_contract import JobMeta, Parked
from planner.cli.apply import Action, decide, dropped_engine, registration
from planner.model.effects import Evaluate, Register
from planner.model.resurrect import MAX_OWN_READS, failed_elsewhere, unknown_failed
from tests.support.nomad_mock import alloc, job


def spec(s: str, **kw: object) -> dict:
    return job(meta={"llmgw_spec_hash": s}, **kw)


def test_decide_create_update_unchanged_and_prune() -> None:
    rendered = {
        "new": spec("s1"),
        "same": spec("s1"),
        "changed": spec("s2", definition_hash="d2"),
        "stopped": spec("s1"),
    }
    registered = {
        "same": spec("s1"),
        "changed": spec("s1"),
        "stopped": spec("s1", stop=True),
        "gone": spec("s1"),
    }
    changes = {c.model: c for c in decide(rendered, registered, prune=False)}
    assert changes["new"].action is Action.CREATE
    assert changes["same"].action is Action.UNCHANGED
    assert (changes["changed"].action, changes["changed"].reason) == (
        Action.UPDATE,
        "source or profile changed",
    )
    assert (changes["stopped"].action, changes["stopped"].reason) == (
        Action.UPDATE,
        "job was stopped",
    )
    assert changes["gone"].action is Action.ORPHANED
    pruned = {c.model: c for c in decide(rendered, registered, prune=True)}
    assert pruned["gone"].action is Action.DEREGISTER


def test_a_parked_model_stays_parked_until_its_definition_changes() -> None:
    parked = {"m": Parked(reason="5 consecutive start failures", definition_hash="d1")}
    registered = {"m": spec("s1", stop=True)}
    [same] = decide({"m": spec("s1")}, registered, prune=False, parked=parked)
    assert same.action is Action.PARKED
    [replicas] = decide({"m": spec("s2")}, registered, prune=False, parked=parked)
    assert replicas.action is Action.UPDATE and replicas.job["Stop"] is True
    assert not replicas.unpark
    [changed] = decide(
        {"m": spec("s3", definition_hash="d2")}, registered, prune=False, parked=parked
    )
    assert changed.action is Action.UPDATE and changed.unpark


def test_models_gone_from_git_are_listed_until_pruned_then_purged() -> None:
    """Found by a new user: a parked job, or one an operator stopped, dropped from git was
    listed nowhere, and the leader kept restoring its record."""
    parked = {"p": Parked(reason="5 consecutive start failures", definition_hash="d1")}
    registered = {"p": spec("s1", stop=True), "s": spec("s1", stop=True), "r": spec("s1")}
    listed = {
        c.model: c
        for c in decide(
            {}, registered, prune=False, parked=parked, records={"p", "s", "r", "nojob"}
        )
    }
    assert {name: c.action for name, c in listed.items()} == dict.fromkeys(
        ("nojob", "p", "r", "s"), Action.ORPHANED
    )
    assert listed["p"].reason.startswith("parked; ") and "to remove it" in listed["p"].reason
    assert listed["s"].reason.startswith("stopped; ")
    assert listed["r"].reason.endswith("--prune to stop it")
    assert listed["nojob"].reason.startswith("no Nomad job; ")
    pruned = {
        c.model: (c.action, c.purge)
        for c in decide({}, registered, prune=True, parked=parked, records={"nojob"})
    }
    assert pruned == {
        "p": (Action.DEREGISTER, True),
        "s": (Action.DEREGISTER, True),
        "r": (Action.DEREGISTER, True),
        "nojob": (Action.DEREGISTER, False),
    }


def test_a_replica_count_change_alone_is_an_update_that_keeps_the_spec_hash() -> None:
    """Found by a new user: replicas 1 -> 2 replaced the first replica (the count was in
    the job's meta, which Nomad compares)."""
    rendered = {"m": spec("s1", count=3)}
    [change] = decide(rendered, {"m": spec("s1", count=1)}, prune=False)
    assert (change.action, change.reason) == (Action.UPDATE, "replicas 1 -> 3")


def test_each_change_carries_the_index_its_registration_is_checked_against() -> None:
    """Issue 19: apply registers with EnforceIndex at the JobModifyIndex it read (0 for
    a model Nomad has no job of), and keeps the rendered job to decide again from."""
    rendered = {"new": spec("s1"), "changed": spec("s2")}
    registered = {"changed": spec("s1", JobModifyIndex=42), "gone": spec("s1", JobModifyIndex=7)}
    changes = {c.model: c for c in decide(rendered, registered, prune=True)}
    assert (changes["new"].job_index, changes["changed"].job_index, changes["gone"].job_index) == (
        0,
        42,
        7,
    )
    assert changes["changed"].rendered == rendered["changed"]
    assert changes["gone"].rendered is None


def engine_spec(
    s: str, engine: str = "llama.cpp", version: str | None = "11434", **kw: object
) -> dict:
    """A model job running `engine`, constrained on `version` (None: an LLMGW_ENGINES
    engine, no constraint), its record in the meta as `planner apply` writes it."""
    record = json.dumps(
        {"name": "m", "definition_hash": "d1", "replicas": 1, "profile": {"engine": engine}}
    )
    made = job(meta={"llmgw_spec_hash": s, "llmgw_record": record}, **kw)
    if version is not None:
        constraint = {
            "LTarget": f"${{meta.llmgw_engine_{engine}}}",
            "Operand": "=",
            "RTarget": version,
        }
        made["TaskGroups"] = [{**made["TaskGroups"][0], "Constraints": [constraint]}]
    return made


def test_an_apply_that_would_drop_the_engine_constraint_refuses_that_model() -> None:
    """Issue 20: Nomad's GC removed the engine's install job, so the model rendered
    without `${meta.llmgw_engine_llama.cpp} = 11434` (LLMGW_ENGINES names llama.cpp too):
    refused, never rolled out, naming the engine and what to run. A model moved to
    another engine, or to another version of its own, is an update as before."""
    registered = {name: engine_spec("s1") for name in ("m", "parked", "moved", "bumped")}
    registered["parked"] = engine_spec("s1", stop=True)
    rendered = {
        "m": engine_spec("s2", version=None),
        "parked": engine_spec("s2", version=None),
        "moved": engine_spec("s2", engine="other", version=None),
        "bumped": engine_spec("s2", version="11500"),
    }
    parked = {"parked": Parked(reason="5 consecutive start failures", definition_hash="d1")}
    changes = {c.model: c for c in decide(rendered, registered, prune=False, parked=parked)}
    for name in ("m", "parked"):
        assert changes[name].action is Action.ENGINE_UNKNOWN and changes[name].job is None
        assert changes[name].reason == (
            "its job runs engine llama.cpp 11434 (constraint ${meta.llmgw_engine_llama.cpp} "
            "= 11434), which is not defined now (no record in Consul KV, no install job in "
            "Nomad); applying would drop that constraint: run `planner engines apply` with "
            "llama.cpp's file first"
        )
    assert changes["moved"].action is Action.UPDATE
    assert changes["bumped"].action is Action.UPDATE
    assert dropped_engine(rendered["m"], None) is None


def test_a_parked_model_whose_job_was_purged_is_registered_again_still_parked() -> None:
    """Issue 20 item 5: `planner retry` needs a job; the apply it asks for must not
    un-park the same definition (five more starts of a definition that was parked)."""
    parked = {"m": Parked(reason="5 consecutive start failures", definition_hash="d1")}
    [same] = decide({"m": spec("s1", definition_hash="d1")}, {}, prune=False, parked=parked)
    assert same.action is Action.CREATE and same.job["Stop"] is True and not same.restart
    assert same.job["Meta"]["llmgw_parked_reason"] == "5 consecutive start failures"
    assert "still parked: run `planner retry m`" in same.reason
    [changed] = decide({"m": spec("s1", definition_hash="d2")}, {}, prune=False, parked=parked)
    assert changed.action is Action.CREATE and not changed.job.get("Stop")
    assert "lifts parking" in changed.reason


def with_canaries(made: dict, canaries: int) -> dict:
    made["TaskGroups"] = [{**made["TaskGroups"][0], "Update": {"Canary": canaries}}]
    return made


def test_lifting_parking_with_canaries_never_reschedules_the_old_definition() -> None:
    """Issue 19's QA (D1): a parked model applied with a new definition that rolls out
    with canaries is only registered; a forced reschedule would place the failed
    allocation of the old version again, at that version, five more times. A stopped
    job of the same definition, or one without canaries, is still placed again."""
    parked = {"m": Parked(reason="5 consecutive start failures", definition_hash="d1")}
    registered = {"m": spec("s1", stop=True)}
    [lifted] = decide(
        {"m": with_canaries(spec("s2", definition_hash="d2"), 1)},
        registered,
        prune=False,
        parked=parked,
    )
    assert lifted.unpark and [type(e) for e in registration(lifted)] == [Register]
    [no_canary] = decide(
        {"m": with_canaries(spec("s2", definition_hash="d2"), 0)},
        registered,
        prune=False,
        parked=parked,
    )
    assert [type(e) for e in registration(no_canary)] == [Register, Evaluate]
    assert registration(no_canary)[1].force_reschedule
    [stopped] = decide(
        {"m": with_canaries(spec("s1"), 1)}, {"m": spec("s1", stop=True)}, prune=False
    )
    assert stopped.restart and [type(e) for e in registration(stopped)] == [Register, Evaluate]


def test_a_stopped_job_started_with_a_new_definition_and_canaries_is_only_registered() -> None:
    """The whole kind of D1: a job an operator stopped, applied with another definition
    that rolls out with canaries, would have its failed allocations of the old definition
    placed again at their own version by a forced reschedule (planner.model.resurrect)."""
    stopped = {"m": spec("s1", stop=True)}
    [changed] = decide(
        {"m": with_canaries(spec("s2", definition_hash="d2"), 1)}, stopped, prune=False
    )
    assert changed.restart and changed.restarted_changed
    assert [type(e) for e in registration(changed)] == [Register]
    [no_canary] = decide(
        {"m": with_canaries(spec("s2", definition_hash="d2"), 0)}, stopped, prune=False
    )
    assert [type(e) for e in registration(no_canary)] == [Register, Evaluate]


def test_a_stopped_job_holding_a_failed_replica_of_an_older_definition_is_renewed() -> None:
    """Stopped during a rollout, the job kept a failed replica of the definition before
    (apply reads them: planner.model.resurrect.failed_elsewhere): the same definition is
    registered renewed, a version that replaces every allocation, and nothing is forced."""
    [same] = decide(
        {"m": with_canaries(spec("s1"), 1)},
        {"m": spec("s1", stop=True, JobModifyIndex=33)},
        prune=False,
    )
    assert same.restart and not same.restarted_changed
    [register] = registration(same, stale=("a0",))
    assert isinstance(register, Register)
    assert register.job["Meta"][JobMeta.RENEWED] == "33"
    assert [type(e) for e in registration(same)] == [Register, Evaluate]


def test_an_earlier_definition_applied_again_over_its_failed_replica_is_renewed() -> None:
    """Issue 19's third QA: A parked, B parked, A applied again. A's first failed replica
    (job version 0, A's very job) still holds its place: registered as it is, A is no
    update of it, Nomad places nothing and the model parks again with 0 starts. Any
    failed replica holding its place makes the registration a renewal."""
    parked = {"m": Parked(reason="5 consecutive start failures", definition_hash="d2")}
    registered = {"m": spec("s2", definition_hash="d2", stop=True, JobModifyIndex=70)}
    [again] = decide({"m": with_canaries(spec("s1"), 1)}, registered, prune=False, parked=parked)
    assert again.unpark
    [register] = registration(again, stale=("b0",), held=("a0", "b0"))
    assert isinstance(register, Register) and register.job["Meta"][JobMeta.RENEWED] == "70"
    [only_a] = registration(again, held=("a0",))
    assert isinstance(only_a, Register) and only_a.job["Meta"][JobMeta.RENEWED] == "70"


def test_failed_elsewhere_reads_the_versions_nomad_keeps() -> None:
    versions = [job(definition_hash="d2", Version=5), job(definition_hash="d1", Version=4)]
    allocations = [
        alloc("at4", version=4, client="failed"),
        alloc("at5", version=5, client="failed"),
        alloc("at1", version=1, client="failed"),  # a version Nomad dropped
        alloc("stopped", version=4, client="failed", desired="stop"),
    ]
    assert failed_elsewhere("d2", versions, allocations) == ("at1", "at4")
    assert failed_elsewhere("d1", versions, allocations) == ("at1", "at5")


def renewed_at(registered: dict, marker: str) -> dict:
    return {**registered, "Meta": {**registered["Meta"], JobMeta.RENEWED: marker}}


def test_an_update_of_the_count_keeps_the_renewal_marker() -> None:
    """Reviewer's finding on issue 19's QA fix: apply rendered the job without the marker a
    retry's renewal set, a meta change Nomad takes as a destructive update (a canary for
    every replica) where a new count is an in-place one."""
    registered = {"m": renewed_at(spec("s1", count=1), "33")}
    [more] = decide({"m": spec("s1", count=2)}, registered, prune=False)
    assert (more.action, more.reason) == (Action.UPDATE, "replicas 1 -> 2")
    assert more.job["Meta"][JobMeta.RENEWED] == "33"
    [template] = decide({"m": spec("s2")}, registered, prune=False)
    assert template.job["Meta"][JobMeta.RENEWED] == "33"
    # Another definition replaces every replica anyway: the marker goes.
    [changed] = decide({"m": spec("s2", definition_hash="d2")}, registered, prune=False)
    assert changed.action is Action.UPDATE and JobMeta.RENEWED not in changed.job["Meta"]
    [same] = decide({"m": spec("s1")}, registered, prune=False)
    assert same.action is Action.UNCHANGED
    # A never-renewed job gets none.
    [plain] = decide({"m": spec("s1", count=2)}, {"m": spec("s1")}, prune=False)
    assert JobMeta.RENEWED not in plain.job["Meta"]


def test_a_renewal_kept_gives_way_to_a_new_one() -> None:
    stopped = {"m": renewed_at(spec("s1", stop=True, JobModifyIndex=50), "33")}
    [again] = decide({"m": with_canaries(spec("s1"), 1)}, stopped, prune=False)
    assert again.job["Meta"][JobMeta.RENEWED] == "33"
    [register] = registration(again, stale=("a0",))
    assert isinstance(register, Register) and register.job["Meta"][JobMeta.RENEWED] == "50"


def test_failed_elsewhere_judges_a_version_nomad_dropped_by_the_allocations_own_job() -> None:
    """Reviewer's finding on issue 22: a scaling model makes a version per scale, so a
    failed replica of the current definition soon has a version Nomad no longer keeps;
    taken as older, `planner retry` renewed (replaced every serving replica) instead of
    placing it again. Its own job (GET /v1/allocation/:id) says which it is."""
    versions = [job(definition_hash="d2", Version=9)]
    allocations = [
        alloc("mine", version=2, client="failed"),
        alloc("older", version=1, client="failed"),
        alloc("unread", version=1, client="failed"),
        alloc("live", version=1),
    ]
    own = {"mine": "d2", "older": "d1"}
    assert failed_elsewhere("d2", versions, allocations, own) == ("older", "unread")
    assert unknown_failed(versions, allocations) == ("mine", "older", "unread")
    many = [alloc(f"f{i:02}", version=1, client="failed") for i in range(MAX_OWN_READS + 3)]
    assert len(unknown_failed(versions, many)) == MAX_OWN_READS
    assert unknown_failed([*versions, job(Version=1)], allocations) == ("mine",)
