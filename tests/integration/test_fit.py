"""What `planner apply` refuses before anything is registered, against real Nomad and
Consul: `args` llama-server would reject (C23), and a profile too small for what the
model's GGUF header says it needs, read with range requests only (issue 9, item 5)."""

from __future__ import annotations

import json
import urllib.error
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from tests.conftest import http_json, nomad_get
from tests.support.sparse_gguf import write_sparse_gguf
from tests.support.tls import TlsCA, serve_https

pytestmark = pytest.mark.integration


def registered(cluster: Cluster, name: str) -> bool:
    """Nomad has the job, or Consul the model's record."""
    for url in (
        f"{cluster.nomad_addr}/v1/job/{name}",
        f"{cluster.consul_addr}/v1/kv/llmgw/models/{name}",
    ):
        try:
            http_json(url)
            return True
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
    return False


@pytest.mark.parametrize(
    ("name", "args", "field", "expected"),
    [
        (
            "c23-equals",
            '["--threads=1"]',
            "profile.args.0",
            "'--threads=1' is one element; write the flag and its value as separate elements: "
            '["--threads", "1"]',
        ),
        (
            "c23-space",
            '["--parallel", "1", "--threads 1"]',
            "profile.args.2",
            "'--threads 1' is one element; write the flag and its value as separate elements: "
            '["--threads", "1"]',
        ),
        (
            "c23-port",
            '["--port", "9"]',
            "profile.args.0",
            "--port is set by the planner's job template; remove it and its value",
        ),
        (
            "c23-ctx",
            '["--threads", "1", "-c", "8192"]',
            "profile.args.2",
            "-c is set by the planner's job template; remove it and its value (set "
            "`profile.context` instead)",
        ),
        (
            "c23-blank",
            '["--parallel", "1", " --threads", "1"]',
            "profile.args.2",
            "argument ' --threads' has spaces around the flag; write '--threads'",
        ),
        (
            "c23-hff",
            '["-hff", "other.gguf"]',
            "profile.args.0",
            "-hff loads weights other than `source`'s, which the planner neither verifies, fits "
            "nor places: the model file comes from `source`; remove it and its value",
        ),
        (
            "c23-ctk",
            '["-ctk", "q3_k"]',
            "profile.args.1",
            "expected a cache type, one of f32, f16, bf16, q8_0",
        ),
    ],
)
def test_c23_args_llama_server_rejects_are_refused_at_apply(
    cluster: Cluster,
    planner: Callable,
    model_files: Callable[..., Path],
    name: str,
    args: str,
    field: str,
    expected: str,
) -> None:
    folder = model_files(name, profile=f"context: 512\n  memory: 256MiB\n  args: {args}")

    result = planner("apply", str(folder), "--output", "json")

    assert result.returncode == 2, result.stderr
    assert f"{folder / name}.yaml: {field}: {expected}" in result.stderr
    [problem] = json.loads(result.stdout)["error"]["problems"]
    assert problem["file"] == f"{folder / name}.yaml" and problem["field"] == field
    assert not registered(cluster, name)
    assert name not in {job["ID"] for job in nomad_get(cluster, "/v1/jobs")}


