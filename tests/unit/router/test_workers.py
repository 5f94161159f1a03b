"""router.workers: N router processes behind one port, and their supervisor.

The supervisor runs real child processes (small Python programs standing in for
``router serve``, which tests/integration/test_router_workers.py runs for real).
"""

from __future__ import annotations

import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from router import workers
from router.settings import RouterSettings
from tests.support.ports import free_port


def program(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(text))
    return [sys.executable, str(path)]


def test_two_workers_bind_the_same_port() -> None:
    port = free_port()
    first = workers.listen_socket("127.0.0.1", port)
    second = workers.listen_socket("127.0.0.1", port)
    try:
        first.listen()
        second.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        first.close()
        second.close()


def test_a_worker_with_invalid_settings_stops_the_others(tmp_path: Path) -> None:
    # Worker 0 exits 2 (invalid settings); worker 1 would serve until told to stop.
    command = program(
        tmp_path,
        """
        import os, signal, sys, time
        if os.environ["LLMGW_ROUTER_WORKER"] == "0":
            sys.exit(2)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        time.sleep(60)
        sys.exit(5)
        """,
    )
    before = signal.getsignal(signal.SIGTERM)
    assert workers.Supervisor(command, 2).run() == 2
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_worker_that_dies_later_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "START_GRACE_S", 0.0)
    marker = tmp_path / "died-once"
    # The first run dies (a crash); the second asks the supervisor to stop, then
    # drains like the router: exit 0 on SIGTERM.
    command = program(
        tmp_path,
        f"""
        import os, pathlib, signal, sys, time
        marker = pathlib.Path({str(marker)!r})
        if not marker.exists():
            marker.write_text("")
            sys.exit(1)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(60)
        sys.exit(5)
        """,
    )
    assert workers.Supervisor(command, 1).run() == 0
    assert marker.exists()


def test_workers_setting() -> None:
    assert RouterSettings.from_env({}).workers == 1
    assert RouterSettings.from_env({"LLMGW_ROUTER_WORKERS": "4"}).workers == 4
    with pytest.raises(ValueError, match="LLMGW_ROUTER_WORKERS"):
        RouterSettings.from_env({"LLMGW_ROUTER_WORKERS": "0"}).validate()
