"""router.workers: N router processes behind one port, and their supervisor.

The supervisor runs real child processes (small Python programs standing in for
``router serve``, which tests/integration/test_router_workers.py runs for real).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from router import workers
from router.app import create_app
from router.intake import default_budget
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


def test_each_worker_holds_its_share_of_the_bounds() -> None:
    """N workers together hold what one router would: requests and body bytes."""
    assert workers.share(4096, 4) == 1024
    assert workers.share(1024**3, 3) == 1024**3 // 3
    assert workers.share(3, 4) == 1  # never 0: that would mean "no bound"
    assert workers.share(0, 4) == 0  # no bound stays none
    assert workers.share(4096, 1) == 4096


@pytest.mark.parametrize("explicit", [0, 2 * 1024**3])
def test_the_app_of_a_worker_holds_its_share(explicit: int) -> None:
    env = {"LLMGW_ROUTER_WORKERS": "4", "LLMGW_ROUTER_MAX_REQUESTS": "4096"}
    if explicit:
        env["LLMGW_ROUTER_MAX_BODIES_BYTES"] = str(explicit)
    proxy = create_app(RouterSettings.from_env(env)).state.proxy
    assert proxy.max_requests == 1024
    assert proxy.budget.limit == (explicit or default_budget()) // 4
    one = create_app(RouterSettings.from_env({**env, "LLMGW_ROUTER_WORKERS": "1"})).state.proxy
    assert one.max_requests == 4096 and one.budget.limit == (explicit or default_budget())


def test_the_backoff_doubles_from_1_s_to_30_s() -> None:
    assert [workers.backoff_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert workers.backoff_s(10_000) == 30


def test_workers_with_api_keys_warn_that_limits_and_metrics_are_per_worker() -> None:
    assert workers.shared_state_warnings(1, True) == []
    (metrics,) = workers.shared_state_warnings(2, False)
    assert "/metrics is per worker" in metrics
    _, limits = workers.shared_state_warnings(4, True, shared_limits=False)
    assert "per-key limits" in limits and "up to 4 times" in limits
    _, limits = workers.shared_state_warnings(4, True)
    assert "concurrent_requests are per worker" in limits and "shared through Consul" in limits


def test_a_worker_started_again_that_exits_2_is_retried_the_others_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of issue 21: a worker started again after a crash that then exits 2 (a
    keys file being edited) or 3 must not stop the healthy workers: it is started
    again after a backoff. Worker 0 crashes, then exits 2, then 3, then serves; worker
    1 serves throughout and is started once."""
    monkeypatch.setattr(workers, "START_GRACE_S", 0.0)
    monkeypatch.setattr(workers, "BACKOFF_BASE_S", 0.01)
    command = program(
        tmp_path,
        f"""
        import os, pathlib, signal, sys, time
        index = os.environ["LLMGW_ROUTER_WORKER"]
        starts = pathlib.Path({str(tmp_path)!r}) / f"starts-{{index}}"
        with starts.open("a") as f:
            f.write("x")
        run = len(starts.read_text())
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        if index == "0" and run <= 3:
            sys.exit([1, 2, 3][run - 1])
        if index == "0":
            os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(60)
        sys.exit(5)
        """,
    )
    caplog.set_level("INFO", logger=workers.__name__)
    assert workers.Supervisor(command, 2).run() == 0
    assert (tmp_path / "starts-0").read_text() == "xxxx"
    assert (tmp_path / "starts-1").read_text() == "x"
    assert "exited with 2: starting another in 0.02 s (failure 2 in a row" in caplog.text
    assert "exited with 3: starting another in 0.04 s (failure 3 in a row" in caplog.text


def test_a_worker_whose_supervisor_died_before_prctl_exits() -> None:
    """The orphan race: the supervisor may die between the fork and PR_SET_PDEATHSIG,
    which then never fires; the child checks that its parent is still the one."""
    check = (
        "import os, sys; from router import workers; "
        "workers._die_with_parent(int(sys.argv[1])); print('serving')"
    )
    alive = subprocess.run(
        [sys.executable, "-c", check, str(os.getpid())], capture_output=True, text=True, timeout=60
    )
    assert alive.returncode == 0 and alive.stdout.strip() == "serving"
    orphan = subprocess.run(
        [sys.executable, "-c", check, str(os.getpid() + 1)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert orphan.returncode == 1 and orphan.stdout == ""


def test_a_stop_while_a_worker_waits_for_its_start_ends_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM during a backoff: the waiting start is dropped, nothing waits it out."""
    monkeypatch.setattr(workers, "START_GRACE_S", 0.0)
    monkeypatch.setattr(workers, "BACKOFF_BASE_S", 600.0)
    supervisor = workers.Supervisor(program(tmp_path, "import sys; sys.exit(1)"), 1)

    def stop_once_waiting() -> None:
        while not supervisor.pending:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_waiting, daemon=True)
    stopper.start()
    started = time.monotonic()
    assert supervisor.run() == 0
    assert time.monotonic() - started < 60  # not the 600 s backoff
    stopper.join(5)
