"""The GPU path on two client nodes with fake nvidia/gpu devices: placement by count
and memory, the reason when nothing fits, GPU isolation under raw_exec, and C12 with
GPUs.

This module runs its own cluster: the dev node (no GPU), `gpu-a` with 2 x 16 GiB and
`gpu-b` with 1 x 80 GiB, each reported by the test-only device plugin
devcluster/fakegpu (a fake: there is no GPU here, see its README). Nomad's scheduler,
device reservations and task environment are real; llama-server runs on the CPU (its
`--n-gpu-layers` finds no CUDA device and is ignored). Each test releases the GPUs it
took (`release`): there are only three.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.cluster import ClientNode, Cluster, FakeGpus
from tests.conftest import (
    PlannerDaemon,
    forget_models,
    nomad_get,
    own_cluster,
    passing_endpoints,
    run_router,
    wait_for,
)
from tests.integration.test_on_demand import complete, on_demand_model, refusal
from tests.integration.test_parking import write_model
from tests.support.engines import write_engines

pytestmark = pytest.mark.integration

GPU_A = ClientNode("gpu-a", gpus=FakeGpus(count=2, memory_mib=16384, name="Fake GPU 16GB"))
GPU_B = ClientNode("gpu-b", gpus=FakeGpus(count=1, memory_mib=81920, name="Fake GPU 80GB"))


def gpu_profile(gpus: int, gpu_memory: str | None = None) -> str:
    memory = f"\n  gpu_memory: {gpu_memory}" if gpu_memory else ""
    return (
        f"gpus: {gpus}{memory}\n  context: 512\n  cpu: 100\n  memory: 256MiB\n"
        '  args: ["--threads", "1"]'
    )


@pytest.fixture(scope="module")
def gpu_cluster(binaries: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with own_cluster(tmp_path_factory.mktemp("gpus"), clients=(GPU_A, GPU_B)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gpu_planner(
    gpu_cluster: Cluster, binaries: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PlannerDaemon]:
    engines = write_engines(tmp_path_factory.mktemp("engines"), binaries / "llama-server")
    env = {
        **os.environ,
        **gpu_cluster.env,
        "LLMGW_ENGINES": ",".join(f"{k}={v}" for k, v in engines.items()),
    }
    daemon = PlannerDaemon(env, gpu_cluster.root / "planner.log")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def apply(
    gpu_cluster: Cluster, gpu_planner: PlannerDaemon, tiny_model: Path, tmp_path: Path
) -> Iterator[Callable[..., None]]:
    """apply(name, profile, replicas=1, on_demand=False): write and apply one model;
    every model applied is released when the test ends."""
    applied: list[str] = []

    def run(name: str, profile: str, replicas: int = 1, on_demand: bool = False) -> None:
        folder = tmp_path / name
        if on_demand:
            on_demand_model(
                folder, name, f"file://{tiny_model}", profile=profile, replicas=replicas
            )
        else:
            write_model(folder, name, tiny_model, replicas=replicas, profile=profile)
        applied.append(name)
        done = subprocess.run(
            [sys.executable, "-m", "planner.cli.main", "apply", str(folder)],
            env=gpu_planner.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    yield run
    release(gpu_cluster, *applied)


def release(cluster: Cluster, *names: str) -> None:
    """Purge the models' jobs and records, and wait until none of their allocations
    runs: the next test may need the GPUs they held."""
    forget_models(cluster, *names)
    wait_for(
        lambda: (
            not [
                a
                for a in nomad_get(cluster, "/v1/allocations")
                if a["JobID"] in names and a["ClientStatus"] in ("pending", "running")
            ]
        ),
        60,
        f"allocations of {names} stopped",
    )


def running_allocations(cluster: Cluster, name: str) -> list[dict]:
    return [
        a
        for a in nomad_get(cluster, f"/v1/job/{name}/allocations")
        if a["ClientStatus"] == "running" and a["DesiredStatus"] == "run"
    ]


def reserved_gpus(cluster: Cluster, alloc_id: str) -> list[str]:
    """The nvidia/gpu instance IDs Nomad reserved for the allocation's server task."""
    alloc = nomad_get(cluster, f"/v1/allocation/{alloc_id}")
    task = alloc["AllocatedResources"]["Tasks"]["llama-server"]
    return [
        i
        for d in task.get("Devices") or []
        if (d["Vendor"], d["Type"]) == ("nvidia", "gpu")
        for i in d["DeviceIDs"]
    ]


