"""The flag table (planner/engines/llama_server_flags.txt) against the real
`llama-server --help` of the pinned build: every option it lists is classified, as it
writes it, and the table names no option the build lacks (issue 18, item 2). The
update procedure is in planner/engines/llama_server_flags.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from planner.engines.llama_server_flags import TABLE, parse_head, parse_table

pytestmark = pytest.mark.integration


def help_options(text: str) -> list[str]:
    """Each option of `llama-server --help` as it writes it: a line starting with '-' (not
    a "----- section -----" title), up to the padding before its help (common/arg.cpp,
    `common_arg::to_string`: the help starts at column 40, or on the next line), the
    padding after a short first flag ("-h,    --help") closed up to one space."""
    return [
        re.split(r" {2,}", re.sub(r"^(-\S*,) +", r"\1 ", line.rstrip()), maxsplit=1)[0]
        for line in text.splitlines()
        if line.startswith("-") and not line.startswith("-----")
    ]


def test_every_option_of_the_pinned_help_is_classified_as_it_writes_it(binaries: Path) -> None:
    done = subprocess.run(
        [str(binaries / "llama-server"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    heads = help_options(done.stdout)
    assert len(heads) > 200, done.stdout[:2000]
    table = parse_table(TABLE.read_text())
    classified = {option.head for option in table.values()}

    unclassified = [flag for head in heads for flag in parse_head(head)[0] if flag not in table]
    missing = [head for head in heads if head not in classified]
    gone = sorted(classified - set(heads))
    assert not (unclassified or missing or gone), (
        f"{TABLE.name} is not this build's --help:\n"
        f"flags it does not classify: {' '.join(unclassified) or 'none'}\n"
        "options --help lists that it lacks (or writes otherwise); add each under its class:\n"
        + "".join(f"  CLASS | {head}\n" for head in missing)
        + "options it has that --help no longer lists:\n"
        + "".join(f"  {head}\n" for head in gone)
    )
