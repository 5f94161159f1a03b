"""The router follows a planner failover, on real parts: two `planner serve`, a
router pointed at the leader, the leader killed with SIGKILL.

The router finds the new leader through Consul (`llmgw/leader`, the
`llmgw-planner` service): an idle on-demand model is activated and served
through it, and its usage reports reach it (router.planners, router.plannerapi).
"""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devcluster.cluster import Cluster
from llmgw_contract import KVPrefix, UsageRecord, decode, kv_key
from tests.conftest import PlannerDaemon, forget_models, http_json, lead_again, run_router, wait_for
from tests.integration.test_on_demand import complete, on_demand_model, refusal

pytestmark = pytest.mark.integration

MODEL = "failover-od"
GPU_MODEL = "failover-gpu"  # fits nowhere here: the planner answers at once, nothing starts


@pytest.fixture(autouse=True)
def _forget_this_modules_models(cluster: Cluster) -> Iterator[None]:
    yield
    forget_models(cluster, MODEL, GPU_MODEL)


def router_metric(router: str, name: str, **labels: str) -> float:
    """The sum of the router's samples `name` whose labels include `labels`."""
    with urllib.request.urlopen(f"{router}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def usage_record(cluster: Cluster, name: str) -> UsageRecord | None:
    """The leader's copy of when `name` was last asked for (llmgw/usage/<name>)."""
    try:
        [entry] = http_json(f"{cluster.consul_addr}/v1/kv/{kv_key(KVPrefix.USAGE, name)}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    return decode(UsageRecord, base64.b64decode(entry["Value"]))


def delete_usage(cluster: Cluster, name: str) -> None:
    url = f"{cluster.consul_addr}/v1/kv/{kv_key(KVPrefix.USAGE, name)}"
    urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=10).close()


def test_the_router_follows_a_sigkilled_leader_to_the_new_one(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    planner_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    standby = PlannerDaemon(planner_env, cluster.root / "planner-failover-standby.log")
    standby.start()
    try:
        assert http_json(f"{standby.url}/health")["role"] == "follower"
        folder = on_demand_model(tmp_path / "m", MODEL, f"file://{tiny_model}")
        on_demand_model(
            folder, GPU_MODEL, f"file://{tiny_model}", profile="gpus: 1\n  memory: 256MiB"
        )
        assert planner("apply", str(folder)).returncode == 0
        with run_router(cluster, planner_daemon.url, LLMGW_USAGE_INTERVAL="1") as router:
            # The router talks to the configured planner, the leader.
            status, error, _ = refusal(router, GPU_MODEL)
            assert status == 503 and error["code"] == "model_unplaceable"
            assert router_metric(router, "llmgw_router_planner_switches_total") == 0

            killed_at = time.monotonic()
            planner_daemon.kill()
            wait_for(
                lambda: (
                    (h := http_json(f"{standby.url}/health", timeout=2))["role"] == "leader"
                    and h["ready"]
                ),
                30,
                "the standby to lead and reconcile",
            )
            leading = time.monotonic() - killed_at

            # An idle on-demand model, asked for through the router configured with
            # the dead planner's address: activated by the new leader and served.
            asked_at = time.monotonic()
            served = complete(router, MODEL, timeout=90)
            print(
                f"failover: SIGKILL -> new leader ready {leading:.1f} s; cold start "
                f"through the router after it {time.monotonic() - asked_at:.1f} s"
            )
            assert served["usage"]["completion_tokens"] > 0
            assert router_metric(router, "llmgw_router_planner_switches_total") == 1
            activations = router_metric(router, "llmgw_router_activations_total", model=MODEL)
            assert activations == 1

            # The activation wrote the usage copy at once; with it gone, only a usage
            # report can write it again (the leader copies its memory to KV at most
            # every 30 s per model): the new leader hears which models are used.
            assert usage_record(cluster, MODEL) is not None
            delete_usage(cluster, MODEL)
            wait_for(
                lambda: complete(router, MODEL) and usage_record(cluster, MODEL),
                60,
                f"a usage report of {MODEL} to reach the new leader",
                interval=1,
            )
            assert (
                router_metric(router, "llmgw_router_activations_total", model=MODEL) == activations
            )
            assert standby.model(MODEL)["state"] == "serving"
        log = (cluster.root / f"router-{router.rsplit(':', 1)[1]}.log").read_text()
        switches = [line for line in log.splitlines() if "planner calls switched" in line]
        assert len(switches) == 1 and standby.url in switches[0], switches
    finally:
        lead_again(planner_daemon, standby, 20)
