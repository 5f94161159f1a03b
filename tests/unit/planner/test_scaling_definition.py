"""`scaling:` in a model file (issue 22): validation, the record, and what `apply` makes
of a change of bounds (never a rollout: the bounds and the count stay out of the spec
hash, and the registration keeps the count the scaler set, within the new bounds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw_contract import ScalingBounds
from planner.cli.apply import Action, decide
from planner.spec.definitions import ModelDefinition, parse_file
from planner.spec.jobspec import record_of, scaling_of, spec_hash, variables
from planner.spec.settings import Settings
from tests.support.nomad_mock import job

BASE = "name: m\nsource: hf://org/repo/m.gguf\nprofile: {memory: 1GiB}\n"


def errors_of(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "m.yaml"
    path.write_text(BASE + text)
    definition, problems = parse_file(path)
    assert (definition is None) == bool(problems)
    return [f"{p.field}: {p.message}" for p in problems]


def test_scaling_sets_replicas_to_its_floor_and_leaves_the_definition_hash(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(BASE + "scaling: {min: 2, max: 4, target: 1.5, down_after: 2m}\n")
    definition, problems = parse_file(path)
    assert problems == [] and definition is not None
    assert definition.replicas == 2
    assert definition.record().scaling == ScalingBounds(
        min=2, max=4, target=1.5, window=30, up_after=15, down_after=120
    )
    fixed = ModelDefinition.model_validate(
        {"name": "m", "source": "hf://org/repo/m.gguf", "profile": {"memory": "1GiB"}}
    )
    assert definition.definition_hash == fixed.definition_hash


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "scaling: {min: 3, max: 2, target: 1}\n",
            ["scaling: min must not exceed max (got min 3, max 2)"],
        ),
        (
            "scaling: {min: 1, max: 101, target: 1}\n",
            ["scaling.max: Input should be less than or equal to 100 (got 101)"],
        ),
        (
            "scaling: {min: 1, max: 2, target: 0}\n",
            ["scaling.target: Input should be greater than 0"],
        ),
        (
            "scaling: {min: 1, max: 2, target: 1, up_after: soon}\n",
            ["scaling.up_after: expected a duration such as 90s or 10m, got 'soon'"],
        ),
        (
            "scaling: {min: 1, max: 2, target: 1, window: 11m}\n",
            ["scaling.window: expected at most 10m, got 660 s"],
        ),
        (
            "scaling: {min: 1, max: 2, targte: 1}\n",
            [
                "scaling.target: Field required",
                "scaling.targte: unknown field (expected one of: min, max, target, window, "
                "up_after, down_after); did you mean 'target'?",
            ],
        ),
        (
            "replicas: 2\nscaling: {min: 1, max: 2, target: 1}\n",
            [
                "replicas: replicas is a fixed count; a model with scaling has min and max "
                "instead (remove replicas)"
            ],
        ),
        (
            "on_demand: {idle_after: 1m}\nscaling: {min: 1, max: 2, target: 1}\n",
            [
                "scaling.min: on_demand scales an unused model to 0, so its min is 0 (got 1); "
                "remove on_demand to keep at least min replicas"
            ],
        ),
        (
            "scaling: {min: 0, max: 2, target: 1}\n",
            [
                "scaling.min: min 0 needs on_demand: {idle_after: ...} (it says when the last "
                "replica stops; demand alone never scales below 1)"
            ],
        ),
    ],
)
def test_scaling_is_validated_with_file_field_and_expectation(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    assert sorted(errors_of(tmp_path, text)) == sorted(expected)


def test_on_demand_with_min_0_starts_one_when_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(BASE + "on_demand: {idle_after: 1m}\nscaling: {min: 0, max: 3, target: 2}\n")
    definition, problems = parse_file(path)
    assert problems == [] and definition is not None
    assert definition.replicas == 1
    values = variables(definition, Settings())
    assert (values["replicas"], values["defined_replicas"]) == (0, 1)


def scaled(bounds: ScalingBounds | None, count: int, spec: str = "s1", **meta: str) -> dict:
    """A job as rendered (or registered) with these bounds in its service meta."""
    served: dict[str, Any] = job(count=count, meta={"llmgw_spec_hash": spec, **meta})
    service_meta = {"llmgw_replicas": str(max(bounds.min, 1) if bounds else count)}
    service_meta["llmgw_scaling"] = bounds.model_dump_json() if bounds else ""
    served["TaskGroups"][0]["Tasks"] = [{"Services": [{"Meta": service_meta}]}]
    served["TaskGroups"][0]["Update"] = {"Canary": count, "AutoPromote": True}
    return served


B14 = ScalingBounds(min=1, max=4, target=2)


def test_bounds_and_count_stay_out_of_the_spec_hash() -> None:
    assert spec_hash(scaled(B14, 1)) == spec_hash(scaled(B14.model_copy(update={"max": 8}), 3))
    assert scaling_of(scaled(B14, 1)) == B14
    assert scaling_of(scaled(None, 1)) is None


def test_a_change_of_bounds_is_an_update_in_place_that_keeps_the_scalers_count() -> None:
    registered = scaled(B14, 3)  # the scaler made it 3
    wider = B14.model_copy(update={"max": 8, "target": 3})
    [change] = decide({"m": scaled(wider, 1)}, {"m": registered}, prune=False)
    assert change.action is Action.UPDATE
    assert change.reason == "scaling max 4 -> 8, target 2 -> 3"
    # A window alone is named too (issue 22's fourth QA: "1..2 (target 1) -> 1..2 (target
    # 1)" told nothing).
    slower = B14.model_copy(update={"down_after": B14.down_after + 1})
    [window] = decide({"m": scaled(slower, 1)}, {"m": registered}, prune=False)
    assert window.reason == f"scaling down_after {B14.down_after}s -> {B14.down_after + 1}s"
    [fixed] = decide({"m": scaled(None, 1)}, {"m": registered}, prune=False)
    assert fixed.reason.startswith("scaling 1..4 (target 2) -> none"), fixed.reason
    assert change.job is not None
    assert change.job["TaskGroups"][0]["Count"] == 3
    # The definition hash (job meta) is the same: no canaries are asked for a new one.
    assert (
        change.job["Meta"]["llmgw_definition_hash"] == registered["Meta"]["llmgw_definition_hash"]
    )


def test_bounds_that_exclude_the_count_move_it_inside() -> None:
    narrower = B14.model_copy(update={"max": 2})
    [change] = decide({"m": scaled(narrower, 1)}, {"m": scaled(B14, 4)}, prune=False)
    assert change.job is not None and change.job["TaskGroups"][0]["Count"] == 2
    higher = B14.model_copy(update={"min": 3})
    [change] = decide({"m": scaled(higher, 3)}, {"m": scaled(B14, 1)}, prune=False)
    assert change.job is not None and change.job["TaskGroups"][0]["Count"] == 3


def test_the_same_bounds_and_a_scaled_count_are_unchanged() -> None:
    [change] = decide({"m": scaled(B14, 1)}, {"m": scaled(B14, 3)}, prune=False)
    assert change.action is Action.UNCHANGED


def test_the_record_is_restored_from_the_job_with_its_bounds() -> None:
    record = {"name": "m", "definition_hash": "d1", "replicas": 0}
    registered = scaled(B14, 2, llmgw_record=json.dumps(record))
    assert record_of(registered).scaling == B14
    assert record_of(registered).replicas == 1
