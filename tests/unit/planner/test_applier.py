"""The applier's job writes: each checked against the index read (the next one against
the index the previous answered), a lost check is Stale, any other refusal is raised.

Nomad here is a recorder (a lost EnforceIndex race cannot be produced on demand by a
real agent in a unit test; tests/integration/test_writers.py loses it for real)."""

from __future__ import annotations

from typing import Any

import pytest

from planner.daemon.applier import Applier, Stale
from planner.errors import NomadRejected
from planner.model.effects import Evaluate, Reason, Register
from tests.support.nomad_mock import job


class Recorder:
    def __init__(self, refuse: str | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse = refuse

    def register(self, new: dict[str, Any], enforce_index: int | None = None) -> dict:
        self.calls.append(("register", new["ID"], enforce_index))
        if self.refuse:
            raise NomadRejected(self.refuse)
        return {"EvalID": "e1", "JobModifyIndex": 50}

    def evaluate(self, job_id: str, force_reschedule: bool = False) -> str:
        self.calls.append(("evaluate", job_id, force_reschedule))
        return "e2"


def test_a_register_is_checked_at_the_index_read_and_an_evaluation_follows() -> None:
    nomad = Recorder()
    answers = Applier(nomad).write_job(  # type: ignore[arg-type]
        "m",
        [
            Register(Reason.APPLY, "new model", job()),
            Evaluate(Reason.APPLY, "restart", force_reschedule=True),
        ],
        0,
    )
    assert nomad.calls == [("register", "m", 0), ("evaluate", "m", True)]
    assert answers == [{"EvalID": "e1", "JobModifyIndex": 50}, {"EvalID": "e2"}]


@pytest.mark.parametrize(
    "words",
    [
        "register job m: Nomad failed (HTTP 500: Enforcing job modify index 10: job exists "
        "with conflicting job modify index: 12)",
        "register job m: HTTP 400: job exists with conflicting job modify index: 12",
    ],
)
def test_a_lost_index_check_is_stale(words: str) -> None:
    with pytest.raises(Stale):
        Applier(Recorder(words)).write_job(  # type: ignore[arg-type]
            "m", [Register(Reason.APPLY, "update", job())], 10
        )


def test_any_other_refusal_is_raised_as_it_came() -> None:
    with pytest.raises(NomadRejected, match="count can't be negative"):
        Applier(Recorder("Task group count can't be negative")).write_job(  # type: ignore[arg-type]
            "m", [Register(Reason.APPLY, "update", job())], 10
        )


def test_an_applier_without_a_store_writes_jobs_only() -> None:
    with pytest.raises(TypeError, match="no StateStore"):
        Applier(Recorder()).update("m", lambda s: s)  # type: ignore[arg-type]
