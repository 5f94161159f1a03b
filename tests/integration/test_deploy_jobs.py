"""llmgw itself as Nomad jobs on the dev cluster (issue "Deploying llmgw itself", item
2): jobspecs/planner.nomad.hcl and jobspecs/router.nomad.hcl run with `nomad job run`,
each allocation fetching the wheel built from this checkout (served over HTTP here)
and pip-installing it, with its dependencies from a wheelhouse, into a venv of its own.
Tokens come from Nomad variables and settings from Consul KV, as on a real cluster.

Two planners elect one leader; the routers pass their Consul check and serve the tiny
test model the planner job's leader watches; and a router job update (a changed
variable) rolls through a health-gated deployment while a client that follows the
passing `llmgw-router` instances, as a load balancer would, sends steadily: no request
fails.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.bootstrap import BIN
from devcluster.cluster import Cluster
from llmgw_contract import LEADER_KEY, PLANNER_SERVICE, ROUTER_SERVICE, LeaderRecord, decode
from tests.conftest import (
    ADMIN_TOKEN,
    PlannerDaemon,
    forget_models,
    http_json,
    nomad_get,
    passing_endpoints,
    wait_for,
)
from tests.support.traffic import steady
from tests.support.wheel import ROOT, base_python, build_wheel, build_wheelhouse, serve_folder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PLANNER_JOB, ROUTER_JOB = "llmgw-planner", "llmgw-router"
MODEL = "deploy-tiny"
CONFIG_PREFIX = "llmgw-config"


def _request(url: str, method: str, body: Any = None) -> None:
    """`body`: sent as it is when a string (a Consul KV value), else as JSON."""
    data = (
        body.encode()
        if isinstance(body, str)
        else None
        if body is None
        else json.dumps(body).encode()
    )
    request = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def put_settings(cluster: Cluster, job: str, settings: dict[str, str]) -> None:
    """Consul KV <config_prefix>/<job>/<VARIABLE>: what the jobs' settings template reads."""
    for key, value in settings.items():
        _request(f"{cluster.consul_addr}/v1/kv/{CONFIG_PREFIX}/{job}/{key}", "PUT", value)


def put_tokens(cluster: Cluster, job: str, tokens: dict[str, str]) -> None:
    """The Nomad variable nomad/jobs/<job>, whose *_TOKEN items the jobs' template reads."""
    _request(
        f"{cluster.nomad_addr}/v1/var/nomad/jobs/{job}",
        "PUT",
        {"Namespace": "default", "Path": f"nomad/jobs/{job}", "Items": tokens},
    )


