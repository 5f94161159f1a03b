"""The planner and router jobs on agents that serve HTTPS only and require a client
certificate (QA on issue 11: the jobs and the Terraform module could not be pointed at
TLS agents, and the planner job advertised http:// whatever its admin API served).

jobspecs/planner.nomad.hcl and jobspecs/router.nomad.hcl run with `nomad job run -var`
on this module's own TLS cluster (`Cluster(..., tls=TlsFiles(...))`), given the CA and
the client certificate as paths on the node (`nomad_cacert`, `consul_ssl`,
`consul_cacert`...), the address of Consul without a scheme (`consul_ssl` makes it
https). The planner's serving certificate comes from the settings in Consul KV
(LLMGW_TLS_CERT), which the jobspec does not see: the planner, given `--advertise
HOST:PORT`, advertises https:// itself. The router's files come as PEM text in its
Nomad variable instead (items CONSUL_CACERT_PEM...), which the job writes to its
secrets/ folder.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.bootstrap import BIN, REPO
from devcluster.cluster import Cluster, TlsFiles, client_context
from llmgw_contract import LEADER_KEY, ROUTER_SERVICE, LeaderRecord, decode
from tests.conftest import ADMIN_TOKEN, own_cluster, wait_for
from tests.integration.test_deploy_jobs import CONFIG_PREFIX
from tests.support.tls import TlsCA, issue, make_ca
from tests.support.wheel import base_python, build_wheel, build_wheelhouse, serve_folder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PLANNER_JOB, ROUTER_JOB = "llmgw-planner", "llmgw-router"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TlsCA:
    return make_ca(tmp_path_factory.mktemp("deploy-pki"))


@pytest.fixture(scope="module")
def tls_cluster(binaries: Path, ca: TlsCA) -> Iterator[Cluster]:
    folder = ca.ca_cert.parent
    client_cert, client_key = issue(ca, folder, "client", client=True)
    files = TlsFiles(ca.ca_cert, ca.cert, ca.key, client_cert, client_key)
    with own_cluster(folder / "cluster", tls=files) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def install_vars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The wheel and a wheelhouse of its dependencies, served on 127.0.0.1 (plain HTTP:
    Nomad's artifact downloader fetches it), as the jobspecs' variables."""
    folder = tmp_path_factory.mktemp("dist")
    wheel = build_wheel(folder)
    build_wheelhouse(wheel, folder / "wheelhouse")
    with serve_folder(folder) as url:
        yield {
            "wheel_url": f"{url}/{wheel.name}",
            "wheelhouse_url": f"{url}/wheelhouse/",
            "python": base_python(),
        }


