"""C14 on two real client nodes: one replica's node fails every start while the other
serves. The model must never be parked; the healthy replica serves every request
throughout; the model reads `degraded`, naming the failing replica's node, its count
and its last error.

This module runs its own cluster (the dev node and `node-b`), planner and router: the
session cluster has one node. `node-b`'s agent has LLMGW_FAKE_FAULT=missing-model in
its environment, which the test-only engine `nodefault-llama.cpp` turns into
llama-server's own "failed to open GGUF file" exit (tests/support/engines.py: the
model file cannot be missing on one node only when both nodes share this machine's
filesystem). Each node advertises room for exactly one replica, so the scheduler puts
one on each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.cluster import ClientNode, Cluster
from tests.conftest import PlannerDaemon, own_cluster, run_router, wait_for
from tests.integration.test_on_demand import complete
from tests.integration.test_parking import write_model
from tests.support.engines import write_engines
from tests.support.traffic import steady

pytestmark = pytest.mark.integration

# Both nodes advertise the machine's memory (node-b says so explicitly); a replica asks
# for just over half of it, so each node holds exactly one (raw_exec enforces none of it).
HOST_MB = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
REPLICA_MB = HOST_MB // 2 + 512
NODE_B = ClientNode("node-b", env={"LLMGW_FAKE_FAULT": "missing-model"}, memory_total_mb=HOST_MB)


@pytest.fixture(scope="module")
def two_nodes(binaries: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with own_cluster(tmp_path_factory.mktemp("c14"), clients=(NODE_B,)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def env(
    two_nodes: Cluster, binaries: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    engines = write_engines(tmp_path_factory.mktemp("engines"), binaries / "llama-server")
    return {
        **os.environ,
        **two_nodes.env,
        "LLMGW_ENGINES": ",".join(f"{k}={v}" for k, v in engines.items()),
    }


@pytest.fixture(scope="module")
def planner2(two_nodes: Cluster, env: dict[str, str]) -> Iterator[PlannerDaemon]:
    daemon = PlannerDaemon(env, two_nodes.root / "planner.log")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def planner_cli(env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "planner.cli.main", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


def test_c14_one_replica_failing_on_its_node_beside_a_serving_one_is_degraded(
    two_nodes: Cluster,
    planner_cli: Callable,
    planner2: PlannerDaemon,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    planner = planner_cli
    profile = (
        f"context: 512\n  cpu: 100\n  memory: {REPLICA_MB}MiB\n"
        '  args: ["--threads", "1"]\n  engine: nodefault-llama.cpp'
    )
    folder = write_model(tmp_path / "m", "c14-two", tiny_model, replicas=2, profile=profile)
    with run_router(two_nodes, planner2.url) as router:
        assert planner("apply", str(folder)).returncode == 0
        wait_for(lambda: planner2.model("c14-two")["ready"] == 1, 60, "replica A serving")
        with steady(lambda: complete(router, "c14-two", timeout=30), interval=0.1) as codes:
            # The replica's state is Nomad's, read live; its count is the watcher's, from
            # the event stream: wait for both (the last failed start's event may follow
            # the allocation turning failed by a few milliseconds).
            degraded = wait_for(
                lambda: (
                    (m := planner2.model("c14-two"))["state"] == "degraded"
                    and any(
                        r["state"] == "stopped" and r["consecutive_failures"] == 5
                        for r in m["replicas"]
                    )
                    and m
                ),
                90,
                "degraded, with node-b's replica stopped after 5 counted failures",
            )
            seen = len(codes)
            wait_for(lambda: len(codes) >= seen + 20, 60, "A serving after B was given up")
    [bad] = [r for r in degraded["replicas"] if r["state"] == "stopped"]
    [good] = [r for r in degraded["replicas"] if r["state"] == "serving"]
    assert (bad["node"], bad["consecutive_failures"]) == ("node-b", 5)
    assert "failed to open GGUF file" in bad["last_error"]
    assert good["node"] == two_nodes.node_name and good["consecutive_failures"] == 0
    assert "node-b" in degraded["reason"] and "5 consecutive failures" in degraded["reason"]
    assert codes and set(codes) == {200}, codes
    final = planner2.model("c14-two")
    assert final["state"] == "degraded" and final["ready"] == 1
    listed = json.loads(planner("models", "--output", "json").stdout)
    [row] = [r for r in listed if r["name"] == "c14-two"]
    assert row["state"] == "degraded" and "node-b" in row["reason"]
    assert "model c14-two: parked" not in planner2.log.read_text()


def test_a_gpu_profile_on_two_gpu_less_nodes_counts_both_in_one_reason(
    two_nodes: Cluster,
    planner_cli: Callable,
    planner2: PlannerDaemon,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """Nomad files a node of a class it already rejected under "computed class
    ineligible"; the reason folds it into the real one and counts every node."""
    folder = write_model(
        tmp_path / "m",
        "gpu-two",
        tiny_model,
        profile="gpus: 1\n  gpu_memory: 24GiB\n  memory: 256MiB",
    )
    assert planner_cli("apply", str(folder)).returncode == 0
    model = wait_for(
        lambda: (m := planner2.model("gpu-two"))["state"] == "unplaceable" and m,
        10,
        "gpu-two unplaceable",
    )
    assert model["reason"] == (
        "needs 1 nvidia/gpu with ≥ 24 GiB: no node has an nvidia/gpu device (2 of 2 nodes filtered)"
    )
    assert "computed class" not in model["reason"]
