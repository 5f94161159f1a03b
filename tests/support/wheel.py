"""llmgw as a user gets it: the wheel built from this checkout, installed into a fresh
venv, and served over HTTP to Nomad's artifact downloader.

Used by tests/integration/test_packaging.py (the wheel installed with pip, as
`pip install dist/llmgw-*.whl` does) and tests/integration/test_deploy_jobs.py (the
planner and router jobs fetch the wheel and a wheelhouse from a local server). pip
reuses its cache (~/.cache/pip), so a build takes seconds, not a download.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
# The lock (devcluster/lock.py): the wheel's build, its wheelhouse and its fresh venv
# resolve as the .venv did. PIP_CONSTRAINT also reaches pip's isolated build env.
CONSTRAINTS = ROOT / "constraints.txt"
LOCKED = {**os.environ, "PIP_CONSTRAINT": str(CONSTRAINTS)}


def build_wheel(dist: Path) -> Path:
    """Build llmgw's wheel into `dist` (pip's isolated build: setuptools from the
    index) and return its path."""
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(ROOT)],
        check=True,
        timeout=300,
        capture_output=True,
        env=LOCKED,
    )
    [wheel] = dist.glob("llmgw-*.whl")
    return wheel


def build_wheelhouse(wheel: Path, folder: Path) -> Path:
    """Every dependency of `wheel` as wheels in `folder` (what `wheelhouse_url` of the
    jobspecs points at, so a node installs with --no-index)."""
    subprocess.run(
        [*PIP, "wheel", "--quiet", "--wheel-dir", str(folder), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
        env=LOCKED,
    )
    return folder


def base_python() -> str:
    """The interpreter this venv was made from (a venv is made from a real Python)."""
    return str(Path(sys.base_prefix) / "bin" / "python3")


def install_fresh(wheel: Path, venv: Path) -> Path:
    """A new, empty venv at `venv` with `wheel` pip-installed (dependencies from the
    index, through pip's cache); returns its bin folder."""
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
            "--no-compile",
            str(wheel),
        ],
        check=True,
        timeout=600,
        capture_output=True,
        env=LOCKED,
    )
    return venv / "bin"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """Serve `folder` (files and directory listings, which pip's --find-links reads)
    on 127.0.0.1 at a free port until the block ends; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
