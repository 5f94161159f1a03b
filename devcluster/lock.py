"""`constraints.txt`: every Python package of llmgw's environments, pinned (`make lock`).

A fresh machine used to resolve every dependency to whatever was newest that day
(issue "Any machine", item 5), so two machines, or one machine on two days, ran
different code. The lock is a pip constraints file, which every install of this
repository applies:

  devcluster.bootstrap        the .venv (`pip install -c constraints.txt -e .[dev]`)
  tests/support/wheel.py      the wheel test's fresh venv and wheelhouse, and the
                              wheel's isolated build (PIP_CONSTRAINT reaches the pip that
                              installs setuptools into the build environment)

A constraints file, not requirements: it pins versions without adding packages,
so the wheel's own dependency ranges (pyproject.toml) stay what a user's pip
resolves, and the lock only says which versions inside them we tested.

Updating it: `make lock` (this module) makes a throwaway venv, installs `.[dev]`
with no constraints (so the newest versions the ranges allow), and writes what it
got. Review the diff, run `make test`, commit both. Standard library only: it runs
with the system python3, as the bootstrap does.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints.txt"
HEADER = """\
# Every Python package of llmgw's environments, pinned: a pip constraints file.
# Written by `make lock` (devcluster/lock.py); applied by the bootstrap's .venv and
# the wheel tests. Update: `make lock`, review the diff, `make test`, commit.
"""


def resolve(python: str = sys.executable) -> list[str]:
    """`name==version` lines of a fresh venv holding pip, setuptools and `.[dev]` at
    the newest versions pyproject.toml allows (pip's own resolver)."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        # setuptools: the version pip's isolated build of the wheel will get.
        subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip", "setuptools"], check=True)
        subprocess.run([*pip, "install", "--quiet", f"{REPO}[dev]"], check=True)
        frozen = subprocess.run(
            [*pip, "freeze", "--all"], check=True, capture_output=True, text=True
        ).stdout
    return sorted(
        (
            line
            for line in frozen.splitlines()
            if "==" in line and not line.lower().startswith("llmgw==")
        ),
        key=str.lower,
    )


def main() -> None:
    lines = resolve()
    CONSTRAINTS.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"[lock] {CONSTRAINTS.name}: {len(lines)} packages pinned", file=sys.stderr)


if __name__ == "__main__":
    main()
