"""Format the diff in a Nomad plan response as `nomad job plan` shows it.

Called by `planner apply --dry-run`. Input: the `Diff` object of
/v1/job/:id/plan (Type, Fields, Objects, TaskGroups, Tasks; each field
{Type, Name, Old, New}); output: indented lines with +, -, +/- markers.
"""

from __future__ import annotations

from typing import Any

_MARK = {"Added": "+", "Deleted": "-", "Edited": "+/-", "None": " "}


def _field(field: dict[str, Any], indent: str) -> str:
    mark = _MARK.get(field.get("Type", "None"), "?")
    if field.get("Type") == "Edited":
        return f'{indent}{mark} {field["Name"]}: "{field["Old"]}" => "{field["New"]}"'
    value = field["New"] if field.get("Type") == "Added" else field.get("Old", "")
    return f'{indent}{mark} {field["Name"]}: "{value}"'


def _object(obj: dict[str, Any], indent: str, kind: str = "") -> list[str]:
    if obj.get("Type", "None") == "None":
        return []
    mark = _MARK.get(obj.get("Type", "None"), "?")
    label = f'{kind}: "{obj["Name"]}"' if kind else f"{obj.get('Name', '')} {{"
    lines = [f"{indent}{mark} {label}"]
    inner = indent + "  "
    lines += [_field(f, inner) for f in obj.get("Fields") or [] if f.get("Type") != "None"]
    for child in obj.get("Objects") or []:
        lines += _object(child, inner)
    for group in obj.get("TaskGroups") or []:
        lines += _object(group, inner, "Task Group")
    for task in obj.get("Tasks") or []:
        lines += _object(task, inner, "Task")
    if not kind:
        lines.append(f"{indent}  }}")
    return lines


def format_diff(diff: dict[str, Any] | None) -> list[str]:
    """Lines describing a job diff; ['(no changes)'] when Nomad sees none."""
    if not diff or diff.get("Type", "None") == "None":
        return ["(no changes)"]
    return _object({**diff, "Name": diff.get("ID", "")}, "", "Job")
