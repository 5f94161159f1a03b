"""Parking's durable record (job meta) and its KV copy."""

from __future__ import annotations

from llmgw_contract import Parked, StateDocument
from planner.model.parking import parked_from_job, set_parked
from tests.support.nomad_mock import job


def test_the_kv_copy_of_parking_follows_the_newest_nomad_answer() -> None:
    parked = Parked(reason="5 consecutive start failures")
    state = set_parked(StateDocument(name="m", consecutive_failures=5), parked, job_index=20)
    assert state.parked == parked and state.job_index == 20
    # A retry registered at 30 lifts it; a park decided on an older read (25) comes late.
    lifted = set_parked(state, None, 30)
    assert lifted.parked is None and lifted.consecutive_failures == 0
    assert set_parked(lifted, parked, 25) == lifted


def test_unparking_is_never_refused_by_an_index_lower_than_remembered() -> None:
    # A Nomad index reset (rebuilt servers): the job's indexes start over (issue 19).
    parked = Parked(reason="5 consecutive start failures")
    state = set_parked(StateDocument(name="m", consecutive_failures=5), parked, 5000)
    lifted = set_parked(state, None, 12)
    assert lifted.parked is None and lifted.job_index == 12


def test_parking_is_read_from_the_job_meta() -> None:
    meta = {"llmgw_parked_reason": "r", "llmgw_parked_last_error": "e", "llmgw_parked_since": "t"}
    assert parked_from_job(job(meta=meta)) == Parked(
        reason="r", last_error="e", since="t", definition_hash="d1"
    )
    assert parked_from_job(job()) is None and parked_from_job(None) is None
