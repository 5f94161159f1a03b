"""The planner's /metrics on real parts: every defined model at zero, a parked model's
series, a pruned model's series gone, the leader's own series."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devcluster.cluster import Cluster
from tests.conftest import PlannerDaemon, forget_models, wait_for
from tests.integration.test_parking import QUICK_RESTARTS, write_model
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(series, sorted labels): value} of one scrape of `url`/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def of(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_planner_metrics_publish_every_model_and_drop_pruned_ones(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    kev = write_tiny_gguf(tmp_path / "kev.gguf", architecture="kev")
    folder = write_model(tmp_path / "m", "metrics-ok", tiny_model)
    write_model(folder, "metrics-kev", kev, extra=QUICK_RESTARTS)
    write_model(folder, "metrics-zero", tiny_model, replicas=0)
    try:
        assert planner("apply", str(folder)).returncode == 0
        samples = wait_for(
            lambda: (
                (s := scrape(planner_daemon.url))
                and of(s, "llmgw_model_parked", model="metrics-kev") == 1
                and of(s, "llmgw_model_ready_replicas", model="metrics-ok") == 1
                and s
            ),
            120,
            "metrics-kev parked and metrics-ok ready in /metrics",
        )
        assert of(samples, "llmgw_model_desired_replicas", model="metrics-kev") == 1
        assert of(samples, "llmgw_model_ready_replicas", model="metrics-kev") == 0
        assert of(samples, "llmgw_model_consecutive_start_failures", model="metrics-kev") == 5
        assert of(samples, "llmgw_model_start_failures_total", model="metrics-kev") == 5
        assert of(samples, "llmgw_model_state", model="metrics-kev", state="parked") == 1
        assert of(samples, "llmgw_model_state", model="metrics-kev", state="serving") == 0
        assert of(samples, "llmgw_model_state", model="metrics-ok", state="serving") == 1
        # Zeros are published, not left out.
        assert of(samples, "llmgw_model_desired_replicas", model="metrics-zero") == 0
        assert of(samples, "llmgw_model_parked", model="metrics-zero") == 0
        assert of(samples, "llmgw_model_unplaceable", model="metrics-ok") == 0
        assert of(samples, "llmgw_model_update_failed", model="metrics-ok") == 0
        assert of(samples, "llmgw_planner_leader") == 1
        last = of(samples, "llmgw_planner_event_stream_last_message_timestamp_seconds")
        assert last is not None and time.time() - last < 40  # a heartbeat every 30 s
        assert of(samples, "llmgw_planner_reconcile_duration_seconds_count") >= 1

        (folder / "metrics-zero.yaml").unlink()
        assert planner("apply", str(folder), "--prune").returncode == 0
        gone = wait_for(
            lambda: (
                (s := scrape(planner_daemon.url))
                and of(s, "llmgw_model_parked", model="metrics-zero") is None
                and s
            ),
            90,
            "the pruned model's series gone",
        )
        assert not [key for key in gone if ("model", "metrics-zero") in key[1]]
    finally:
        forget_models(cluster, "metrics-ok", "metrics-kev", "metrics-zero")
