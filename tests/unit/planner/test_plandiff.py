"""The plan diff, as `nomad job plan` prints it."""

from __future__ import annotations

from planner.cli.plandiff import format_diff


def test_plan_diff_reads_like_nomad() -> None:
    diff = {
        "Type": "Edited",
        "ID": "m",
        "Fields": [{"Type": "Edited", "Name": "Meta[x]", "Old": "1", "New": "2"}],
        "TaskGroups": [
            {
                "Type": "Edited",
                "Name": "server",
                "Fields": [
                    {"Type": "Edited", "Name": "Count", "Old": "1", "New": "2"},
                    {"Type": "None", "Name": "Same", "Old": "a", "New": "a"},
                ],
            }
        ],
    }
    assert format_diff(diff) == [
        '+/- Job: "m"',
        '  +/- Meta[x]: "1" => "2"',
        '  +/- Task Group: "server"',
        '    +/- Count: "1" => "2"',
    ]
    assert format_diff({"Type": "None"}) == ["(no changes)"]
