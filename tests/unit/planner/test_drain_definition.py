"""`shutdown_delay:` in a model file (issue 22, items 2 and 6): validation, the job's
drain, and what `apply` makes of a change (an update in place, never a rollout: the
drain stays out of the definition hash and the spec hash, and is compared apart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from planner.cli.apply import Action, decide
from planner.spec.definitions import ModelDefinition, parse_file
from planner.spec.jobspec import DRAIN_HASHED_AS, drain_of, spec_hash, variables
from planner.spec.settings import Settings
from tests.support.nomad_mock import job

BASE = "name: m\nsource: hf://org/repo/m.gguf\nprofile: {memory: 1GiB}\n"
S = 1_000_000_000  # Nomad's durations are nanoseconds


def parsed(tmp_path: Path, text: str) -> tuple[ModelDefinition | None, list[str]]:
    path = tmp_path / "m.yaml"
    path.write_text(BASE + text)
    definition, problems = parse_file(path)
    return definition, [f"{p.file.name}: {p.field}: {p.message}" for p in problems]


def test_the_default_drain_is_kubernetes_grace_period_and_leaves_the_definition_hash(
    tmp_path: Path,
) -> None:
    default, _ = parsed(tmp_path, "")
    longer, _ = parsed(tmp_path, "shutdown_delay: 2m\n")
    assert default is not None and longer is not None
    assert (default.shutdown_delay, longer.shutdown_delay) == (30, 120)
    # What the server runs is the same: no rollout, parking not lifted.
    assert default.definition_hash == longer.definition_hash
    assert variables(default, Settings())["shutdown_delay"] == "30s"
    assert variables(longer, Settings())["shutdown_delay"] == "120s"


@pytest.mark.parametrize("text", ["shutdown_delay: 0s\n", "shutdown_delay: 0\n"])
def test_no_drain_is_allowed(tmp_path: Path, text: str) -> None:
    definition, problems = parsed(tmp_path, text)
    assert problems == [] and definition is not None and definition.shutdown_delay == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "shutdown_delay: 11m\n",
            "m.yaml: shutdown_delay: expected a duration from 0s to 10m, got 660 s",
        ),
        (
            "shutdown_delay: -1\n",
            "m.yaml: shutdown_delay: expected a duration from 0s to 10m, got -1 s",
        ),
        (
            "shutdown_delay: soon\n",
            "m.yaml: shutdown_delay: expected a duration such as 90s or 10m, got 'soon'",
        ),
        (
            "shutdown_dealy: 30s\n",
            "m.yaml: shutdown_dealy: unknown field (expected one of: name, source, sha256, "
            "profile, replicas, on_demand, scaling, shutdown_delay, restart_delay); did you "
            "mean 'shutdown_delay'?",
        ),
    ],
)
def test_a_drain_out_of_bounds_is_refused_naming_file_field_and_expectation(
    tmp_path: Path, text: str, expected: str
) -> None:
    definition, problems = parsed(tmp_path, text)
    assert definition is None and problems == [expected]


def drained(shutdown_s: float, kill_s: float = 15, count: int = 1, spec: str = "s1") -> dict:
    """A job as rendered (or registered) with this drain in its task."""
    served: dict[str, Any] = job(count=count, meta={"llmgw_spec_hash": spec})
    served["TaskGroups"][0]["Tasks"] = [
        {
            "Name": "llama-server",
            "ShutdownDelay": int(shutdown_s * S),
            "KillTimeout": int(kill_s * S),
        }
    ]
    return served


def test_the_drain_stays_out_of_the_spec_hash_and_is_read_from_the_task() -> None:
    assert spec_hash(drained(3, 5)) == spec_hash(drained(30, 15)) == spec_hash(drained(0, 5))
    assert drain_of(drained(30, 15)) == {"ShutdownDelay": 30 * S, "KillTimeout": 15 * S}
    # A job registered before the drain was a field (its template's 3 s, Nomad's default
    # 5 s) is hashed as rendered: it keeps its hash, and takes the new drain in place.
    assert drain_of(drained(3, 5)) == DRAIN_HASHED_AS
    assert drain_of(job()) == {"ShutdownDelay": 0, "KillTimeout": 5 * S}


def test_a_change_of_drain_is_an_update_in_place() -> None:
    registered = drained(3, 5, count=2)
    [change] = decide({"m": drained(30, 15, count=2)}, {"m": registered}, prune=False)
    assert change.action is Action.UPDATE
    assert change.reason == "shutdown_delay 3s -> 30s, kill_timeout 5s -> 15s"
    assert change.job is not None
    # Nothing Nomad compares for a destructive update moved: the job meta (the
    # definition and spec hashes) is the registered one, so no canary starts.
    assert change.job["Meta"] == registered["Meta"]
    [change] = decide({"m": drained(45, 15, count=3)}, {"m": drained(30, 15)}, prune=False)
    assert change.reason == "replicas 1 -> 3; shutdown_delay 30s -> 45s"


def test_the_same_drain_is_unchanged() -> None:
    [change] = decide({"m": drained(30)}, {"m": drained(30)}, prune=False)
    assert change.action is Action.UNCHANGED
