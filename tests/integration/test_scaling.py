"""Load-based scaling on real parts (issue 22): load through a real router scales a
tiny model 1 -> 2, and back to min after down_after when the load ends, with no failed
request; `planner status` shows min/desired/max and each decision with its figures.

Short windows (a 1 s usage report, 4 s average, 3 s up, 10 s down) so the test takes
about a minute; the rules are the same at any window (tests/unit/planner/test_autoscale.py
judges them on a fixed clock)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from tests.conftest import (
    PlannerDaemon,
    forget_models,
    http_json,
    lead_again,
    nomad_get,
    passing_endpoints,
    run_router,
)
from tests.conftest import wait_for as wait_until

pytestmark = pytest.mark.integration

SMALL = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'


def scaling_model(folder: Path, name: str, source: str, down_after: str = "10s") -> Path:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\nsource: {source}\nprofile:\n  {SMALL}\n"
        f"scaling: {{min: 1, max: 2, target: 1, window: 4s, up_after: 3s, "
        f"down_after: {down_after}}}\n"
    )
    return folder


def job_count(cluster: Cluster, name: str) -> int:
    return nomad_get(cluster, f"/v1/job/{name}")["TaskGroups"][0]["Count"]


class Load:
    """`clients` threads sending completions through `router` until stopped; counts
    answers and failures (any error, any status but 200)."""

    def __init__(self, router: str, model: str, clients: int) -> None:
        self.router, self.model = router, model
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client) for _ in range(clients)]

    def _client(self) -> None:
        while not self._stop.is_set():
            try:
                answer = http_json(
                    f"{self.router}/v1/completions",
                    {"model": self.model, "prompt": "hello there", "max_tokens": 48},
                    timeout=60,
                )
                with self._lock:
                    self.ok += 1 if answer.get("choices") else 0
            except (urllib.error.URLError, OSError, ValueError) as exc:
                with self._lock:
                    self.failures.append(repr(exc))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    on_timeout: Callable[[], object] | None = None,
) -> object:
    """`tests.conftest.wait_for`, naming what the planner showed when it timed out."""
    try:
        return wait_until(predicate, timeout, what)
    except pytest.fail.Exception:
        if on_timeout is None:
            raise
        pytest.fail(f"timed out after {timeout} s waiting for {what}; planner: {on_timeout()}")


def scaling_row(planner: Callable, name: str) -> dict:
    rows = json.loads(planner("models", "--output", "json").stdout)
    [row] = [r for r in rows if r["name"] == name]
    return row


def test_load_scales_up_and_back_to_min_with_no_failed_request(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    name = "scale-load"
    folder = scaling_model(tmp_path / "m", name, f"file://{tiny_model}")
    try:
        assert planner("apply", str(folder)).returncode == 0
        assert job_count(cluster, name) == 1
        wait_for(lambda: len(passing_endpoints(cluster, f"llmgw-{name}")) == 1, 120, "1 ready")
        with run_router(cluster, planner_daemon.url, LLMGW_USAGE_INTERVAL="1") as router:
            wait_for(
                lambda: http_json(
                    f"{router}/v1/completions",
                    {"model": name, "prompt": "a", "max_tokens": 1},
                    timeout=30,
                ),
                30,
                "the router to serve the model",
            )
            with Load(router, name, clients=6) as load:
                started = time.monotonic()
                wait_for(
                    lambda: job_count(cluster, name) == 2,
                    90,
                    "a scale up to 2",
                    on_timeout=lambda: scaling_row(planner, name)["scaling"],
                )
                scaled_up = time.monotonic() - started
                wait_for(
                    lambda: len(passing_endpoints(cluster, f"llmgw-{name}")) == 2,
                    120,
                    "the second replica to pass",
                )
                # An apply during the scale-up does not undo it: the same file is
                # unchanged, and the registration keeps the scaler's count.
                applied = planner("apply", str(folder))
                assert applied.returncode == 0, applied.stdout + applied.stderr
                assert job_count(cluster, name) == 2
                served = load.ok
                wait_for(lambda: load.ok >= served + 20, 60, "requests served on 2 replicas")
            ended = time.monotonic()
            row = scaling_row(planner, name)
            up = row["scaling"]["last"]
            assert (up["before"], up["after"], up["direction"]) == (1, 2, "up"), up
            assert "in flight per replica" in up["reason"] and "target 1" in up["reason"]
            wait_for(
                lambda: job_count(cluster, name) == 1,
                90,
                "back to min after down_after",
                on_timeout=lambda: scaling_row(planner, name)["scaling"],
            )
            back = time.monotonic() - ended
            wait_for(lambda: len(passing_endpoints(cluster, f"llmgw-{name}")) == 1, 60, "1 left")
            # The remaining replica still serves through the router.
            assert http_json(
                f"{router}/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1}
            )["choices"]
        print(
            f"scale up after {scaled_up:.1f} s of load, back to min {back:.1f} s after it "
            f"ended; {load.ok} requests, {len(load.failures)} failed"
        )
        assert load.failures == [], load.failures[:5]
        row = scaling_row(planner, name)
        down = row["scaling"]["last"]
        assert (down["before"], down["after"], down["direction"]) == (2, 1, "down"), down
        assert (row["scaling"]["min"], row["scaling"]["max"], row["desired"]) == (1, 2, 1)
        status = planner("status")
        assert f"{name}: scaling 1/1/2 (min/desired/max)" in status.stdout, status.stdout
        # A change of bounds is not a rollout: the job keeps its version's definition
        # and its count, and no deployment with canaries starts.
        version = nomad_get(cluster, f"/v1/job/{name}")["Version"]
        scaling_model(folder.parent / "m", name, f"file://{tiny_model}", down_after="20s")
        applied = planner("apply", str(folder))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        job = nomad_get(cluster, f"/v1/job/{name}")
        assert job["Version"] == version + 1 and job["TaskGroups"][0]["Count"] == 1
        allocs = [
            a
            for a in nomad_get(cluster, f"/v1/job/{name}/allocations")
            if a["DesiredStatus"] == "run"
        ]
        assert len(allocs) == 1 and allocs[0]["JobVersion"] == version + 1  # updated in place
    finally:
        forget_models(cluster, name)


def demand_seen(planner_url: str, name: str) -> float:
    """The leader's `llmgw_model_demand_requests` of model `name` (0 when absent)."""
    with urllib.request.urlopen(f"{planner_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith(f'llmgw_model_demand_requests{{model="{name}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def load_scales(cluster: Cluster, name: str) -> list[tuple[int, int]]:
    """(previous count, count) of every scale load-based scaling made, oldest first
    (Nomad's scaling events of the job: /v1/job/<id>/scale)."""
    status = nomad_get(cluster, f"/v1/job/{name}/scale")
    events = status["TaskGroups"]["server"]["Events"] or []
    made = [e for e in events if "in flight per replica" in (e.get("Message") or "")]
    made.sort(key=lambda e: e["Time"])
    return [(e["PreviousCount"], e["Count"]) for e in made]


def test_a_leader_sigkilled_during_scaling_neither_loses_nor_doubles_a_decision(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    planner_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """The leader scales 1 -> 2 under load and is SIGKILLed; the standby leads on from
    the state document: the count stays 2 while the load lasts (no second scale-up, no
    reset to 1), and goes back to 1 once it ends: exactly two scales in Nomad's events."""
    name = "scale-failover"
    standby = PlannerDaemon(planner_env, cluster.root / "planner-scaling-standby.log")
    standby.start()
    folder = scaling_model(tmp_path / "m", name, f"file://{tiny_model}", down_after="15s")
    try:
        assert http_json(f"{standby.url}/health")["role"] == "follower"
        assert planner("apply", str(folder)).returncode == 0
        wait_until(lambda: len(passing_endpoints(cluster, f"llmgw-{name}")) == 1, 120, "1 ready")
        with run_router(cluster, planner_daemon.url, LLMGW_USAGE_INTERVAL="1") as router:
            with Load(router, name, clients=6) as load:
                wait_for(
                    lambda: job_count(cluster, name) == 2,
                    90,
                    "a scale up to 2",
                    on_timeout=lambda: scaling_row(planner, name)["scaling"],
                )
                decided = scaling_row(planner, name)["scaling"]["last"]
                planner_daemon.kill()
                wait_until(
                    lambda: (
                        (h := http_json(f"{standby.url}/health", timeout=2))["role"] == "leader"
                        and h["ready"]
                    ),
                    30,
                    "the standby to lead and reconcile",
                )
                # The new leader hears the routers, then decides on the load for a while
                # (a few windows of it): nothing to change.
                wait_until(
                    lambda: demand_seen(standby.url, name) > 0, 60, "reports at the new leader"
                )
                served = load.ok
                wait_until(lambda: load.ok >= served + 300, 120, "load under the new leader")
                assert job_count(cluster, name) == 2
                assert scaling_row(planner, name)["scaling"]["last"] == decided
            wait_for(
                lambda: job_count(cluster, name) == 1,
                90,
                "the new leader to scale back to min",
                on_timeout=lambda: scaling_row(planner, name)["scaling"],
            )
        assert load.failures == [], load.failures[:5]
        assert load_scales(cluster, name) == [(1, 2), (2, 1)]
    finally:
        lead_again(planner_daemon, standby, 30)
        forget_models(cluster, name)