def server_environment(cluster: Cluster, model: str) -> dict[str, str]:
    """The environment of the model's running llama-server process, read from
    /proc/<pid>/environ: what CUDA would read, not what a template wrote."""
    root = str(cluster.root.resolve())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
            if b"--alias" not in argv or argv[argv.index(b"--alias") + 1] != model.encode():
                continue
            environ = (proc / "environ").read_bytes()
        except (OSError, IndexError):
            continue
        if cwd.startswith(root):
            found.append(
                dict(item.split("=", 1) for item in environ.decode().split("\0") if "=" in item)
            )
    assert len(found) == 1, f"{len(found)} llama-server processes for {model}"
    return found[0]


def test_fake_gpus_are_fingerprinted_as_the_real_plugin_reports_them(gpu_cluster: Cluster) -> None:
    nodes = {
        n["Name"]: n["NodeResources"]["Devices"]
        for n in nomad_get(gpu_cluster, "/v1/nodes?resources=true")
    }
    assert not nodes[gpu_cluster.node_name]
    [a], [b] = nodes["gpu-a"], nodes["gpu-b"]
    assert (a["Vendor"], a["Type"], a["Name"]) == ("nvidia", "gpu", "Fake GPU 16GB")
    assert (a["Attributes"]["memory"]["Int"], a["Attributes"]["memory"]["Unit"]) == (16384, "MiB")
    assert a["Attributes"]["driver_version"]["String"] == "fake"
    assert b["Attributes"]["memory"]["Int"] == 81920 and len(b["Instances"]) == 1
    ids = [i["ID"] for i in a["Instances"]]
    assert len(set(ids)) == 2 and all(i["Healthy"] for i in a["Instances"])
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", i) for i in ids)


def test_gpu_memory_24gib_places_on_the_80gib_node_only(
    gpu_cluster: Cluster, gpu_planner: PlannerDaemon, apply: Callable
) -> None:
    """A fixed model of 2 replicas that places 1: a request sent as it is applied is
    served by the one placed (never model_unplaceable for a model that serves), and the
    status tells the other's reason."""
    with run_router(gpu_cluster, gpu_planner.url) as router:
        apply("gpu-24g", gpu_profile(1, "24GiB"), replicas=2)
        try:
            answer = complete(router, "gpu-24g")
        except urllib.error.HTTPError as exc:
            pytest.fail(f"gpu-24g refused: {exc.code} {exc.read().decode()}")
        assert answer["usage"]["completion_tokens"] > 0
    model = wait_for(
        lambda: (m := gpu_planner.model("gpu-24g"))["state"] == "degraded" and m,
        60,
        "one replica serving, one unplaced",
    )
    # Consul may pass the check before the client's status update reaches the server.
    [alloc] = wait_for(lambda: running_allocations(gpu_cluster, "gpu-24g"), 10, "running")
    assert alloc["NodeName"] == "gpu-b"
    # The second replica fits nowhere: gpu-a's 16 GiB GPUs are too small, gpu-b's one
    # GPU is taken by the first.
    assert model["reason"] == (
        "1 of 2 ready; 1 of 2 replicas placed; needs 1 nvidia/gpu with ≥ 24 GiB: 2 of 3 "
        "nodes have none; nvidia/gpu devices with ≥ 24 GiB in use on 1 of 3 nodes"
    )


