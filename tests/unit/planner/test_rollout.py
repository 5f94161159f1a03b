"""Rolled-back updates read from Nomad's job versions and deployments (planner.model.rollout),
and what apply decides for a rolled-back definition."""

from __future__ import annotations

from datetime import UTC, datetime

from llmgw_contract import StateDocument, UpdateFailed
from planner.cli.apply import Action, _rolled_back, decide
from planner.model.rollout import (
    for_applied,
    record_rollback,
    recorded_rollback,
    rolled_back,
    stuck_update,
)
from tests.support.nomad_mock import job

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
FAILED = "Failed due to unhealthy allocations - rolling back to job version 0"


def version(number: int, definition: str) -> dict:
    return {"Version": number, "CreateIndex": 10, "Meta": {"llmgw_definition_hash": definition}}


def deployment(
    number: int, status: str, created: int = 10, index: int = 0, description: str = FAILED
) -> dict:
    return {
        "JobVersion": number,
        "JobCreateIndex": created,
        "Status": status,
        "StatusDescription": description,
        "CreateIndex": index or 100 + number,
    }


# Nomad after an auto-revert: v0 good (stable), v1 bad (failed), v2 = v0 again.
REVERTED = [version(2, "good"), version(1, "bad"), version(0, "good")]


def test_a_reverted_definition_is_rolled_back_with_nomads_reason() -> None:
    deployments = [
        deployment(0, "successful"),
        deployment(1, "failed"),
        deployment(2, "successful"),
    ]
    failed = rolled_back(REVERTED, deployments, "bad")
    assert failed == UpdateFailed(definition_hash="bad", job_version=1, reason=FAILED)


def test_the_running_definition_or_one_never_deployed_is_not_rolled_back() -> None:
    deployments = [deployment(1, "failed")]
    assert rolled_back(REVERTED, deployments, "good") is None
    assert rolled_back(REVERTED, deployments, "other") is None
    assert rolled_back([], deployments, "bad") is None


def test_an_update_replaced_by_a_newer_one_is_not_a_rollback() -> None:
    # v1 "bad" was cancelled by an apply of v2 (not failed): nothing was rolled back.
    assert rolled_back(REVERTED, [deployment(1, "cancelled")], "bad") is None


def test_deployments_of_an_earlier_job_of_the_same_name_do_not_count() -> None:
    assert rolled_back(REVERTED, [deployment(1, "failed", created=3)], "bad") is None


def test_recording_a_rollback_moves_the_count_and_judges_by_the_running_definition() -> None:
    state = StateDocument(
        name="m",
        definition_hash="bad",
        consecutive_failures=5,
        last_error="unknown model architecture: 'kev'",
    )
    failed = UpdateFailed(definition_hash="bad", job_version=1, reason=FAILED)
    after = record_rollback(state, failed, "good", NOW)
    assert after.definition_hash == "good" and after.consecutive_failures == 0
    assert after.update_failed is not None
    assert (
        after.update_failed.consecutive_failures,
        after.update_failed.last_error,
        after.update_failed.since,
    ) == (5, state.last_error, "2026-11-30T12:00:00+00:00")
    assert record_rollback(after, failed, "good", NOW) == after  # once
    # Still applied, the rolled-back definition keeps the state judged by the running one.
    assert for_applied(after, "bad") == after
    # Another definition applied: the rollback is forgotten and counting starts over.
    fixed = for_applied(after, "fixed")
    assert (fixed.definition_hash, fixed.update_failed) == ("fixed", None)


def test_a_failed_update_nomad_could_not_revert_goes_back_to_the_serving_version() -> None:
    current = {"Version": 1, "CreateIndex": 10}
    allocs = [
        {"ID": "old", "JobVersion": 0, "DesiredStatus": "run", "ClientStatus": "running"},
        {"ID": "new", "JobVersion": 1, "DesiredStatus": "run", "ClientStatus": "failed"},
    ]
    failed = [deployment(0, "cancelled"), deployment(1, "failed")]
    assert stuck_update(current, failed, allocs, frozenset({"old"})) == 0
    assert stuck_update(current, failed, allocs, frozenset()) is None  # nothing serves
    assert stuck_update(current, [deployment(1, "running")], allocs, frozenset({"old"})) is None


def test_apply_does_not_try_a_rolled_back_definition_again() -> None:
    rendered = {"m": job(meta={"llmgw_spec_hash": "s2", "llmgw_definition_hash": "bad"})}
    registered = {"m": job(meta={"llmgw_spec_hash": "s1", "llmgw_definition_hash": "good"})}
    failed = UpdateFailed(definition_hash="bad", job_version=1, reason=FAILED)
    [change] = decide(rendered, registered, prune=False, rolled_back={"m": failed})
    assert change.action is Action.ROLLED_BACK and change.job is None
    assert FAILED in change.reason and "planner retry m" in change.reason


# Nomad after a rollback and six scales: the failed version is no longer kept (it keeps the
# last 6, structs.JobTrackedVersions), only versions of the good definition are.
CHURNED = [version(n, "good") for n in range(8, 2, -1)]
RECORDED = UpdateFailed(definition_hash="bad", job_version=1, reason=FAILED)


def test_a_rollback_nomad_no_longer_keeps_is_known_from_the_state_document() -> None:
    """Reviewer's finding on issue 22: every scale makes a job version; after six, Nomad's
    versions no longer show the failed one, and the next apply tried it again."""
    assert rolled_back(CHURNED, [deployment(1, "failed")], "bad") is None
    assert recorded_rollback(RECORDED, "good", "bad") == RECORDED
    assert recorded_rollback(RECORDED, "bad", "bad") is None  # it runs: not rolled back
    assert recorded_rollback(RECORDED, "good", "other") is None
    assert recorded_rollback(None, "good", "bad") is None


class VersionsOnly:
    """Nomad's versions and deployments of one job (all `_rolled_back` reads)."""

    def __init__(self, versions: list[dict], deployments: list[dict]) -> None:
        self._versions, self._deployments = versions, deployments

    def versions(self, name: str) -> list[dict]:
        return self._versions

    def deployments(self, name: str) -> list[dict]:
        return self._deployments


def test_apply_refuses_a_rolled_back_definition_after_the_versions_churned() -> None:
    rendered = {"m": job(definition_hash="bad")}
    registered = {"m": job(definition_hash="good", Version=8)}
    nomad = VersionsOnly(CHURNED, [deployment(1, "failed")])
    found = _rolled_back(rendered, registered, nomad, {"m": RECORDED})  # type: ignore[arg-type]
    assert found == {"m": RECORDED}
    [change] = decide(rendered, registered, prune=False, rolled_back=found)
    assert change.action is Action.ROLLED_BACK
    # Without the record (a wiped KV), only what Nomad keeps is known.
    assert _rolled_back(rendered, registered, nomad, {}) == {}  # type: ignore[arg-type]
    # Another definition applied is not refused by the record of this one.
    other = {"m": job(definition_hash="fixed")}
    assert _rolled_back(other, registered, nomad, {"m": RECORDED}) == {}  # type: ignore[arg-type]