def cli(cluster: Cluster, *argv: str) -> None:
    """The `nomad` or `consul` CLI, with the cluster's TLS variables."""
    done = subprocess.run(
        [str(BIN / argv[0]), *argv[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **cluster.env},
    )
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"


def nomad_run(cluster: Cluster, jobspec: str, variables: dict[str, Any]) -> None:
    argv = ["nomad", "job", "run", "-detach"]
    for name, value in variables.items():
        argv += ["-var", f"{name}={value}"]
    cli(cluster, *argv, str(REPO / "jobspecs" / jobspec))


def put_variable(cluster: Cluster, job: str, items: dict[str, str]) -> None:
    """The Nomad variable nomad/jobs/<job>, over the agent's HTTPS API."""
    body = json.dumps({"Namespace": "default", "Path": f"nomad/jobs/{job}", "Items": items})
    request = urllib.request.Request(
        f"{cluster.nomad_addr}/v1/var/nomad/jobs/{job}", data=body.encode(), method="PUT"
    )
    with urllib.request.urlopen(request, timeout=10, context=client_context(cluster)):
        pass


def agent_json(cluster: Cluster, url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10, context=client_context(cluster)) as answer:
        return json.load(answer)


def tls_vars(cluster: Cluster) -> dict[str, str]:
    """Both jobs' variables for TLS to this cluster's agents: paths on the node."""
    files = cluster.tls
    assert files is not None
    return {
        "consul_addr": cluster.env["CONSUL_HTTP_ADDR"],
        "consul_ssl": "true",
        "consul_cacert": str(files.ca),
        "consul_client_cert": str(files.client_cert),
        "consul_client_key": str(files.client_key),
    }


def deployed(cluster: Cluster, job: str, timeout: float = 300) -> None:
    def successful() -> bool:
        deployment = agent_json(cluster, f"{cluster.nomad_addr}/v1/job/{job}/deployment")
        if deployment and deployment["Status"] in ("failed", "cancelled"):
            allocations = agent_json(cluster, f"{cluster.nomad_addr}/v1/job/{job}/allocations")
            events = [
                state["Events"][-1]["DisplayMessage"]
                for a in allocations
                for state in (a.get("TaskStates") or {}).values()
                if state["Events"]
            ]
            pytest.fail(f"{job}: deployment {deployment['Status']}: {events}")
        return bool(deployment) and deployment["Status"] == "successful"

    wait_for(successful, timeout, f"{job} deployed")


def test_the_jobs_reach_tls_agents_and_the_planner_advertises_https(
    tls_cluster: Cluster, ca: TlsCA, binaries: Path, install_vars: dict[str, str]
) -> None:
    files = tls_cluster.tls
    assert files is not None
    planner_cert, planner_key = issue(ca, ca.ca_cert.parent, "planner")
    for key, value in {
        "LLMGW_ENGINES": f"llama.cpp={binaries / 'llama-server'}",
        "LLMGW_TLS_CERT": str(planner_cert),
        "LLMGW_TLS_KEY": str(planner_key),
        "LLMGW_PLANNER_CACERT": str(ca.ca_cert),
    }.items():
        cli(tls_cluster, "consul", "kv", "put", f"{CONFIG_PREFIX}/{PLANNER_JOB}/{key}", value)
    cli(
        tls_cluster,
        "nomad",
        "var",
        "put",
        f"nomad/jobs/{PLANNER_JOB}",
        f"LLMGW_ADMIN_TOKEN={ADMIN_TOKEN}",
    )
    # The router's TLS files travel as PEM text in its Nomad variable instead (items
    # <VARIABLE>_PEM): the job writes them to secrets/ and points the variables at them.
    put_variable(
        tls_cluster,
        ROUTER_JOB,
        {
            "LLMGW_PLANNER_TOKEN": ADMIN_TOKEN,
            "CONSUL_CACERT_PEM": files.ca.read_text(),
            "CONSUL_CLIENT_CERT_PEM": files.client_cert.read_text(),
            "CONSUL_CLIENT_KEY_PEM": files.client_key.read_text(),
            "LLMGW_PLANNER_CACERT_PEM": ca.ca_cert.read_text(),
        },
    )

    nomad_run(
        tls_cluster,
        "planner.nomad.hcl",
        {
            **install_vars,
            **tls_vars(tls_cluster),
            "instances": 1,
            "nomad_addr": tls_cluster.nomad_addr,
            "nomad_cacert": str(files.ca),
            "nomad_client_cert": str(files.client_cert),
            "nomad_client_key": str(files.client_key),
        },
    )
    nomad_run(
        tls_cluster,
        "router.nomad.hcl",
        {
            **install_vars,
            "consul_addr": tls_cluster.env["CONSUL_HTTP_ADDR"],
            "consul_ssl": "true",
            "instances": 1,
        },
    )
    deployed(tls_cluster, PLANNER_JOB)
    deployed(tls_cluster, ROUTER_JOB)

    # The planner leads (a Consul session over TLS) and advertises its https address.
    def leader() -> str | None:
        entries = agent_json(tls_cluster, f"{tls_cluster.consul_addr}/v1/kv/{LEADER_KEY}")
        record = decode(LeaderRecord, base64.b64decode(entries[0]["Value"]))
        return record.address if entries[0].get("Session") else None

    address = wait_for(leader, 60, "the planner job's instance to lead")
    assert address.startswith("https://"), address
    trust = ssl.create_default_context(cafile=ca.ca_cert)

    def health() -> dict[str, Any]:
        with urllib.request.urlopen(f"{address}/health", timeout=10, context=trust) as answer:
            return json.load(answer)

    # Ready: the leader reconciled with Nomad's jobs, read over TLS with its client
    # certificate.
    assert (
        wait_for(lambda: (h := health())["ready"] and h, 60, "the leader reconciled with Nomad")[
            "role"
        ]
        == "leader"
    )

    # The router read Consul over TLS: its check passes (200 once it has read Consul).
    passing = wait_for(
        lambda: agent_json(
            tls_cluster,
            f"{tls_cluster.consul_addr}/v1/health/service/{ROUTER_SERVICE}?passing=true",
        ),
        60,
        "the router job's instance passing its check",
    )
    service = passing[0]["Service"]
    with urllib.request.urlopen(
        f"http://{service['Address']}:{service['Port']}/health", timeout=10
    ) as answer:
        assert answer.status == 200
