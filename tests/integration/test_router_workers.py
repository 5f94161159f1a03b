"""``router serve --workers 2`` on a real Consul dev agent: two processes behind one
port, each serving; a worker that dies is started again; SIGTERM ends all of them
cleanly (router.workers)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.intake import default_budget
from tests.integration.test_router_consul import (
    Consul,
    Router,
    Stub,
    consul_binary,
    eventually,
    request,
)

pytestmark = pytest.mark.integration


def workers_of(router: Router) -> list[int]:
    """The pids of the router's worker processes, as /proc lists its children now."""
    pids: list[int] = []
    for task in Path(f"/proc/{router.proc.pid}/task").glob("*/children"):
        pids += [int(pid) for pid in task.read_text().split()]
    return sorted(pids)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[Consul, Stub, Router]]:
    binary = consul_binary()
    if binary is None:
        pytest.skip("no consul binary (set LLMGW_CONSUL_BIN)")
    consul = Consul(binary, tmp_path)
    stub = Stub("a")
    router: Router | None = None
    try:
        consul.define("tiny")
        consul.register("tiny", "a", stub.port)
        router = Router(consul, tmp_path, "router", "--workers", "2")
        yield consul, stub, router
    finally:
        if router is not None:
            router.stop()
        stub.stop()
        consul.stop()


def started(router: Router, worker: int, times: int = 1) -> bool:
    """Worker ``worker`` finished its startup ``times`` times (listening since its bind)."""
    line = f"worker {worker} uvicorn.error: Application startup complete"
    return router.log_path.read_text().count(line) >= times


def completion(router: Router) -> int:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    return request("POST", f"{router.url}/v1/completions", body)[0]


def test_two_workers_serve_one_port_and_stop_cleanly(parts) -> None:
    _, stub, router = parts
    eventually(lambda: len(workers_of(router)) == 2, timeout=10)
    eventually(lambda: started(router, 0) and started(router, 1), timeout=30)
    # Each worker reads Consul itself; a request may meet one that has not yet.
    eventually(lambda: all(completion(router) == 200 for _ in range(20)), timeout=30)
    assert len(stub.requests) >= 20
    log = router.log_path.read_text()
    # Each holds half the body budget (the same machine and cgroup as this test).
    assert log.count(f"request bodies held at once: at most {default_budget() // 2} bytes") == 2
    assert "/metrics is per worker" in log
    workers = workers_of(router)
    assert router.stop() == 0
    for pid in workers:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )


def test_a_worker_that_dies_is_started_again(parts) -> None:
    _, _, router = parts
    eventually(lambda: started(router, 0) and started(router, 1), timeout=30)
    workers = workers_of(router)
    assert len(workers) == 2
    # The survivor serves throughout; the one killed is worker 0 or 1 (pid order).
    killed = workers[0]
    os.kill(killed, signal.SIGKILL)
    eventually(
        lambda: len(workers_of(router)) == 2 and killed not in workers_of(router), timeout=15
    )
    assert workers[1] in workers_of(router)
    eventually(lambda: started(router, 0, 2) or started(router, 1, 2), timeout=30)
    eventually(lambda: all(completion(router) == 200 for _ in range(20)), timeout=30)
    assert "exited with -9: starting another" in router.log_path.read_text()


def test_workers_end_with_their_supervisor(parts) -> None:
    _, _, router = parts
    eventually(lambda: started(router, 0) and started(router, 1), timeout=30)
    workers = workers_of(router)
    router.proc.kill()
    router.proc.wait()

    def gone(pid: int) -> bool:
        try:
            return "zombie" in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True

    # PR_SET_PDEATHSIG: a supervisor killed outright leaves no worker on the port.
    eventually(lambda: all(gone(pid) for pid in workers), timeout=30)