def nomad_run(cluster: Cluster, jobspec: str, variables: dict[str, Any]) -> int:
    """`nomad job run -detach` with `-var`s; returns the job version it registered."""
    argv = [str(BIN / "nomad"), "job", "run", "-detach"]
    for name, value in variables.items():
        argv += ["-var", f"{name}={value}"]
    done = subprocess.run(
        [*argv, str(ROOT / "jobspecs" / jobspec)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **cluster.env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    job = Path(jobspec).name.removesuffix(".nomad.hcl")
    return nomad_get(cluster, f"/v1/job/llmgw-{job}")["Version"]


def deployed(cluster: Cluster, job: str, version: int, timeout: float = 300) -> dict:
    """Wait for the deployment of `version` of `job` to succeed; fail at once if it failed."""

    def successful() -> dict | None:
        deployment = nomad_get(cluster, f"/v1/job/{job}/deployment")
        if deployment is None or deployment["JobVersion"] != version:
            return None
        if deployment["Status"] in ("failed", "cancelled"):
            pytest.fail(
                f"{job} v{version}: deployment {deployment['Status']}: "
                f"{deployment['StatusDescription']}; {allocation_events(cluster, job)}"
            )
        return deployment if deployment["Status"] == "successful" else None

    return wait_for(successful, timeout, f"{job} v{version} deployed")


def allocation_events(cluster: Cluster, job: str) -> list[str]:
    """The last task events of the job's allocations, for a failure message."""
    return [
        f"{a['ID'][:8]} {task}: {state['Events'][-1]['DisplayMessage']}"
        for a in nomad_get(cluster, f"/v1/job/{job}/allocations")
        for task, state in (a.get("TaskStates") or {}).items()
        if state["Events"]
    ]


def running_versions(cluster: Cluster, job: str) -> dict[str, int]:
    """{allocation ID: job version} of the job's allocations that run and should."""
    return {
        a["ID"]: a["JobVersion"]
        for a in nomad_get(cluster, f"/v1/job/{job}/allocations")
        if a["DesiredStatus"] == "run" and a["ClientStatus"] == "running"
    }


def purge(cluster: Cluster, *jobs: str) -> None:
    for job in jobs:
        with contextlib.suppress(OSError):
            _request(f"{cluster.nomad_addr}/v1/job/{job}?purge=true", "DELETE")
        with contextlib.suppress(OSError):
            _request(f"{cluster.nomad_addr}/v1/var/nomad/jobs/{job}", "DELETE")
    with contextlib.suppress(OSError):
        _request(f"{cluster.consul_addr}/v1/kv/{CONFIG_PREFIX}?recurse=true", "DELETE")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The wheel and a wheelhouse of its dependencies, served on 127.0.0.1."""
    folder = tmp_path_factory.mktemp("dist")
    wheel = build_wheel(folder)
    build_wheelhouse(wheel, folder / "wheelhouse")
    with serve_folder(folder) as url:
        yield f"{url}/{wheel.name}"


@pytest.fixture(scope="module")
def install_vars(dist: str) -> dict[str, str]:
    """The jobspecs' variables for this cluster's node: the wheel, the wheelhouse, the
    Python that makes the venvs."""
    return {
        "wheel_url": dist,
        "wheelhouse_url": dist.rsplit("/", 1)[0] + "/wheelhouse/",
        "python": base_python(),
    }


@pytest.fixture(scope="module")
def jobs(
    cluster: Cluster,
    planner_env: dict[str, str],
    planner_daemon: PlannerDaemon,
    install_vars: dict[str, str],
) -> Iterator[dict[str, int]]:
    """Both jobs running, deployed; yields {job: version}. The session's own `planner
    serve` stands aside meanwhile, so the planner job's two instances are the only
    candidates for leader."""
    planner_daemon.stop()
    # As terraform/ passes them (nomad_job takes strings): a list as HCL text.
    addresses = {"consul_addr": cluster.env["CONSUL_HTTP_ADDR"], "datacenters": '["*"]'}
    try:
        put_settings(cluster, PLANNER_JOB, {"LLMGW_ENGINES": planner_env["LLMGW_ENGINES"]})
        put_settings(cluster, ROUTER_JOB, {"LLMGW_QUEUE_TIMEOUT": "30"})
        put_tokens(cluster, PLANNER_JOB, {"LLMGW_ADMIN_TOKEN": ADMIN_TOKEN})
        put_tokens(cluster, ROUTER_JOB, {"LLMGW_PLANNER_TOKEN": ADMIN_TOKEN})
        versions = {
            PLANNER_JOB: nomad_run(
                cluster,
                "planner.nomad.hcl",
                {**install_vars, **addresses, "nomad_addr": cluster.nomad_addr},
            ),
            ROUTER_JOB: nomad_run(
                cluster, "router.nomad.hcl", {**install_vars, **addresses, "instances": 2}
            ),
        }
        for job, version in versions.items():
            deployed(cluster, job, version)
        yield versions
    finally:
        forget_models(cluster, MODEL)
        purge(cluster, PLANNER_JOB, ROUTER_JOB)
        planner_daemon.start()


def planner_roles(cluster: Cluster) -> dict[str, str]:
    """{admin address: role} of every passing planner instance, from its /health."""
    return {
        address: http_json(f"http://{address}/health", timeout=5)["role"]
        for address in passing_endpoints(cluster, PLANNER_SERVICE)
    }


def leader_address(cluster: Cluster) -> str:
    [entry] = http_json(f"{cluster.consul_addr}/v1/kv/{LEADER_KEY}")
    return decode(LeaderRecord, base64.b64decode(entry["Value"])).address


def one_leader(cluster: Cluster) -> str:
    """Wait until both planner instances pass, one of them leading; its address."""
    roles = wait_for(
        lambda: (
            (r := planner_roles(cluster))
            and len(r) == 2
            and sorted(r.values()) == ["follower", "leader"]
            and r
        ),
        120,
        "two planner instances, one leading",
    )
    [leader] = [address for address, role in roles.items() if role == "leader"]
    assert leader_address(cluster) == f"http://{leader}"
    return leader


def test_two_planner_instances_one_leader_one_standby(
    cluster: Cluster, jobs: dict[str, int]
) -> None:
    leader = one_leader(cluster)
    allocations = nomad_get(cluster, f"/v1/job/{PLANNER_JOB}/allocations")
    [leading] = [
        a["ID"]
        for a in allocations
        if a["DesiredStatus"] == "run"
        and _alloc_port(cluster, a["ID"]) == int(leader.rsplit(":", 1)[1])
    ]
    # The leader's allocation is stopped (a drained node, a lost one): the standby
    # takes the lock, and Nomad places a new standby.
    started = time.monotonic()
    _request(f"{cluster.nomad_addr}/v1/allocation/{leading}/stop", "POST")
    successor = wait_for(
        lambda: (a := leader_address(cluster)) != f"http://{leader}" and a,
        30,
        "the standby to lead",
    )
    took = time.monotonic() - started
    print(
        f"planner failover: {successor} leads {took:.1f} s after the leader's "
        f"allocation was stopped"
    )
    assert one_leader(cluster) == successor.removeprefix("http://")
    assert len(running_versions(cluster, PLANNER_JOB)) == 2


def _alloc_port(cluster: Cluster, alloc_id: str) -> int | None:
    """The `admin` port of a planner allocation."""
    alloc = nomad_get(cluster, f"/v1/allocation/{alloc_id}")
    for network in (alloc.get("AllocatedResources") or {}).get("Shared", {}).get("Ports") or []:
        if network["Label"] == "admin":
            return network["Value"]
    return None


def completion(router: str) -> dict:
    return http_json(
        f"http://{router}/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 4},
        timeout=60,
    )


def test_the_router_job_serves_the_model(
    cluster: Cluster,
    jobs: dict[str, int],
    model_files: Callable[..., Path],
    planner: Callable[..., subprocess.CompletedProcess[str]],
    planner_env: dict[str, str],
) -> None:
    applied = planner("apply", "--wait", "--timeout", "120", str(model_files(MODEL)))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    # The setting from Consul KV reached the planner job: its model job runs the
    # engine LLMGW_ENGINES names (not the default /opt/llmgw/bin/llama-server).
    [task] = nomad_get(cluster, f"/v1/job/{MODEL}")["TaskGroups"][0]["Tasks"]
    assert f"llama.cpp={task['Config']['command']}" in planner_env["LLMGW_ENGINES"]
    routers = wait_for(
        lambda: len(r := passing_endpoints(cluster, ROUTER_SERVICE)) == 2 and r,
        60,
        "two passing routers",
    )
    for router in routers:
        answer = wait_for(
            lambda router=router: completion(router),
            30,
            f"a completion through the router at {router}",
        )
        assert answer["choices"][0]["text"] is not None
        assert answer["model"] == MODEL
    # The tokens from the Nomad variables: the routers report usage to the leader
    # they found through Consul with LLMGW_PLANNER_TOKEN, which the leader accepts
    # only as its own LLMGW_ADMIN_TOKEN, and it records the model's last use.
    wait_for(
        lambda: http_json(f"{cluster.consul_addr}/v1/kv/llmgw/usage/{MODEL}"),
        60,
        "the routers' usage report, recorded by the leader",
    )


def test_a_router_job_update_rolls_without_a_failed_request(
    cluster: Cluster, jobs: dict[str, int], install_vars: dict[str, str]
) -> None:
    if not passing_endpoints(cluster, f"llmgw-{MODEL}"):
        pytest.skip("needs the model test_the_router_job_serves_the_model applies")
    before = running_versions(cluster, ROUTER_JOB)
    turn = itertools.count()

    def through_a_passing_router() -> None:
        # What a load balancer following Consul does: the passing instances, each
        # request to the next one.
        routers = passing_endpoints(cluster, ROUTER_SERVICE)
        if not routers:
            raise OSError("no passing llmgw-router instance")
        completion(routers[next(turn) % len(routers)])

    with steady(through_a_passing_router, interval=0.1) as codes:
        wait_for(lambda: len(codes) >= 5, 60, "the client's first requests")
        started = time.monotonic()
        version = nomad_run(
            cluster,
            "router.nomad.hcl",
            {
                **install_vars,
                "consul_addr": cluster.env["CONSUL_HTTP_ADDR"],
                "instances": 2,
                "settings_version": "2",
            },
        )
        assert version == jobs[ROUTER_JOB] + 1
        deployed(cluster, ROUTER_JOB, version)
        # Until every old instance has left (after its shutdown delay and drain).
        wait_for(
            lambda: not set(before) & set(running_versions(cluster, ROUTER_JOB)),
            120,
            "the old router instances gone",
        )
        took = time.monotonic() - started
        sent = len(codes)
        wait_for(lambda: len(codes) >= sent + 5, 60, "requests to the new instances")
    failed = [code for code in codes if code != 200]
    print(
        f"router update: deployed and old instances gone in {took:.0f} s; "
        f"{len(codes)} requests, {len(failed)} failed"
    )
    assert not failed, f"{len(failed)} of {len(codes)} requests failed: {failed}"
    after = running_versions(cluster, ROUTER_JOB)
    assert len(after) == 2 and set(after.values()) == {version}, after
