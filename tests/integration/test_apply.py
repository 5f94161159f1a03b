"""`planner apply` against real Nomad and Consul: C01 (bad input changes nothing),
C02 (a second run registers nothing), dry-run, prune, and the GPU rendering."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from tests.conftest import http_json, nomad_get, stop_job

pytestmark = pytest.mark.integration


def job_or_none(cluster: Cluster, job_id: str) -> dict | None:
    try:
        return nomad_get(cluster, f"/v1/job/{job_id}")
    except Exception:
        return None


def actions(result: subprocess.CompletedProcess[str], model: str) -> list[str]:
    """The actions an `apply --output json` run reports for one model (the cluster is
    shared, so other tests' models show up as orphaned)."""
    return [c["action"] for c in json.loads(result.stdout)["changes"] if c["model"] == model]


def test_c01_invalid_files_register_nothing(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path], tiny_model: Path
) -> None:
    source = f"file://{tiny_model}"  # under the models root, so only the problem meant counts
    folder = model_files("c01-valid")
    model_files("c01-other", replicas=0)
    (folder / "unknown-key.yaml").write_text(
        f"name: c01-a\nsource: {source}\nprofile: {{}}\nreplica: 2\n"
    )
    (folder / "bad-name.yaml").write_text(f"name: C01_Bad\nsource: {source}\nprofile: {{}}\n")
    (folder / "negative.yaml").write_text(f"name: c01-b\nsource: {source}\nprofile:\n  gpus: -1\n")
    (folder / "dup.yaml").write_text(f"name: c01-valid\nsource: {source}\nprofile: {{}}\n")
    (folder / "tabs.yaml").write_text("name: c01-c\nprofile:\n\tgpus: 1\n")
    (folder / "empty.yaml").write_text("")

    result = planner("apply", str(folder))

    assert result.returncode == 2, result.stderr
    expected = [
        ("unknown-key.yaml", "replica: unknown field"),
        ("bad-name.yaml", "name: expected a DNS label"),
        ("negative.yaml", "profile.gpus: Input should be greater than or equal to 0"),
        ("dup.yaml", "name: model 'c01-valid' is already defined in"),
        ("tabs.yaml", "spaces, not tabs"),
        ("empty.yaml", "file is empty"),
    ]
    for filename, message in expected:
        assert any(filename in line and message in line for line in result.stderr.splitlines()), (
            f"{filename}: {message!r} not in:\n{result.stderr}"
        )
    assert "nothing was changed" in result.stderr
    assert job_or_none(cluster, "c01-valid") is None
    assert job_or_none(cluster, "c01-other") is None


PROFILE = "context: 512\n  cpu: 100\n  memory: 256MiB\n  args: "

# Issue 18: args that would reach beyond the model on every node, each as
# (model, args, the refusal's field and start).
REACHING_ARGS = [
    (
        "r-log-file",
        '["--log-file", "/etc/cron.d/x"]',
        "profile.args.0: --log-file reads or writes a file on the node, as the model task's "
        "user (root under raw_exec by default); remove it and its value",
    ),
    (
        "r-slot-save",
        '["--threads", "1", "--slot-save-path", "/"]',
        "profile.args.2: --slot-save-path reads or writes a file on the node",
    ),
    ("r-path", '["--path", "/"]', "profile.args.0: --path reads or writes a file"),
    (
        "r-template-file",
        '["--chat-template-file", "/etc/shadow"]',
        "profile.args.0: --chat-template-file reads or writes a file",
    ),
    (
        "r-grammar-file",
        '["--grammar-file", "/etc/shadow"]',
        "profile.args.0: --grammar-file reads or writes a file",
    ),
    ("r-lora", '["--lora", "/root/x.gguf"]', "profile.args.0: --lora reads or writes a file"),
    ("r-mmproj", '["-mm", "/root/x.gguf"]', "profile.args.0: -mm reads or writes a file"),
    (
        "r-draft",
        '["--model-draft", "/root/x.gguf"]',
        "profile.args.0: --model-draft loads weights other than `source`'s",
    ),
    ("r-underscore", '["--log_file", "/x"]', "profile.args.0: --log_file reads or writes"),
    ("r-joined", '["--log-file=/x"]', "profile.args.0: --log-file reads or writes"),
    (
        "r-rpc",
        '["--rpc", "10.0.0.1:50052"]',
        "profile.args.0: --rpc reaches beyond the replica's own port from the node",
    ),
    ("r-tools", '["--tools", "all"]', "profile.args.0: --tools runs programs or tools"),
    ("r-hf", '["-hf", "org/repo"]', "profile.args.0: -hf loads weights other than"),
    ("r-unknown", '["--not-a-flag"]', "profile.args.0: --not-a-flag is not a flag of llama-server"),
    (
        "r-interpolated",
        '["--threads", "${attr.cpu.numcores}"]',
        "profile.args.1: argument '${attr.cpu.numcores}' contains '${'",
    ),
]


