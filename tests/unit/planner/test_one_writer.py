"""Nomad is written from one place (issue 19, "One applier, the only writer"): no module
of planner/ but the applier (and the client itself) calls a NomadClient's writes.

Found by reading the code (AST): a call `<x>.register|scale|revert|deregister|evaluate(...)`
whose receiver names a Nomad client (`nomad`, `self.nomad`, `self._nomad`, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[3] / "planner"
WRITES = frozenset({"register", "scale", "revert", "deregister", "evaluate"})
ALLOWED = frozenset({"daemon/applier.py", "nomad_client.py"})
# Modules still to be converted to effects (issue 19): none left. A module added here
# must write Nomad today (the last test), so the set says what is left to do.
UNTIL_CONVERTED: frozenset[str] = frozenset()


def nomad_writes(source: str) -> list[tuple[int, str]]:
    """(line, call) of each Nomad write in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in WRITES
            and "nomad" in ast.unparse(node.func.value).lower()
        ):
            found.append((node.lineno, ast.unparse(node.func)))
    return found


def writers() -> dict[str, list[tuple[int, str]]]:
    return {
        str(path.relative_to(PLANNER)): calls
        for path in sorted(PLANNER.rglob("*.py"))
        if (calls := nomad_writes(path.read_text()))
    }


def test_the_finder_sees_each_form_of_a_nomad_write() -> None:
    source = (
        "nomad.register(job)\nself.nomad.scale(n, g, 1, m)\nself._nomad.evaluate(n)\n"
        "applier.nomad.revert(n, 1, 2)\nconsul.register(s)\nself.registry.register(c)\n"
    )
    assert [call for _, call in nomad_writes(source)] == [
        "nomad.register",
        "self.nomad.scale",
        "self._nomad.evaluate",
        "applier.nomad.revert",
    ]


def test_only_the_applier_writes_nomad() -> None:
    outside = {
        module: calls
        for module, calls in writers().items()
        if module not in ALLOWED | UNTIL_CONVERTED
    }
    assert outside == {}, "write Nomad through planner.daemon.applier.Applier"


def test_the_allowed_until_converted_set_holds_only_writers() -> None:
    """A module converted leaves the set (so the set says what is left to convert)."""
    assert set(writers()) >= UNTIL_CONVERTED
