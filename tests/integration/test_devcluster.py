"""The dev cluster with an extra client node (devcluster/cluster.py), on real agents:
both nodes ready, a raw_exec task inheriting its node's agent environment, a service
spread over both nodes and passing its Consul check, and `down` leaving nothing.

The cluster is this module's own (the session one has a single node); the last test
stops it, so keep that test last.
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.cluster import ClientNode, Cluster, down, leftovers, status
from tests.conftest import http_json, nomad_get, own_cluster, wait_for

pytestmark = pytest.mark.integration

NODE_B = ClientNode(
    "node-b", env={"LLMGW_FAKE_FAULT": "missing-model"}, meta={"llmgw_test_node": "b"}
)


@pytest.fixture(scope="module")
def two_nodes(binaries: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with own_cluster(tmp_path_factory.mktemp("two-nodes"), clients=(NODE_B,)) as cluster:
        yield cluster


def run_job(cluster: Cluster, hcl: str) -> str:
    """Register a job written in HCL (parsed by Nomad itself); returns its ID."""
    job = http_json(f"{cluster.nomad_addr}/v1/jobs/parse", {"JobHCL": hcl, "Canonicalize": True})
    http_json(f"{cluster.nomad_addr}/v1/jobs", {"Job": job})
    return job["ID"]


def allocations(cluster: Cluster, job_id: str, status: str) -> dict[str, dict]:
    """The job's allocations in client status `status`, by node name."""
    allocs = nomad_get(cluster, f"/v1/job/{job_id}/allocations")
    return {a["NodeName"]: a for a in allocs if a["ClientStatus"] == status}


def pinned(node: str) -> str:
    return f'constraint {{\n  attribute = "${{node.unique.name}}"\n  value = "{node}"\n}}'


def test_both_nodes_ready_each_with_its_own_identity(two_nodes: Cluster) -> None:
    nodes = {
        n["Name"]: nomad_get(two_nodes, f"/v1/node/{n['ID']}")
        for n in nomad_get(two_nodes, "/v1/nodes")
    }

    assert set(nodes) == set(two_nodes.node_names) == {two_nodes.node_name, "node-b"}
    for node in nodes.values():
        assert node["Status"] == "ready" and node["Drivers"]["raw_exec"]["Healthy"]
    assert nodes["node-b"]["Meta"]["llmgw_test_node"] == "b"
    assert len({n["CgroupParent"] for n in nodes.values()}) == 2
    consul_nodes = http_json(f"{two_nodes.consul_addr}/v1/catalog/nodes")
    assert {n["Node"] for n in consul_nodes} == {two_nodes.node_name, "node-b"}
    assert all(status(two_nodes).values()), status(two_nodes)


def test_raw_exec_task_inherits_its_node_agents_environment(two_nodes: Cluster) -> None:
    groups = "\n".join(
        f"""
group "{name}" {{
  {pinned(node)}
  task "echo" {{
    driver = "raw_exec"
    config {{
      command = "/bin/sh"
      args    = ["-c", "echo fault=$LLMGW_FAKE_FAULT"]
    }}
    resources {{
      cpu    = 50
      memory = 32
    }}
  }}
}}"""
        for name, node in (("on-b", "node-b"), ("on-dev", two_nodes.node_name))
    )
    job_id = run_job(two_nodes, f'job "env-probe" {{\n  type = "batch"\n{groups}\n}}')

    done = wait_for(
        lambda: len(found := allocations(two_nodes, job_id, "complete")) == 2 and found,
        60,
        "both probes to complete",
    )

    def stdout(alloc: dict) -> str:
        url = (
            f"{two_nodes.nomad_addr}/v1/client/fs/logs/{alloc['ID']}"
            "?task=echo&type=stdout&plain=true"
        )
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode().strip()

    assert stdout(done["node-b"]) == "fault=missing-model"
    assert stdout(done[two_nodes.node_name]) == "fault="


def test_service_spreads_over_both_nodes_and_passes_its_check(two_nodes: Cluster) -> None:
    service = "devcluster-web"
    job_id = run_job(
        two_nodes,
        f"""
job "web" {{
  group "web" {{
    count = 2
    constraint {{
      operator = "distinct_hosts"
      value    = "true"
    }}
    network {{
      port "http" {{}}
    }}
    service {{
      name = "{service}"
      port = "http"
      check {{
        type     = "http"
        path     = "/"
        interval = "1s"
        timeout  = "1s"
      }}
    }}
    task "web" {{
      driver = "raw_exec"
      config {{
        command = "{sys.executable}"
        args    = ["-m", "http.server", "--bind", "127.0.0.1", "${{NOMAD_PORT_http}}"]
      }}
      resources {{
        cpu    = 50
        memory = 64
      }}
    }}
  }}
}}""",
    )
    health = f"{two_nodes.consul_addr}/v1/health/service/{service}?passing=true"

    # Consul can pass a check before Nomad's server hears the allocation is running
    # (clients batch their allocation updates): wait for both. 60 s covers a Consul
    # client agent that syncs a check 15-30 s late (see devcluster/cluster.py).
    passing = wait_for(
        lambda: (
            len(found := http_json(health)) == 2
            and len(allocations(two_nodes, job_id, "running")) == 2
            and found
        ),
        60,
        "two running allocations, passing in Consul",
    )

    assert set(allocations(two_nodes, job_id, "running")) == {two_nodes.node_name, "node-b"}
    # Each instance is registered by its own node's Consul agent: one Consul agent
    # shared by two Nomad clients has each deregister the other's services.
    assert {entry["Node"]["Node"] for entry in passing} == {two_nodes.node_name, "node-b"}
    for entry in passing:
        url = f"http://{entry['Service']['Address']}:{entry['Service']['Port']}/"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200


def test_down_leaves_no_process_mount_or_cgroup(two_nodes: Cluster) -> None:
    """Last in this module: it stops the module's cluster."""
    job_id = run_job(
        two_nodes,
        """
job "sleeper" {
  group "sleep" {
    count = 2
    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }
    task "sleep" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["3600"]
      }
      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}""",
    )
    wait_for(
        lambda: len(allocations(two_nodes, job_id, "running")) == 2, 60, "a sleeper on each node"
    )
    sleepers = [
        pid
        for pid in leftovers(two_nodes.root)
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/bin/sleep\0")
    ]
    assert len(sleepers) == 2
    parents = [
        nomad_get(two_nodes, f"/v1/node/{n['ID']}")["CgroupParent"]
        for n in nomad_get(two_nodes, "/v1/nodes")
    ]

    down(two_nodes)

    assert leftovers(two_nodes.root) == []
    assert not any(status(two_nodes).values())
    root = str(two_nodes.root.resolve()) + "/"
    assert not [
        line
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(root)
    ]
    assert not [
        p
        for p in parents
        for base in ("/sys/fs/cgroup/cpuset", "/sys/fs/cgroup")
        if Path(base + p).exists()
    ]