def test_c01_args_and_sources_that_reach_beyond_the_model_register_nothing(
    cluster: Cluster,
    planner: Callable,
    model_files: Callable[..., Path],
    models_root: Path,
) -> None:
    folder = model_files("r-valid", replicas=0)
    for name, args, _ in REACHING_ARGS:
        model_files(name, replicas=0, profile=PROFILE + args)
    outside = Path(str(models_root) + "-elsewhere")
    (models_root / "key.gguf").symlink_to(Path("/etc/hostname"))
    # Issue 18 QA, D5: links to folders elsewhere, the file behind them missing here.
    (models_root / "etc-link").symlink_to(Path("/etc"))
    (models_root / "up-link").symlink_to("../")
    above = Path(os.path.realpath(models_root)).parent
    sources = [
        (
            "s-outside",
            f"file://{outside}/m.gguf",
            # The integration tests' roots: their temp folder and /opt/llmgw/models.
            f"source: {outside}/m.gguf is outside the models roots "
            f"{os.environ['LLMGW_MODELS_ROOT']} (LLMGW_MODELS_ROOT)",
        ),
        (
            "s-dotdot",
            f"file://{models_root}/../../etc/shadow",
            f"source: {models_root}/../../etc/shadow has a '..' segment",
        ),
        (
            "s-link",
            f"file://{models_root}/key.gguf",
            f"source: {models_root}/key.gguf leads through a link on this machine to "
            f"{os.path.realpath('/etc/hostname')}, outside the models root {models_root}",
        ),
        (
            "s-dirlink",
            f"file://{models_root}/etc-link/nonexistent_key",
            f"source: {models_root}/etc-link/nonexistent_key leads through a link on this "
            f"machine to {os.path.realpath('/etc')}/nonexistent_key, outside the models root",
        ),
        (
            "s-up",
            f"file://{models_root}/up-link/x.gguf",
            f"source: {models_root}/up-link/x.gguf leads through a link on this machine to "
            f"{above}/x.gguf, outside the models root",
        ),
        (
            "s-percent",
            f"file://{models_root}/%2e%2e/%2e%2e/etc/shadow",
            f"source: {models_root}/%2e%2e/%2e%2e/etc/shadow has a '%': the node opens the "
            "path as written",
        ),
        (
            "s-backslash",
            f"file://{models_root}/..\\..\\etc\\shadow",
            f"source: {models_root}/..\\..\\etc\\shadow has a '\\'",
        ),
        (
            "s-dot",
            f"file://{models_root}/./m.gguf",
            f"source: {models_root}/./m.gguf has a '.' segment",
        ),
        # Issue 18 QA, D3: a percent-encoded `${` in a split source's file name reached
        # the artifact's destination and the args decoded, and Nomad interpolated it.
        (
            "s-encoded",
            "https://127.0.0.1:8443/%24%7Bnode.unique.name%7D-00001-of-00002.gguf",
            "source: the file name '${node.unique.name}-00001-of-00002.gguf' (percent-decoded) "
            "is not a plain file name",
        ),
        (
            "s-interpolated",
            "https://h/${node.unique.id}/m.gguf",
            "source: the source contains '${', which Nomad would interpolate",
        ),
        ("s-hf", "hf://${meta.org}/repo/m.gguf", "source: the source contains '${'"),
    ]
    for name, source, _ in sources:
        model_files(name, replicas=0, source=source)
    model_files("s-sha256", replicas=0, source="https://h/m.gguf", extra="sha256: ${meta.sum}\n")
    sources.append(
        (
            "s-sha256",
            "",
            "sha256: expected a sha256 (64 hex digits) or a list of them, got '${meta.sum}'",
        )
    )

    result = planner("apply", str(folder))

    assert result.returncode == 2, result.stderr
    for name, _, expected in REACHING_ARGS + sources:
        assert any(f"{name}.yaml: {expected}" in line for line in result.stderr.splitlines()), (
            f"{name}: {expected!r} not in:\n{result.stderr}"
        )
    assert "nothing was changed" in result.stderr
    for name in ["r-valid"] + [n for n, _, _ in REACHING_ARGS + sources]:
        assert job_or_none(cluster, name) is None, name
    try:
        records = http_json(f"{cluster.consul_addr}/v1/kv/llmgw/models/?keys=true")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:  # 404: no model records at all
            raise
        records = []
    assert not [key for key in records if key.split("/")[-1].startswith(("r-", "s-"))]


