"""`restart_delay:` in a model file: validation, the template variable it renders, and
what `apply` makes of a change (a rollout that names it; never a lifted parking: the
pause stays out of the definition hash)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from planner.cli.apply import Action, decide
from planner.spec.jobspec import restart_delay_of, spec_hash, variable_file, variables
from planner.spec.settings import Settings
from tests.support.nomad_mock import job
from tests.unit.planner.test_drain_definition import S, parsed


def test_the_default_is_the_templates_old_5s_and_the_pause_leaves_the_definition_hash(
    tmp_path: Path,
) -> None:
    default, _ = parsed(tmp_path, "")
    quick, _ = parsed(tmp_path, "restart_delay: 1s\n")
    assert default is not None and quick is not None
    assert (default.restart_delay, quick.restart_delay) == (5, 1)
    # What the server runs is the same: a change never lifts parking.
    assert default.definition_hash == quick.definition_hash
    assert variables(default, Settings())["restart_delay"] == "5s"
    assert 'restart_delay = "1s"\n' in variable_file(variables(quick, Settings()))


@pytest.mark.parametrize(("text", "seconds"), [("1s", 1), ("4m", 240), ("90", 90)])
def test_a_pause_within_bounds_is_taken(tmp_path: Path, text: str, seconds: int) -> None:
    definition, problems = parsed(tmp_path, f"restart_delay: {text}\n")
    assert problems == [] and definition is not None and definition.restart_delay == seconds


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "restart_delay: 0s\n",
            "m.yaml: restart_delay: expected a duration from 1s to 4m, got 0 s",
        ),
        (
            "restart_delay: 5m\n",
            "m.yaml: restart_delay: expected a duration from 1s to 4m, got 300 s",
        ),
        (
            "restart_delay: -1\n",
            "m.yaml: restart_delay: expected a duration from 1s to 4m, got -1 s",
        ),
        (
            "restart_delay: 500ms\n",
            "m.yaml: restart_delay: expected a duration such as 90s or 10m, got '500ms'",
        ),
        (
            "restart_dealy: 1s\n",
            "m.yaml: restart_dealy: unknown field (expected one of: name, source, sha256, "
            "profile, replicas, on_demand, scaling, shutdown_delay, restart_delay); did you "
            "mean 'restart_delay'?",
        ),
    ],
)
def test_a_pause_out_of_bounds_is_refused_naming_file_field_and_expectation(
    tmp_path: Path, text: str, expected: str
) -> None:
    definition, problems = parsed(tmp_path, text)
    assert definition is None and problems == [expected]


def paused(delay_s: float, count: int = 1, spec: str = "s1") -> dict:
    """A job as rendered (or registered) with this restart delay in its group."""
    served: dict[str, Any] = job(count=count, meta={"llmgw_spec_hash": spec})
    served["TaskGroups"][0]["RestartPolicy"] = {
        "Attempts": 4,
        "Interval": 1800 * S,
        "Delay": int(delay_s * S),
        "Mode": "fail",
    }
    return served


def test_the_pause_is_in_the_spec_hash_and_read_from_the_group() -> None:
    # Unlike the drain, Nomad's clients take a new restart policy only for a new task.
    assert spec_hash(paused(5)) != spec_hash(paused(1))
    assert restart_delay_of(paused(1)) == 1 * S
    assert restart_delay_of(job()) == 0


def test_a_change_of_pause_is_an_update_that_names_it() -> None:
    [change] = decide({"m": paused(1, spec="s2")}, {"m": paused(5)}, prune=False)
    assert change.action is Action.UPDATE
    assert change.reason == "restart_delay 5s -> 1s"
    [change] = decide({"m": paused(1, count=3, spec="s2")}, {"m": paused(5)}, prune=False)
    assert change.reason == "restart_delay 5s -> 1s; replicas 1 -> 3"
    [change] = decide({"m": paused(5)}, {"m": paused(5)}, prune=False)
    assert change.action is Action.UNCHANGED