def test_two_one_gpu_models_on_the_two_gpu_node_each_see_only_their_own_gpu(
    gpu_cluster: Cluster, gpu_planner: PlannerDaemon, apply: Callable
) -> None:
    # gpu-b's only GPU taken first, so both models must share gpu-a.
    apply("iso-holder", gpu_profile(1, "24GiB"))
    wait_for(lambda: gpu_planner.model("iso-holder")["ready"] == 1, 60, "holder on gpu-b")
    apply("iso-one", gpu_profile(1))
    apply("iso-two", gpu_profile(1))
    seen = {}
    for name in ("iso-one", "iso-two"):
        wait_for(lambda name=name: gpu_planner.model(name)["ready"] == 1, 60, f"{name} serving")
        [alloc] = wait_for(
            lambda name=name: running_allocations(gpu_cluster, name), 10, f"{name} running"
        )
        assert alloc["NodeName"] == "gpu-a"
        [reserved] = reserved_gpus(gpu_cluster, alloc["ID"])
        env = server_environment(gpu_cluster, name)
        assert env["CUDA_VISIBLE_DEVICES"] == reserved, env.get("CUDA_VISIBLE_DEVICES")
        assert env["NVIDIA_VISIBLE_DEVICES"] == reserved
        assert reserved.startswith("GPU-") and "," not in reserved
        seen[name] = reserved
    assert seen["iso-one"] != seen["iso-two"], seen
    # A model without GPUs gets no GPU variables at all.
    apply("iso-cpu", gpu_profile(0))
    wait_for(lambda: gpu_planner.model("iso-cpu")["ready"] == 1, 60, "iso-cpu serving")
    env = server_environment(gpu_cluster, "iso-cpu")
    assert "CUDA_VISIBLE_DEVICES" not in env and "NVIDIA_VISIBLE_DEVICES" not in env


def test_three_gpus_are_unplaceable_saying_the_best_node_has_two(
    gpu_planner: PlannerDaemon, apply: Callable
) -> None:
    apply("gpu-three", gpu_profile(3))
    model = wait_for(
        lambda: (m := gpu_planner.model("gpu-three"))["state"] == "unplaceable" and m,
        20,
        "gpu-three unplaceable",
    )
    assert model["reason"] == "needs 3 nvidia/gpu: the most on one node is 2"


def test_200gib_of_gpu_memory_is_unplaceable_naming_the_largest_gpu(
    gpu_planner: PlannerDaemon, apply: Callable
) -> None:
    apply("gpu-200g", gpu_profile(1, "200GiB"))
    model = wait_for(
        lambda: (m := gpu_planner.model("gpu-200g"))["state"] == "unplaceable" and m,
        20,
        "gpu-200g unplaceable",
    )
    assert model["reason"] == (
        "needs 1 nvidia/gpu with ≥ 200 GiB: 2 nodes have GPUs, "
        "none with enough memory (largest 80 GiB)"
    )


def test_c12_with_gpus_room_made_then_next_request_is_placed(
    gpu_cluster: Cluster, gpu_planner: PlannerDaemon, apply: Callable
) -> None:
    """C12 with GPUs: B needs a GPU of ≥ 24 GiB; the only one (gpu-b's) is A's. A is
    scaled to 0; the next request for B is placed there and served, not refused on the
    old answer."""
    apply("c12g-a", gpu_profile(1, "24GiB"))
    wait_for(lambda: gpu_planner.model("c12g-a")["ready"] == 1, 60, "A serving on gpu-b")
    apply("c12g-b", gpu_profile(1, "24GiB"), on_demand=True)
    with run_router(gpu_cluster, gpu_planner.url) as router:
        status, error, _ = refusal(router, "c12g-b")
        assert status == 503 and error["code"] == "model_unplaceable", error
        assert "nvidia/gpu devices with ≥ 24 GiB in use on 1 of 3 nodes" in error["message"]

        apply("c12g-a", gpu_profile(1, "24GiB"), replicas=0)
        wait_for(lambda: not passing_endpoints(gpu_cluster, "llmgw-c12g-a"), 20, "A stopped")
        try:
            answer = complete(router, "c12g-b")
        except urllib.error.HTTPError as exc:
            pytest.fail(f"c12g-b refused: {exc.code} {exc.read().decode()}")
        assert answer["usage"]["completion_tokens"] > 0
    [alloc] = wait_for(lambda: running_allocations(gpu_cluster, "c12g-b"), 10, "B running")
    assert alloc["NodeName"] == "gpu-b"
