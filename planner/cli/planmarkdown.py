"""Markdown for a merge request: what `planner apply` did or would do, or why it failed.

Called by `planner apply --output markdown` (and `status --output markdown`); pure:
outcomes in, one Markdown document out (GitHub- and GitLab-flavoured: a table,
and Nomad's plan diff per job in a collapsed `<details>` block, as a CI job
posts it as a merge request comment). The first line is a heading that counts
the changes, so a reviewer reads the verdict without opening anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from planner.cli.apply import MUTATIONS, REFUSALS, Action, Outcome
from planner.cli.plandiff import format_diff
from planner.model.placement import evaluation_reason
from planner.model.status import ModelStatus, headline

# How the heading counts each action that changes something, in `terraform plan` order.
_VERBS = (
    (Action.CREATE, "to create"),
    (Action.UPDATE, "to update"),
    (Action.DEREGISTER, "to remove"),
)
_DONE = {Action.CREATE: "created", Action.UPDATE: "updated", Action.DEREGISTER: "removed"}


def cell(text: Any) -> str:
    """A value fit for one table cell: pipes escaped, line breaks as <br>."""
    return str(text).replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def heading(outcomes: list[Outcome], dry_run: bool) -> str:
    """`llmgw plan: 1 to create, 1 to update, 1 to remove` (dry run), `llmgw apply: 1
    created` (a run), or `...: no changes`."""
    counts = Counter(o.change.action for o in outcomes)
    if dry_run:
        parts = [f"{counts[a]} {verb}" for a, verb in _VERBS if counts[a]]
    else:
        parts = [f"{counts[a]} {_DONE[a]}" for a, _ in _VERBS if counts[a]]
    refused = counts[Action.ROLLED_BACK]
    if refused:
        parts.append(f"{refused} refused (rolled back before)")
    unknown = counts[Action.ENGINE_UNKNOWN]
    if unknown:
        parts.append(f"{unknown} refused (engine not defined)")
    return f"llmgw {'plan' if dry_run else 'apply'}: {', '.join(parts) or 'no changes'}"


def outcomes_markdown(
    outcomes: list[Outcome],
    dry_run: bool,
    estimates: Mapping[str, str] | None = None,
    serving: Mapping[str, str] | None = None,
) -> str:
    """The whole document for one `apply` run. `estimates`: {model: its memory estimate
    as the table shows it (`Fit.text()`)}, `serving`: {model: its slots x context per
    request}, each a column as in the plain table when given (a dry run)."""
    lines = [f"### {heading(outcomes, dry_run)}", ""]
    if outcomes:
        columns = [
            (title, cells)
            for title, cells in (("slots x context", serving), ("memory estimate", estimates))
            if cells
        ]
        lines += _table(
            ("model", "action", "reason", *(title for title, _ in columns)),
            (
                (
                    f"`{o.change.model}`",
                    _action(o),
                    o.change.reason,
                    *(cells.get(o.change.model, "") for _, cells in columns),
                )
                for o in outcomes
            ),
        )
    else:
        lines.append("No model files, and no llmgw model in Nomad.")
    for o in outcomes:
        if o.plan is None or o.change.action not in MUTATIONS:
            continue
        unplaced = evaluation_reason(o.plan)
        if unplaced:
            lines += [
                "",
                f"> [!WARNING]\n> `{o.change.model}` would not be placed: {cell(unplaced)}",
            ]
        lines += [
            "",
            f"<details><summary><code>{o.change.model}</code>: Nomad's plan</summary>",
            "",
            "```diff",
            *format_diff(o.plan.get("Diff")),
            "```",
            "",
            "</details>",
        ]
    return "\n".join(lines) + "\n"


def _action(outcome: Outcome) -> str:
    action = outcome.change.action
    return f"**{action}**" if action in MUTATIONS or action in REFUSALS else action


def error_markdown(message: str, problems: list[dict[str, str]]) -> str:
    """A failed run: the message, and every problem of every file as a table."""
    lines = ["### llmgw plan failed", ""]
    if problems:
        lines += [f"{len(problems)} problem(s) in the model files; nothing was changed.", ""]
        lines += _table(
            ("file", "field", "problem"),
            (
                (f"`{p['file']}`", f"`{p['field']}`" if p["field"] else "", p["message"])
                for p in problems
            ),
        )
    else:
        lines.append(cell(message))
    return "\n".join(lines) + "\n"


def status_markdown(rows: list[ModelStatus]) -> str:
    """`planner status` as a table, headed by whether every model has what it should."""
    short = [r for r in rows if not r.satisfied]
    title = (
        f"{len(short)} of {len(rows)} model(s) short of what they should have"
        if short
        else f"all {len(rows)} model(s) have what they should"
    )
    lines = [f"### llmgw status: {title}", ""]
    lines += _table(
        ("model", "state", "desired", "ready", "failures", "reason", "last error"),
        (
            (
                f"`{r.name}`",
                f"**{r.state}**" if not r.satisfied else r.state,
                r.desired,
                r.ready,
                r.consecutive_failures,
                r.reason,
                headline(r.last_error),
            )
            for r in rows
        ),
    )
    return "\n".join(lines) + "\n"
