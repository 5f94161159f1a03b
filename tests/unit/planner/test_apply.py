"""The apply decision: create, update, unchanged, parked, prune."""

from __future__ import annotations

from llmgw_contract import Parked
from planner.apply import Action, decide
from tests.support.nomad_mock import job


def spec(s: str, **kw: object) -> dict:
    return job(meta={"llmgw_spec_hash": s}, **kw)


def test_decide_create_update_unchanged_and_prune() -> None:
    rendered = {"new": spec("s1"), "same": spec("s1"),
                "changed": spec("s2", definition_hash="d2"), "stopped": spec("s1")}
    registered = {"same": spec("s1"), "changed": spec("s1"), "stopped": spec("s1", stop=True),
                  "gone": spec("s1")}
    changes = {c.model: c for c in decide(rendered, registered, prune=False)}
    assert changes["new"].action is Action.CREATE
    assert changes["same"].action is Action.UNCHANGED
    assert (changes["changed"].action, changes["changed"].reason) == \
        (Action.UPDATE, "source or profile changed")
    assert (changes["stopped"].action, changes["stopped"].reason) == \
        (Action.UPDATE, "job was stopped")
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
    [changed] = decide({"m": spec("s3", definition_hash="d2")}, registered, prune=False,
                       parked=parked)
    assert changed.action is Action.UPDATE and changed.unpark


def test_a_parked_model_no_longer_in_git_stays_listed_until_pruned_then_is_purged() -> None:
    """Found by a new user: a parked job dropped from git was listed nowhere, and the
    leader kept restoring its record from the parking meta."""
    parked = {"p": Parked(reason="5 consecutive start failures", definition_hash="d1")}
    registered = {"p": spec("s1", stop=True), "pruned": spec("s1", stop=True)}
    [orphan] = decide({}, registered, prune=False, parked=parked)
    assert (orphan.model, orphan.action) == ("p", Action.ORPHANED)
    assert orphan.reason.startswith("parked; ") and "--prune to remove" in orphan.reason
    [gone] = decide({}, registered, prune=True, parked=parked)
    assert (gone.model, gone.action, gone.purge) == ("p", Action.DEREGISTER, True)
