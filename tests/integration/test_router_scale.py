"""The router follows hundreds of models with a fixed number of Consul queries (issue 10).

Found by a new user: with 500 on-demand models the router knew 123 (one Consul
long poll per model, on a client capped at 100 connections), and after those
were pruned it kept listing them and never learned a model applied later.
Here 150 on-demand definitions (above that cap) go through the real
``planner apply`` into a real Nomad and Consul; the session's router must list
every one, drop them all after ``--prune``, and learn a model applied after
the prune. The 1,000-model figures are in bench/router_scale.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from tests.conftest import forget_models, http_json, wait_for

pytestmark = pytest.mark.integration

COUNT = 150
PROFILE = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'


def write_on_demand(folder: Path, name: str, source: Path) -> None:
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\nsource: file://{source}\nprofile:\n  {PROFILE}\nreplicas: 1\n"
        "on_demand:\n  idle_after: 15m\n"
    )


def listed(router: str) -> set[str]:
    return {m["id"] for m in http_json(f"{router}/v1/models", timeout=10)["data"]}


def test_150_models_are_known_pruned_and_a_later_one_learned(
    cluster: Cluster, planner: Callable, router: str, tiny_model: Path, tmp_path: Path
) -> None:
    many = tmp_path / "many"
    many.mkdir()
    names = {f"scale-{i:03d}" for i in range(COUNT)}
    for name in names:
        write_on_demand(many, name, tiny_model)
    write_on_demand(many, "scale-keep", tiny_model)
    applied = planner("apply", str(many), "--output", "json", timeout=600)
    assert applied.returncode == 0, applied.stderr[-2000:]
    wait_for(lambda: names <= listed(router), 30, f"the router to list all {COUNT} models")

    keep = tmp_path / "keep"
    keep.mkdir()
    write_on_demand(keep, "scale-keep", tiny_model)
    pruned = planner("apply", str(keep), "--prune", "--output", "json", timeout=600)
    assert pruned.returncode == 0, pruned.stderr[-2000:]
    deregistered = {
        c["model"] for c in json.loads(pruned.stdout)["changes"] if c["action"] == "deregister"
    }
    assert names <= deregistered
    wait_for(lambda: not (names & listed(router)), 30, "the router to drop the pruned models")
    assert "scale-keep" in listed(router)

    write_on_demand(keep, "scale-late", tiny_model)
    again = planner("apply", str(keep), "--output", "json")
    assert again.returncode == 0, again.stderr[-2000:]
    wait_for(lambda: "scale-late" in listed(router), 10, "the router to learn scale-late")
    forget_models(cluster, "scale-keep", "scale-late")
