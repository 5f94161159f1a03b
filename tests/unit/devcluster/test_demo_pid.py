"""`make demo` starts the planner and the router once: a pid file counts only while its
process still runs what the demo started (found by a new user: `kill -9` of the planner,
then `make demo` at once said "planner already running" and started none)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from devcluster.demo import _running


def test_a_live_process_of_the_same_command_is_running(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # it runs its program (before: /proc shows no command line yet)
    try:
        (tmp_path / "p.pid").write_text(str(proc.pid))
        assert _running(tmp_path / "p.pid", argv) == proc.pid
        # Another program under the same pid (the kernel reuses pids) is not ours.
        assert _running(tmp_path / "p.pid", [sys.executable, "-m", "planner", "serve"]) is None
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_process_not_yet_reaped_is_not_running(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    proc = subprocess.Popen(argv)
    os.kill(proc.pid, signal.SIGKILL)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie now, not reaped
    (tmp_path / "p.pid").write_text(str(proc.pid))
    try:
        assert _running(tmp_path / "p.pid", argv) is None
    finally:
        proc.wait()


def test_no_pid_file_or_a_bad_one_is_not_running(tmp_path: Path) -> None:
    assert _running(tmp_path / "none.pid", ["x"]) is None
    (tmp_path / "bad.pid").write_text("not a pid")
    assert _running(tmp_path / "bad.pid", ["x"]) is None