def test_a_profile_too_small_for_the_header_is_refused_reading_header_bytes_only(
    cluster: Cluster,
    planner: Callable,
    model_files: Callable[..., Path],
    test_ca: TlsCA,
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    header = write_sparse_gguf(site / "llama-70b-f16.gguf")  # 128 GiB of weights, a hole
    server = serve_https(site, test_ca)
    try:
        source = f"{server.url}/llama-70b-f16.gguf"
        folder = model_files("fit-cpu", source=source, profile="context: 8192\n  memory: 8GiB")
        model_files(
            "fit-gpu",
            source=source,
            profile="context: 8192\n  gpus: 2\n  gpu_memory: 24GiB\n  memory: 8GiB",
        )
        # 8 of its 80 layers on the GPU: 13.3 GiB of weights, KV cache and compute there, the
        # rest (117.9 GiB) in host memory.
        model_files(
            "fit-partial",
            source=source,
            profile="context: 8192\n  gpus: 1\n  gpu_memory: 24GiB\n  memory: 8GiB\n"
            '  args: ["-ngl", "8"]',
        )

        result = planner("apply", str(folder))

        assert result.returncode == 2, result.stderr
        needs = "the model needs ≈ 131.3 GiB for 8192 tokens of context; profile gives"
        assert (
            f"{folder}/fit-cpu.yaml: profile.memory: {needs} 8 GiB (weights 128.5 GiB + "
            "KV cache 2.5 GiB for 8192 tokens + " in result.stderr
        )
        assert f"{folder}/fit-gpu.yaml: profile.gpu_memory: {needs} 2 x 24 GiB (" in result.stderr
        assert (
            f"{folder}/fit-partial.yaml: profile.memory: with 8 of 80 layers on the GPU "
            "(--n-gpu-layers), the rest needs ≈ 117.9 GiB for 8192 tokens of context; profile "
            "gives 8 GiB" in result.stderr
        )
        assert "fit-partial.yaml: profile.gpu_memory" not in result.stderr
        assert not registered(cluster, "fit-cpu") and not registered(cluster, "fit-gpu")
        assert server.requests == []  # no whole-file GET: nothing of the weights
        assert server.ranges and all(first < header for _, first, _ in server.ranges)
        assert max(last for _, _, last in server.ranges) < 4 * header
    finally:
        server.close()


def test_context_beyond_training_and_an_unreachable_source_are_refused(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    folder = model_files("fit-long", profile="context: 16384\n  memory: 256MiB")
    model_files("fit-gone", source="https://127.0.0.1:1/gone.gguf", profile="memory: 1GiB")

    result = planner("apply", str(folder))

    assert result.returncode == 2, result.stderr
    assert (
        f"{folder}/fit-long.yaml: profile.context: 16384 tokens is more than the model "
        "was trained for (8192, its context_length)" in result.stderr
    )
    assert (
        f"{folder}/fit-gone.yaml: source: https://127.0.0.1:1/gone.gguf is unreachable"
        in result.stderr
    )
    assert not registered(cluster, "fit-long") and not registered(cluster, "fit-gone")


def test_dry_run_prints_each_models_estimate(
    cluster: Cluster, planner: Callable, model_files: Callable[..., Path]
) -> None:
    folder = model_files("fit-dry", replicas=0)  # the tests' profile: 512 tokens, 256 MiB
    model_files(
        "fit-slots",
        replicas=0,  # issue 20, item 2: slots and context per request
        profile='context: 256\n  memory: 256MiB\n  args: ["--parallel", "2"]',
    )

    table = planner("apply", str(folder), "--dry-run")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines() if line.split()}
    assert "slots x context" in rows["model"]
    assert "1 x 512 tokens" in rows["fit-dry"] and "2 x 256 tokens" in rows["fit-slots"]
    assert (
        "≈ 67 MiB (weights 451 KiB + KV cache 256 KiB for 512 tokens + compute 2 MiB + "
        "overhead 64 MiB)" in rows["fit-dry"]
    )
    assert "KV cache 256 KiB for 2 slots x 256 tokens" in rows["fit-slots"]

    answer = planner("apply", str(folder), "--dry-run", "--output", "json")
    changes = {c["model"]: c for c in json.loads(answer.stdout)["changes"]}
    change = changes["fit-dry"]
    assert (change["slots"], change["context_per_request"]) == (1, 512)
    assert change["estimate"]["context"] == 512
    assert change["estimate"]["kv_cache"] == 512 * 2 * 4 * (16 + 16) * 2
    assert change["estimate"]["bytes"] < 256 * 2**20
    slotted = changes["fit-slots"]
    assert (slotted["slots"], slotted["context_per_request"]) == (2, 256)
    assert (slotted["estimate"]["slots"], slotted["estimate"]["context"]) == (2, 256)
    assert not registered(cluster, "fit-dry") and not registered(cluster, "fit-slots")
