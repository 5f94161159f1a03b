"""NOMAD_NAMESPACE on real agents (issue 20 item 1): a planner managing namespace `llm`
counts and parks a failing model there, activates an on-demand model there through its
admin API, prunes there, and `planner apply` in another namespace refuses a second copy
of a model `llm` already runs (one Consul service per model name).

One cluster of its own (a fresh Consul: the planner's KV, leader lock and services are
one per Consul, and the session's default-namespace planner must not lead here); the
failing and the on-demand models are applied once, up front, so the failing model's
five starts overlap the other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devcluster.cluster import Cluster
from tests.conftest import ADMIN_TOKEN, PlannerDaemon, http_json, own_cluster, wait_for
from tests.integration.test_parking import QUICK_RESTARTS
from tests.support.engines import write_engines
from tests.support.ports import free_port
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

NAMESPACE = "llm"
KEV_ERROR = "unknown model architecture: 'kev'"
SMALL = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'
FAILING, ON_DEMAND = "ns-kev", "ns-od"


@dataclass
class Namespaced:
    cluster: Cluster
    env: dict[str, str]  # the planner's, NOMAD_NAMESPACE=llm
    daemon: PlannerDaemon
    folder: Path  # both models' files
    kev: Path
    tiny: Path
    applied_at: float

    def planner(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "planner.cli.main", *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def nomad(self, path: str, namespace: str = NAMESPACE) -> Any:
        sep = "&" if "?" in path else "?"
        return http_json(f"{self.cluster.nomad_addr}{path}{sep}namespace={namespace}")


def write_model(folder: Path, name: str, source: Path, extra: str = "") -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\nsource: file://{source}\nprofile:\n  {SMALL}\nreplicas: 1\n{extra}"
    )


def job_absent(ns: Namespaced, name: str, namespace: str) -> bool:
    try:
        ns.nomad(f"/v1/job/{name}", namespace)
    except urllib.error.HTTPError as exc:
        return exc.code == 404
    return False


@pytest.fixture(scope="module")
def ns(binaries: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaced]:
    root = tmp_path_factory.mktemp("namespaces")
    with own_cluster(root / "cluster") as cluster:
        created = subprocess.run(
            [str(binaries / "nomad"), "namespace", "apply", NAMESPACE],
            env={**os.environ, **cluster.env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert created.returncode == 0, created.stderr
        engines = write_engines(root / "engines", binaries / "llama-server")
        env = {
            **os.environ,
            **cluster.env,
            "NOMAD_NAMESPACE": NAMESPACE,
            "LLMGW_ENGINES": ",".join(f"{k}={v}" for k, v in engines.items()),
        }
        kev = write_tiny_gguf(root / "kev.gguf", architecture="kev")
        tiny = write_tiny_gguf(root / "tiny.gguf")
        folder = root / "models"
        write_model(folder, FAILING, kev, QUICK_RESTARTS)
        write_model(folder, ON_DEMAND, tiny, "on_demand:\n  idle_after: 15m\n")
        daemon = PlannerDaemon(env, root / "planner.log")
        daemon.start()
        try:
            ns = Namespaced(cluster, env, daemon, folder, kev, tiny, time.monotonic())
            applied = ns.planner("apply", str(folder))
            assert applied.returncode == 0, applied.stderr
            ns.applied_at = time.monotonic()
            yield ns
        finally:
            daemon.stop()


def test_a_namespace_nomad_does_not_have_is_an_error_at_start(ns: Namespaced) -> None:
    for command in (("status",), ("apply", "--dry-run", str(ns.folder))):
        run = ns.planner(*command, NOMAD_NAMESPACE="lmm")
        assert run.returncode == 2, run.stderr
        assert "NOMAD_NAMESPACE=lmm: Nomad at" in run.stderr
        assert "has no namespace 'lmm'; create it (nomad namespace apply lmm)" in run.stderr
    # `planner serve` too, at once, rather than leading a namespace that lists nothing.
    serve = ns.planner("serve", "--port", str(free_port()), NOMAD_NAMESPACE="lmm")
    assert serve.returncode == 2 and "has no namespace 'lmm'" in serve.stderr, serve.stderr


def test_on_demand_model_is_activated_in_the_namespace(ns: Namespaced) -> None:
    assert ns.nomad(f"/v1/job/{ON_DEMAND}")["TaskGroups"][0]["Count"] == 0
    started = time.monotonic()
    request = urllib.request.Request(
        f"{ns.daemon.url}/v1/models/{ON_DEMAND}/activate",
        data=b"",
        method="POST",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
    assert answer["status"] in ("loading", "serving"), answer
    assert ns.nomad(f"/v1/job/{ON_DEMAND}")["TaskGroups"][0]["Count"] == 1
    wait_for(
        lambda: ns.daemon.model(ON_DEMAND)["state"] == "serving",
        60,
        f"{ON_DEMAND} serving in {NAMESPACE}",
    )
    print(f"activation to serving in {NAMESPACE}: {time.monotonic() - started:.1f} s")
    assert job_absent(ns, ON_DEMAND, "default")


def test_failing_model_is_counted_and_parked_in_the_namespace(ns: Namespaced) -> None:
    parked = wait_for(
        lambda: (m := ns.daemon.model(FAILING))["state"] == "parked" and m,
        120,
        f"{FAILING} parked in {NAMESPACE}",
    )
    print(f"apply to parked in {NAMESPACE}: {time.monotonic() - ns.applied_at:.1f} s")
    assert parked["consecutive_failures"] == 5 and parked["start_failures_total"] == 5
    assert KEV_ERROR in parked["last_error"]
    job = ns.nomad(f"/v1/job/{FAILING}")
    assert job["Stop"] is True and job["Namespace"] == NAMESPACE
    assert job["Meta"]["llmgw_parked_reason"] == "5 consecutive start failures"
    assert KEV_ERROR in job["Meta"]["llmgw_parked_last_error"]
    metrics = urllib.request.urlopen(f"{ns.daemon.url}/metrics", timeout=10).read().decode()
    assert f'llmgw_model_start_failures_total{{model="{FAILING}"}} 5.0' in metrics
    status = ns.planner("status")
    assert status.returncode == 1 and "parked" in status.stdout and KEV_ERROR in status.stdout
    assert job_absent(ns, FAILING, "default")


def test_a_second_copy_in_another_namespace_is_refused(ns: Namespaced) -> None:
    refused = ns.planner("apply", str(ns.folder), NOMAD_NAMESPACE="default")
    assert refused.returncode == 2, refused.stderr
    for name in (FAILING, ON_DEMAND):
        assert f"model {name!r} already has an llmgw job in Nomad namespace 'llm'" in refused.stderr
        assert f"Consul service llmgw-{name}" in refused.stderr
        assert job_absent(ns, name, "default")
    assert "this planner manages namespace 'default' (NOMAD_NAMESPACE)" in refused.stderr
    assert "nomad job stop -purge -namespace llm ns-kev" in refused.stderr
    dry = ns.planner("apply", "--dry-run", str(ns.folder), NOMAD_NAMESPACE="default")
    assert dry.returncode == 2 and "already has an llmgw job" in dry.stderr


def test_prune_removes_in_the_namespace(ns: Namespaced, tmp_path: Path) -> None:
    """Only this namespace's models: a model another planner runs in `default` (one
    Consul holds both records) is not pruned from `llm` (found by a new user: its record
    was deleted)."""
    other = tmp_path / "default-models"
    other.mkdir()
    (other / "ns-default.yaml").write_text(
        f"name: ns-default\nsource: file://{ns.tiny}\nprofile:\n  {SMALL}\nreplicas: 0\n"
    )
    there = ns.planner("apply", str(other), NOMAD_NAMESPACE="default")
    assert there.returncode == 0, there.stderr
    only_kev = tmp_path / "models"
    write_model(only_kev, FAILING, ns.kev, QUICK_RESTARTS)
    pruned = ns.planner("apply", "--prune", "--output", "json", str(only_kev))
    assert pruned.returncode == 0, pruned.stderr
    actions = {c["model"]: c["action"] for c in json.loads(pruned.stdout)["changes"]}
    assert actions == {FAILING: "parked", ON_DEMAND: "deregister"}
    record = http_json(f"{ns.cluster.consul_addr}/v1/kv/llmgw/models/ns-default")
    assert record and record[0]["Key"] == "llmgw/models/ns-default"
    assert not job_absent(ns, "ns-default", "default")
    assert job_absent(ns, ON_DEMAND, NAMESPACE)
    wait_for(
        lambda: (
            not http_json(
                f"{ns.cluster.consul_addr}/v1/health/service/llmgw-{ON_DEMAND}?passing=true"
            )
        ),
        30,
        f"llmgw-{ON_DEMAND} gone from Consul",
    )
    assert ns.nomad(f"/v1/job/{FAILING}")["Stop"] is True
