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

pytestmark = pytest.mark.integration


def registered(cluster: Cluster, name: str) -> bool:
    """Nomad has the job, or Consul the model's record."""
    for url in (f"{cluster.nomad_addr}/v1/job/{name}",
                f"{cluster.consul_addr}/v1/kv/llmgw/models/{name}"):
        try:
            http_json(url)
            return True
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
    return False


@pytest.mark.parametrize(("name", "args", "field", "expected"), [
    ("c23-equals", '["--threads=1"]', "profile.args.0",
     '\'--threads=1\' is one element; write the flag and its value as separate elements: '
     '["--threads", "1"]'),
    ("c23-space", '["--parallel", "1", "--threads 1"]', "profile.args.2",
     '\'--threads 1\' is one element; write the flag and its value as separate elements: '
     '["--threads", "1"]'),
    ("c23-port", '["--port", "9"]', "profile.args.0",
     "--port is set by the planner's job template; remove it and its value"),
    ("c23-ctx", '["--threads", "1", "-c", "8192"]', "profile.args.2",
     "-c is set by the planner's job template; remove it and its value (set "
     "`profile.context` instead)"),
])
def test_c23_args_llama_server_rejects_are_refused_at_apply(
        cluster: Cluster, planner: Callable, model_files: Callable[..., Path],
        name: str, args: str, field: str, expected: str) -> None:
    folder = model_files(name, profile=f"context: 512\n  memory: 256MiB\n  args: {args}")

    result = planner("apply", str(folder), "--output", "json")

    assert result.returncode == 2, result.stderr
    assert f"{folder / name}.yaml: {field}: {expected}" in result.stderr
    [problem] = json.loads(result.stdout)["error"]["problems"]
    assert problem["file"] == f"{folder / name}.yaml" and problem["field"] == field
    assert not registered(cluster, name)
    assert name not in {job["ID"] for job in nomad_get(cluster, "/v1/jobs")}
