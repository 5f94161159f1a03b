"""A real Prometheus scrapes the real planner and router (issue "Operations view"): a
model that parks (the unknown-architecture GGUF) makes the parked and not-ready
expressions true in Prometheus's own query API, its alert fires, and a pruned model
leaves no stale series."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from tests.conftest import PlannerDaemon, forget_models, nomad_get, wait_for
from tests.integration.test_parking import write_model
from tests.support.prometheus import prometheus
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

NOT_READY = (
    'max by (model) (last_over_time(llmgw_model_desired_replicas{job="llmgw-planner"}[2m])) > 0'
    ' and max by (model) (last_over_time(llmgw_model_ready_replicas{job="llmgw-planner"}[2m]))'
    " == 0"
)


def test_a_parked_model_is_parked_and_not_ready_in_prometheus_and_pruned_leaves_nothing(
    cluster: Cluster, planner: Callable, planner_daemon: PlannerDaemon, router: str, tmp_path: Path
) -> None:
    kev = write_tiny_gguf(tmp_path / "kev.gguf", architecture="kev")
    folder = write_model(tmp_path / "m", "prom-kev", kev)
    with prometheus(tmp_path / "prometheus", [planner_daemon.url], [router]) as prom:
        try:
            wait_for(
                lambda: prom.up() == {"llmgw-planner": 1, "llmgw-router": 1},
                30,
                "Prometheus scraping the planner and the router",
            )
            assert planner("apply", str(folder)).returncode == 0
            parked = wait_for(
                lambda: prom.query('llmgw_model_parked{model="prom-kev"} == 1'),
                120,
                "the parked series at 1 in Prometheus",
            )
            seen_at = float(parked[0]["value"][0])
            fifth = (
                max(
                    e["Time"]
                    for a in nomad_get(cluster, "/v1/job/prom-kev/allocations")
                    for s in a["TaskStates"].values()
                    for e in s["Events"]
                    if e["Type"] == "Terminated"
                )
                / 1e9
            )
            print(
                f"5th failure -> parked series 1 in Prometheus: {seen_at - fifth:.2f} s "
                "(scrape interval 1 s)"
            )
            assert seen_at - fifth < 10
            assert [
                r["metric"]["model"]
                for r in prom.query(NOT_READY)
                if r["metric"]["model"] == "prom-kev"
            ] == ["prom-kev"]
            wait_for(
                lambda: prom.query(
                    'ALERTS{alertname="LlmgwModelParked", model="prom-kev", alertstate="firing"}'
                ),
                30,
                "the LlmgwModelParked alert firing",
            )

            (folder / "prom-kev.yaml").unlink()
            write_model(folder, "prom-other", kev, replicas=0)  # apply needs one file
            assert planner("apply", str(folder), "--prune").returncode == 0
            wait_for(
                lambda: not prom.query('{model="prom-kev", job="llmgw-planner"}'),
                60,
                "no series of the pruned model left in Prometheus",
            )
            time.sleep(2)  # a couple more scrapes: still nothing (no stale series)
            assert prom.query('{model="prom-kev", job="llmgw-planner"}') == []
        finally:
            forget_models(cluster, "prom-kev", "prom-other")
