"""Engines installed per node, on two real client nodes (the dev node and `node-b`).

An engine defined in YAML is installed by its sysbatch job on every node, which records
it in the node's dynamic metadata (`llmgw_engine_<name> = <version>`, set by the install
task itself through its Task API socket and workload identity); a model's job
constrains on it. A model whose engine is on no node is unplaceable at once with the
reason, never started; once the engine installs, Nomad places it by itself. A new build
needs a new version, and a model's job runs the command its engine's install recorded.
What is defined is recorded in Consul KV, so Nomad's GC of a finished install job loses
nothing, and apply never drops a model's engine constraint.

The cluster lives under a short folder in /tmp: the Task API socket is
`<alloc dir>/<task>/secrets/api.sock`, and a unix socket path is at most 107 bytes
(pytest's own temporary folders are too deep for it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.cluster import ClientNode, Cluster
from tests.conftest import (
    PlannerDaemon,
    http_json,
    nomad_get,
    own_cluster,
    wait_for,
)
from tests.integration.test_parking import write_model
from tests.support.engines import crashing_engine
from tests.support.tls import TlsCA, serve_https

pytestmark = pytest.mark.integration

ENGINE, VERSION, VERSION2 = "llama.cpp", "11434", "11435"
META_KEY = f"llmgw_engine_{ENGINE}"


@pytest.fixture(scope="module")
def nodes(binaries: Path, test_ca: TlsCA) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-e", dir="/tmp"))
    try:
        # The agents trust the test CA: the engine artifact is served over https.
        with own_cluster(
            root, extra_env={"SSL_CERT_FILE": str(test_ca.bundle)}, clients=(ClientNode("node-b"),)
        ) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def env(nodes: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        **os.environ,
        **nodes.env,
        "LLMGW_ENGINE_ROOT": str(tmp_path_factory.mktemp("engine-root")),
    }


@pytest.fixture(scope="module")
def daemon(nodes: Cluster, env: dict[str, str]) -> Iterator[PlannerDaemon]:
    planner = PlannerDaemon(env, nodes.root / "planner.log")
    planner.start()
    try:
        yield planner
    finally:
        planner.stop()


@pytest.fixture(scope="module")
def planner(env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "planner.cli.main", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


def write_engine(folder: Path, **fields: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    body = {"name": ENGINE, "version": VERSION, **fields}
    (folder / "engine.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in body.items()))
    return folder


def node_meta(cluster: Cluster, key: str = META_KEY) -> dict[str, str | None]:
    return {
        n["Name"]: nomad_get(cluster, f"/v1/node/{n['ID']}")["Meta"].get(key)
        for n in nomad_get(cluster, "/v1/nodes")
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_model_whose_engine_is_on_no_node_is_unplaceable_at_once_then_placed_when_installed(
    nodes: Cluster,
    planner: Callable,
    daemon: PlannerDaemon,
    binaries: Path,
    tiny_model: Path,
    test_ca: TlsCA,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    server_binary = (binaries / "llama-server").resolve()
    # 1. An engine whose check fails on every node: the file at its path is not the build
    # its sha256 names (the nodes have the wrong file).
    node_binary = tmp_path / "node-bin" / "llama-server"
    node_binary.parent.mkdir()
    node_binary.write_text("#!/bin/sh\nexit 1\n")
    node_binary.chmod(0o755)
    bad = write_engine(tmp_path / "bad", path=str(node_binary), sha256=sha256(server_binary))
    installed = planner("engines", "apply", str(bad), "--wait", "--timeout", "120")
    assert installed.returncode == 1, installed.stderr
    for node in nodes.node_names:
        assert f"failed to install on {node}" in installed.stderr, installed.stderr
    assert f"sha256 is {sha256(node_binary)}, expected {sha256(server_binary)}" in installed.stderr
    listed = planner("status", "--nodes", "--output", "json")
    assert listed.returncode == 1
    rows = json.loads(listed.stdout)
    assert {(r["node"], r["install"], r["installed"]) for r in rows} == {
        (node, "failed", None) for node in nodes.node_names
    }
    assert node_meta(nodes) == dict.fromkeys(nodes.node_names)

    # 2. A model of that engine: unplaceable within 2 s, with the reason; never started.
    folder = write_model(
        tmp_path / "models",
        "eng-tiny",
        tiny_model,
        profile="context: 512\n  cpu: 100\n  memory: 256MiB\n"
        '  args: ["--threads", "1"]\n  engine: llama.cpp',
    )
    planned = json.loads(planner("apply", str(folder), "--dry-run", "--output", "json").stdout)
    assert (
        planned["changes"][0]["placement"]
        == f"engine {ENGINE} {VERSION} is installed on 0 of 2 nodes"
    )
    assert planner("apply", str(folder)).returncode == 0
    applied_at = time.monotonic()
    model = wait_for(
        lambda: (m := daemon.model("eng-tiny"))["state"] == "unplaceable" and m,
        2,
        "eng-tiny unplaceable within 2 s of apply",
    )
    print(f"engine missing: unplaceable {time.monotonic() - applied_at:.2f} s after apply")
    assert model["reason"] == f"engine {ENGINE} {VERSION} is installed on 0 of 2 nodes"
    assert (model["consecutive_failures"], model["start_failures_total"]) == (0, 0)
    assert nomad_get(nodes, "/v1/job/eng-tiny/allocations") == []
    job = nomad_get(nodes, "/v1/job/eng-tiny")
    assert {"LTarget": f"${{meta.{META_KEY}}}", "Operand": "=", "RTarget": VERSION} in job[
        "TaskGroups"
    ][0]["Constraints"]

    # 3. The nodes fixed (the right build at the path): the same definition applied again
    # runs the install again where it failed, and Nomad places the waiting model by itself.
    shutil.copy(server_binary, node_binary)
    installed = planner("engines", "apply", str(bad), "--wait", "--timeout", "120")
    assert installed.returncode == 0, installed.stderr
    assert node_meta(nodes) == dict.fromkeys(nodes.node_names, VERSION)
    model = wait_for(
        lambda: (m := daemon.model("eng-tiny"))["state"] == "serving" and m,
        90,
        "eng-tiny placed and serving once its engine is installed",
    )
    assert (model["consecutive_failures"], model["start_failures_total"]) == (0, 0)

    # 4. Another build (an artifact every node downloads and checks) under the version
    # the nodes already record is refused: the model's job would keep the old command.
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(server_binary, site / "llama-server")
    server = serve_https(site, test_ca)
    try:
        fields = {"artifact": f"{server.url}/llama-server", "sha256": sha256(server_binary)}
        same = write_engine(tmp_path / "same", **fields)
        refused = planner("engines", "apply", str(same), "--output", "json")
        assert refused.returncode == 2, refused.stderr
        [problem] = json.loads(refused.stdout)["error"]["problems"]
        assert (problem["file"], problem["field"]) == (str(same / "engine.yaml"), "version")
        assert problem["message"].startswith(
            "a changed build needs a new version: artifact None -> "
        ), problem
        good = write_engine(tmp_path / "good", version=VERSION2, **fields)
        installed = planner("engines", "apply", str(good), "--wait", "--timeout", "180")
        assert installed.returncode == 0, installed.stderr
    finally:
        server.close()
    assert node_meta(nodes) == dict.fromkeys(nodes.node_names, VERSION2)
    command = Path(env["LLMGW_ENGINE_ROOT"]) / ENGINE / VERSION2 / "llama-server"
    assert sha256(command) == sha256(server_binary) and os.access(command, os.X_OK)
    listed = planner("status", "--nodes", "--output", "json")
    assert listed.returncode == 0, listed.stdout
    assert {(r["node"], r["installed"], r["ok"]) for r in json.loads(listed.stdout)} == {
        (node, VERSION2, True) for node in nodes.node_names
    }
    again = planner("engines", "apply", str(good), "--output", "json")
    assert [c["action"] for c in json.loads(again.stdout)["changes"]] == ["unchanged"]

    # Re-applied, its job runs the installed artifact (the command changed: a rollout),
    # where the install put it, whatever LLMGW_ENGINE_ROOT this `planner apply` has.
    elsewhere = {**env, "LLMGW_ENGINE_ROOT": str(tmp_path / "not-the-install-root")}
    reapplied = subprocess.run(
        [
            sys.executable,
            "-m",
            "planner.cli.main",
            "apply",
            str(folder),
            "--wait",
            "--timeout",
            "120",
        ],
        env=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reapplied.returncode == 0, reapplied.stderr
    [alloc] = [
        a
        for a in nomad_get(nodes, "/v1/job/eng-tiny/allocations")
        if (a["DesiredStatus"], a["ClientStatus"]) == ("run", "running")
    ]
    full = nomad_get(nodes, f"/v1/allocation/{alloc['ID']}")
    assert full["Job"]["TaskGroups"][0]["Tasks"][0]["Config"]["command"] == str(command)
    assert daemon.model("eng-tiny")["start_failures_total"] == 0
    metrics = urllib.request.urlopen(f"{daemon.url}/metrics", timeout=10).read().decode()
    for node in nodes.node_names:
        assert (
            f'llmgw_engine_installed{{engine="{ENGINE}",node="{node}",version="{VERSION2}"}} 1.0'
        ) in metrics, metrics


def test_a_node_that_turns_eligible_later_gets_the_engine(
    nodes: Cluster, planner: Callable, daemon: PlannerDaemon, binaries: Path, tmp_path: Path
) -> None:
    """Nomad runs a sysbatch job on a node once per job version and evaluates sysbatch
    jobs only when they change: the leader evaluates the engine's job for a node that
    joins or turns eligible afterwards."""
    [node_b] = [n for n in nomad_get(nodes, "/v1/nodes") if n["Name"] == "node-b"]
    eligibility = f"{nodes.nomad_addr}/v1/node/{node_b['ID']}/eligibility"
    http_json(eligibility, {"NodeID": node_b["ID"], "Eligibility": "ineligible"})
    try:
        folder = tmp_path / "late"
        folder.mkdir()
        (folder / "late.yaml").write_text(
            f'name: late.cpp\nversion: "1"\npath: {(binaries / "llama-server").resolve()}\n'
        )
        installed = planner("engines", "apply", str(folder), "--wait", "--timeout", "120")
        assert installed.returncode == 0, installed.stderr
        rows = [
            r
            for r in json.loads(planner("status", "--nodes", "--output", "json").stdout)
            if r["engine"] == "late.cpp"
        ]
        assert [(r["node"], r["ok"]) for r in rows] == [(nodes.node_name, True)]
        key = "llmgw_engine_late.cpp"
        assert nomad_get(nodes, f"/v1/node/{node_b['ID']}")["Meta"].get(key) is None
    finally:
        http_json(eligibility, {"NodeID": node_b["ID"], "Eligibility": "eligible"})
    wait_for(
        lambda: nomad_get(nodes, f"/v1/node/{node_b['ID']}")["Meta"].get(key) == "1",
        60,
        "node-b to install late.cpp once eligible",
    )
    assert "node node-b lacks it; evaluated llmgw-engine-late.cpp" in daemon.log.read_text()
    listed = planner("status", "--nodes", "--output", "json")
    assert listed.returncode == 0, listed.stdout


def test_engine_records_outlive_nomads_gc_and_apply_never_drops_a_constraint(
    nodes: Cluster,
    planner: Callable,
    daemon: PlannerDaemon,
    binaries: Path,
    tiny_model: Path,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Issue 20: `nomad system gc` deletes an engine's install job once it is `dead`. The
    engine stays defined (its record in Consul KV): `status --nodes` lists it, an apply of
    the unchanged model registers nothing, and a node that lacks it gets the install job
    registered again. With the record gone too, apply refuses the model instead of rolling
    it out without its engine constraint. LLMGW_ENGINES names the engine as well (as the
    default llama.cpp is): what made the rollout silent."""
    name, key, server = "gc.cpp", "llmgw_engine_gc.cpp", (binaries / "llama-server").resolve()
    job_id = f"llmgw-engine-{name}"
    folder = tmp_path / "engine"
    folder.mkdir()
    (folder / "gc.yaml").write_text(f'name: {name}\nversion: "1"\npath: {server}\n')
    assert planner("engines", "apply", str(folder), "--wait", "--timeout", "120").returncode == 0
    models = tmp_path / "models"
    models.mkdir()
    # On demand: its job (count 0) carries the constraint and runs nothing.
    (models / "gc-tiny.yaml").write_text(
        f"name: gc-tiny\nsource: file://{tiny_model}\nreplicas: 1\n"
        "on_demand:\n  idle_after: 600\n"
        "profile:\n  context: 512\n  cpu: 100\n  memory: 256MiB\n  engine: gc.cpp\n"
    )
    both = {**env, "LLMGW_ENGINES": f"{name}={server}"}

    def apply() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "planner.cli.main", "apply", str(models), "--output", "json"],
            env=both,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert apply().returncode == 0
    constraint = {"LTarget": f"${{meta.{key}}}", "Operand": "=", "RTarget": "1"}
    before = nomad_get(nodes, "/v1/job/gc-tiny")
    assert constraint in before["TaskGroups"][0]["Constraints"]

    # 1. Nomad's GC deletes the dead install job (as it does by itself after
    # job_gc_threshold).
    wait_for(
        lambda: nomad_get(nodes, f"/v1/job/{job_id}")["Status"] == "dead", 60, f"{job_id} dead"
    )
    urllib.request.urlopen(
        urllib.request.Request(f"{nodes.nomad_addr}/v1/system/gc", method="PUT"), timeout=30
    )
    wait_for(lambda: not _exists(nodes, job_id), 30, f"{job_id} garbage-collected")
    listed = planner("status", "--nodes", "--output", "json")
    assert listed.returncode == 0, listed.stdout
    rows = [r for r in json.loads(listed.stdout) if r["engine"] == name]
    assert {(r["node"], r["installed"], r["ok"]) for r in rows} == {
        (node, "1", True) for node in nodes.node_names
    }
    again = apply()
    assert again.returncode == 0, again.stderr
    assert _action(again, "gc-tiny") == "unchanged"
    after = nomad_get(nodes, "/v1/job/gc-tiny")
    assert (after["Version"], after["JobModifyIndex"]) == (
        before["Version"],
        before["JobModifyIndex"],
    )

    # 2. A node that lacks it (its metadata unset, then it turns eligible again): the
    # leader registers the install job again from the record, and the node installs it.
    [node_b] = [n for n in nomad_get(nodes, "/v1/nodes") if n["Name"] == "node-b"]
    eligibility = f"{nodes.nomad_addr}/v1/node/{node_b['ID']}/eligibility"
    http_json(eligibility, {"NodeID": node_b["ID"], "Eligibility": "ineligible"})
    http_json(
        f"{nodes.nomad_addr}/v1/client/metadata?node_id={node_b['ID']}", {"Meta": {key: None}}
    )
    wait_for(
        lambda: key not in nomad_get(nodes, f"/v1/node/{node_b['ID']}")["Meta"],
        30,
        f"node-b without {key}",
    )
    http_json(eligibility, {"NodeID": node_b["ID"], "Eligibility": "eligible"})
    wait_for(
        lambda: nomad_get(nodes, f"/v1/node/{node_b['ID']}")["Meta"].get(key) == "1",
        60,
        "node-b to install gc.cpp again",
    )
    assert f"engine {name}: node node-b lacks it and Nomad no longer has its install job" in (
        daemon.log.read_text()
    )

    # 3. Its install job purged and its record deleted: the engine is known to no one, and
    # apply refuses the model (exit 1) rather than drop its constraint.
    urllib.request.urlopen(
        urllib.request.Request(f"{nodes.nomad_addr}/v1/job/{job_id}?purge=true", method="DELETE"),
        timeout=30,
    )
    urllib.request.urlopen(
        urllib.request.Request(f"{nodes.consul_addr}/v1/kv/llmgw/engines/{name}", method="DELETE"),
        timeout=30,
    )
    refused = apply()
    assert refused.returncode == 1, refused.stderr
    assert _action(refused, "gc-tiny") == "engine-unknown"
    assert (
        "error: gc-tiny: its job runs engine gc.cpp 1 (constraint ${meta.llmgw_engine_gc.cpp} "
        "= 1), which is not defined now"
    ) in refused.stderr, refused.stderr
    assert "run `planner engines apply` with gc.cpp's file first" in refused.stderr
    assert nomad_get(nodes, "/v1/job/gc-tiny")["JobModifyIndex"] == before["JobModifyIndex"]