def test_c02_second_apply_registers_nothing(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    folder = model_files("c02-twice", replicas=0)

    first = planner("apply", str(folder), "--output", "json")
    assert first.returncode == 0, first.stderr
    assert actions(first, "c02-twice") == ["create"]
    versions_before = nomad_get(cluster, "/v1/job/c02-twice/versions")["Versions"]

    second = planner("apply", str(folder), "--output", "json")
    assert second.returncode == 0, second.stderr
    assert [
        c["action"] for c in json.loads(second.stdout)["changes"] if c["model"] == "c02-twice"
    ] == ["unchanged"]
    assert "no changes" in second.stderr
    versions_after = nomad_get(cluster, "/v1/job/c02-twice/versions")["Versions"]
    assert len(versions_after) == len(versions_before) == 1


def test_replica_change_updates_without_changing_definition_hash(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    folder = model_files("scale-only", replicas=0)
    assert planner("apply", str(folder)).returncode == 0
    before = nomad_get(cluster, "/v1/job/scale-only")["Meta"]
    model_files("scale-only", replicas=1)

    plan = planner("apply", str(folder), "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert '+/- Count: "0" => "1"' in plan.stdout
    assert nomad_get(cluster, "/v1/job/scale-only")["TaskGroups"][0]["Count"] == 0

    applied = planner("apply", str(folder), "--output", "json")
    [change] = [c for c in json.loads(applied.stdout)["changes"] if c["model"] == "scale-only"]
    assert (change["action"], change["reason"]) == ("update", "replicas 0 -> 1")
    after = nomad_get(cluster, "/v1/job/scale-only")["Meta"]
    # The job's meta does not move with the count: Nomad compares it as every task's
    # meta, and a change would replace every running replica (test_updates.py).
    assert before == after
    model_files("scale-only", replicas=0)
    assert planner("apply", str(folder)).returncode == 0


def test_a_drain_change_is_planned_and_updated_in_place(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    """shutdown_delay (issue 22): the plan names it, Nomad's diff shows the task's
    ShutdownDelay, and the update leaves the job's meta alone (no rollout)."""
    folder = model_files("drain-only", replicas=0)
    assert planner("apply", str(folder)).returncode == 0
    job = nomad_get(cluster, "/v1/job/drain-only")
    [task] = job["TaskGroups"][0]["Tasks"]
    assert (task["ShutdownDelay"], task["KillTimeout"]) == (30 * 10**9, 15 * 10**9)
    model_files("drain-only", replicas=0, extra="shutdown_delay: 2m\n")

    plan = planner("apply", str(folder), "--dry-run", "--output", "json")
    assert plan.returncode == 0, plan.stderr
    [planned] = [c for c in json.loads(plan.stdout)["changes"] if c["model"] == "drain-only"]
    assert (planned["action"], planned["reason"]) == ("update", "shutdown_delay 30s -> 120s")
    # Nothing else moves (the job's meta, which Nomad compares, among it).
    assert planned["diff"] == [
        '+/- Job: "drain-only"',
        '  +/- Task Group: "server"',
        '    +/- Task: "llama-server"',
        '      +/- ShutdownDelay: "30000000000" => "120000000000"',
    ]

    applied = planner("apply", str(folder), "--output", "json")
    [change] = [c for c in json.loads(applied.stdout)["changes"] if c["model"] == "drain-only"]
    assert (change["action"], change["reason"]) == ("update", "shutdown_delay 30s -> 120s")
    after = nomad_get(cluster, "/v1/job/drain-only")
    assert after["TaskGroups"][0]["Tasks"][0]["ShutdownDelay"] == 120 * 10**9
    assert after["Meta"] == job["Meta"]
    second = planner("apply", str(folder), "--output", "json")
    [again] = [c for c in json.loads(second.stdout)["changes"] if c["model"] == "drain-only"]
    assert again["action"] == "unchanged"


def test_a_restart_delay_change_is_planned_and_rolled_out(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    """restart_delay: unwritten, the group's restart policy is the template's of before
    the field (4 attempts in 30 min, 5 s apart, then fail), in the group and its task;
    1s is named in the plan and rolls out (the spec hash moves: Nomad's clients keep a
    running task's restart policy), the definition hash does not (parking stays)."""
    folder = model_files("pause-only", replicas=0)
    assert planner("apply", str(folder)).returncode == 0
    job = nomad_get(cluster, "/v1/job/pause-only")
    [group] = job["TaskGroups"]
    policies = [group["RestartPolicy"], group["Tasks"][0]["RestartPolicy"]]
    expected = {"Attempts": 4, "Interval": 1800 * 10**9, "Delay": 5 * 10**9, "Mode": "fail"}
    assert [{k: p[k] for k in expected} for p in policies] == [expected, expected]
    model_files("pause-only", replicas=0, extra="restart_delay: 1s\n")

    plan = planner("apply", str(folder), "--dry-run", "--output", "json")
    assert plan.returncode == 0, plan.stderr
    [planned] = [c for c in json.loads(plan.stdout)["changes"] if c["model"] == "pause-only"]
    assert (planned["action"], planned["reason"]) == ("update", "restart_delay 5s -> 1s")
    assert any('Delay: "5000000000" => "1000000000"' in line for line in planned["diff"]), planned

    applied = planner("apply", str(folder), "--output", "json")
    [change] = [c for c in json.loads(applied.stdout)["changes"] if c["model"] == "pause-only"]
    assert (change["action"], change["reason"]) == ("update", "restart_delay 5s -> 1s")
    after = nomad_get(cluster, "/v1/job/pause-only")
    [group] = after["TaskGroups"]
    assert [group["RestartPolicy"]["Delay"], group["Tasks"][0]["RestartPolicy"]["Delay"]] == [
        10**9,
        10**9,
    ]
    meta, before = after["Meta"], job["Meta"]
    assert meta["llmgw_definition_hash"] == before["llmgw_definition_hash"]
    assert meta["llmgw_spec_hash"] != before["llmgw_spec_hash"]
    second = planner("apply", str(folder), "--output", "json")
    [again] = [c for c in json.loads(second.stdout)["changes"] if c["model"] == "pause-only"]
    assert again["action"] == "unchanged"


def test_prune_deregisters_models_gone_from_git(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path], tmp_path: Path
) -> None:
    folder = model_files("prune-keep", replicas=0)
    model_files("prune-gone", replicas=0)
    assert planner("apply", str(folder)).returncode == 0
    (folder / "prune-gone.yaml").unlink()

    without = planner("apply", str(folder), "--output", "json")
    assert actions(without, "prune-gone") == ["orphaned"]
    assert not nomad_get(cluster, "/v1/job/prune-gone")["Stop"]

    # Found by a new user: a model an operator stopped (`nomad job stop`) and then
    # removed from git was listed nowhere and could never be pruned.
    model_files("prune-stopped", replicas=0)
    assert planner("apply", str(folder)).returncode == 0
    (folder / "prune-stopped.yaml").unlink()
    stop_job(cluster, "prune-stopped")
    listed = planner("apply", str(folder), "--output", "json")
    assert actions(listed, "prune-stopped") == ["orphaned"]

    pruned = planner("apply", str(folder), "--prune", "--output", "json")
    assert pruned.returncode == 0, pruned.stderr
    assert actions(pruned, "prune-gone") == actions(pruned, "prune-stopped") == ["deregister"]
    for name in ("prune-gone", "prune-stopped"):  # purged: a stopped llmgw job is a model
        with pytest.raises(urllib.error.HTTPError) as gone:
            nomad_get(cluster, f"/v1/job/{name}")
        assert gone.value.code == 404
    records = http_json(f"{cluster.consul_addr}/v1/kv/llmgw/models/?keys=true")
    assert "llmgw/models/prune-gone" not in records
    assert "llmgw/models/prune-keep" in records
    assert planner("apply", str(folder), "--prune").stderr.strip().endswith("no changes")


def test_gpu_profile_renders_device_block_through_nomad(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    folder = model_files(
        "gpu-render", replicas=0, profile="gpus: 2\n  gpu_memory: 24GiB\n  memory: 256MiB"
    )
    assert planner("apply", str(folder)).returncode == 0
    task = nomad_get(cluster, "/v1/job/gpu-render")["TaskGroups"][0]["Tasks"][0]
    [device] = task["Resources"]["Devices"]
    assert device["Name"] == "nvidia/gpu" and device["Count"] == 2
    assert device["Constraints"][0] == {
        "LTarget": "${device.attr.memory}",
        "Operand": ">=",
        "RTarget": "24576 MiB",
    }
    assert "--n-gpu-layers" in task["Config"]["args"]
    # GPU isolation under raw_exec/exec (tests/integration/test_gpus.py runs it).
    [template] = task["Templates"]
    assert template["Envvars"] and template["DestPath"] == "local/gpu.env"
    assert template["EmbeddedTmpl"] == 'CUDA_VISIBLE_DEVICES={{ env "NVIDIA_VISIBLE_DEVICES" }}\n'


def test_foreign_job_with_the_same_name_is_not_overwritten(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    foreign = {
        "Job": {
            "ID": "foreign-job",
            "Name": "foreign-job",
            "Type": "batch",
            "Datacenters": ["*"],
            "TaskGroups": [
                {
                    "Name": "g",
                    "Count": 0,
                    "Tasks": [
                        {"Name": "t", "Driver": "raw_exec", "Config": {"command": "/bin/true"}}
                    ],
                }
            ],
        }
    }
    http_json(f"{cluster.nomad_addr}/v1/jobs", foreign)
    folder = model_files("foreign-job", replicas=0)

    result = planner("apply", str(folder))

    assert result.returncode == 2
    assert "llmgw does not manage" in result.stderr
    assert nomad_get(cluster, "/v1/job/foreign-job")["Type"] == "batch"
