"""The Markdown a CI job posts on a merge request (planner.cli.planmarkdown)."""

from __future__ import annotations

from planner.cli.apply import Action, Change, Outcome
from planner.cli.planmarkdown import cell, error_markdown, heading, outcomes_markdown


def outcome(model: str, action: Action, reason: str = "why", plan: dict | None = None) -> Outcome:
    return Outcome(Change(model, action, reason), plan=plan)


def test_the_heading_counts_what_would_change_as_terraform_plan_does() -> None:
    outcomes = [
        outcome("a", Action.CREATE),
        outcome("b", Action.UPDATE),
        outcome("c", Action.DEREGISTER),
        outcome("d", Action.UNCHANGED),
        outcome("e", Action.ORPHANED),
    ]
    assert heading(outcomes, dry_run=True) == "llmgw plan: 1 to create, 1 to update, 1 to remove"
    assert heading(outcomes, dry_run=False) == "llmgw apply: 1 created, 1 updated, 1 removed"
    assert heading([outcome("d", Action.UNCHANGED)], dry_run=True) == "llmgw plan: no changes"
    assert "1 refused" in heading([outcome("r", Action.ROLLED_BACK)], dry_run=True)
    assert heading([outcome("g", Action.ENGINE_UNKNOWN)], dry_run=True) == (
        "llmgw plan: 1 refused (engine not defined)"
    )


def test_a_plan_lists_every_model_and_folds_nomads_diff_and_warns_of_no_placement() -> None:
    plan = {
        "Diff": {
            "Type": "Edited",
            "ID": "a",
            "Fields": [{"Type": "Edited", "Name": "Meta[x]", "Old": "1", "New": "2"}],
        },
        "FailedTGAllocs": {
            "server": {
                "NodesEvaluated": 1,
                "NodesFiltered": 1,
                "ConstraintFiltered": {"missing devices": 1},
            }
        },
    }
    text = outcomes_markdown(
        [
            outcome("a", Action.UPDATE, "profile | changed", plan),
            outcome("d", Action.UNCHANGED, "no changes"),
        ],
        dry_run=True,
    )
    assert text.startswith("### llmgw plan: 1 to update\n\n| model | action | reason |\n")
    assert "| `a` | **update** | profile \\| changed |" in text
    assert "| `d` | unchanged | no changes |" in text
    assert "<details><summary><code>a</code>: Nomad's plan</summary>" in text
    assert '+/- Meta[x]: "1" => "2"' in text
    assert "> `a` would not be placed:" in text


def test_a_dry_run_table_has_the_memory_estimate_column_the_plain_table_has() -> None:
    """QA on issue 11: the Markdown plan lacked the plain table's memory estimate."""
    text = outcomes_markdown(
        [outcome("a", Action.CREATE), outcome("d", Action.UNCHANGED)],
        dry_run=True,
        estimates={"a": "1.2 GiB of 2 GiB: fits"},
    )
    assert "| model | action | reason | memory estimate |\n|---|---|---|---|\n" in text
    assert "| `a` | **create** | why | 1.2 GiB of 2 GiB: fits |" in text
    assert "| `d` | unchanged | why |  |" in text


def test_a_dry_run_table_has_the_slots_column_the_plain_table_has() -> None:
    text = outcomes_markdown(
        [outcome("a", Action.CREATE)],
        dry_run=True,
        estimates={"a": "≈ 67 MiB"},
        serving={"a": "2 x 256 tokens"},
    )
    assert "| model | action | reason | slots x context | memory estimate |\n" in text
    assert "| `a` | **create** | why | 2 x 256 tokens | ≈ 67 MiB |" in text


def test_cells_and_errors_stay_one_table_row_each() -> None:
    assert cell("a|b\nc") == "a\\|b<br>c"
    text = error_markdown("x", [{"file": "m/a.yaml", "field": "", "message": "empty file"}])
    assert "| `m/a.yaml` |  | empty file |" in text
    assert error_markdown("Nomad did not answer", []).endswith("Nomad did not answer\n")