def _action(applied: subprocess.CompletedProcess[str], model: str) -> str:
    """What `apply --output json` did with `model` (the other models of this module's
    earlier tests are `orphaned` there)."""
    [action] = [c["action"] for c in json.loads(applied.stdout)["changes"] if c["model"] == model]
    return action


def _exists(cluster: Cluster, job_id: str) -> bool:
    try:
        nomad_get(cluster, f"/v1/job/{job_id}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise
    return True


# Last in this module: its engines stay failed on every node, and `status --nodes`
# exits 1 from then on.
def test_an_engine_that_crashes_on_a_node_is_recorded_nowhere_and_its_model_never_starts(
    nodes: Cluster,
    planner: Callable,
    daemon: PlannerDaemon,
    tiny_model: Path,
    binaries: Path,
    tmp_path: Path,
) -> None:
    """Issue 17: a build that dies of SIGILL (or SIGSEGV) on a node's CPU is not recorded
    there; `status --nodes` names the signal per node, and a model naming it is
    unplaceable with that reason, never started."""
    folder = tmp_path / "crashing"
    folder.mkdir()
    crashes = {
        "segv.cpp": ("SEGV", "SIGSEGV (exit 139)"),
        "ill.cpp": (
            "ILL",
            "SIGILL (exit 132): illegal instruction (the engine build "
            "uses CPU instructions this node lacks)",
        ),
    }
    for name, (signal, _) in crashes.items():
        program = crashing_engine(tmp_path / "bin" / name, signal)
        (folder / f"{name}.yaml").write_text(f'name: {name}\nversion: "1"\npath: {program}\n')
    # One that passes `--version` and dies serving its check model (a build that dies on
    # its first graph compute), and the real server with the same check: installed.
    loading = tmp_path / "bin" / "load-segv.cpp"
    loading.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo "version: 1"; exit 0; }\n'
        f"exec {crashing_engine(tmp_path / 'bin' / 'segv', 'SEGV')}\n"
    )
    loading.chmod(0o755)
    real = (binaries / "llama-server").resolve()
    for name, program in (("load-segv.cpp", loading), ("checked.cpp", real)):
        (folder / f"{name}.yaml").write_text(
            f'name: {name}\nversion: "1"\npath: {program}\ncheck_model: {tiny_model}\n'
        )
    installed = planner("engines", "apply", str(folder), "--wait", "--timeout", "120")
    assert installed.returncode == 1, installed.stderr
    assert "--version crashed: SIG" in installed.stderr, installed.stderr
    crashes["load-segv.cpp"] = ("", "SIGSEGV (exit 139)")

    def rows() -> list[dict]:
        listed = json.loads(planner("status", "--nodes", "--output", "json").stdout)
        return [r for r in listed if r["engine"] in crashes]

    failed = wait_for(
        lambda: (found := rows()) and all(r["install"] == "failed" for r in found) and found,
        120,
        "both installs failed on every node",
    )
    assert {(r["engine"], r["node"], r["installed"], r["ok"], r["crash"]) for r in failed} == {
        (name, node, None, False, how)
        for name, (_, how) in crashes.items()
        for node in nodes.node_names
    }
    for r in failed:
        checked = f"serving {tiny_model}" if r["engine"] == "load-segv.cpp" else "--version"
        assert r["error"].endswith(
            f"{tmp_path}/bin/{r['engine']} {checked} crashed: {crashes[r['engine']][1]}"
        ), r
    # The real build served its check model and completed a token on every node.
    wait_for(
        lambda: (
            node_meta(nodes, "llmgw_engine_checked.cpp") == dict.fromkeys(nodes.node_names, "1")
        ),
        120,
        "checked.cpp installed everywhere",
    )
    table = planner("status", "--nodes")
    assert table.returncode == 1 and "SIGILL" in table.stdout and "SIGSEGV" in table.stdout
    for node in nomad_get(nodes, "/v1/nodes"):
        meta = nomad_get(nodes, f"/v1/node/{node['ID']}")["Meta"]
        assert not {f"llmgw_engine_{name}" for name in crashes} & set(meta), meta

    models = write_model(
        tmp_path / "models",
        "ill-tiny",
        tiny_model,
        profile="context: 512\n  cpu: 100\n  memory: 256MiB\n"
        '  args: ["--threads", "1"]\n  engine: ill.cpp',
    )
    assert planner("apply", str(models)).returncode == 0
    model = wait_for(
        lambda: (m := daemon.model("ill-tiny"))["state"] == "unplaceable" and m,
        30,
        "ill-tiny unplaceable",
    )
    assert model["reason"] == (
        f"engine ill.cpp 1 crashed on nodes "
        f"{', '.join(sorted(nodes.node_names))}: {crashes['ill.cpp'][1]} "
        f"(installed on 0 of 2 nodes)"
    ), model
    assert (model["consecutive_failures"], model["start_failures_total"]) == (0, 0)
    assert nomad_get(nodes, "/v1/job/ill-tiny/allocations") == []
