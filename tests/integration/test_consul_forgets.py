"""A Consul that forgets is a restart, not a disaster (issue 20 items 4 and 5), on real
parts: a dev Consul agent of its own cluster stopped and started again on the same
ports, so its catalog, KV and sessions are gone, while a model serves through a real
router and llama-server and another is parked.

Twice: first with no planner running (the gap stays open, so `planner status` is
asked in it for sure, and the router has only what it remembered), then with
`planner serve` running through it (it registers its service again, leads again
within a bound this test measures, and restores every record and parking). A client
asks for the served model all along: never 404. Then item 5 by doing it: the parked
model's job purged, `planner retry` says to apply, the apply keeps it parked, and
`planner retry` lifts it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster, restart_consul
from tests.conftest import PlannerDaemon, http_json, own_cluster, run_router, wait_for
from tests.integration.test_parking import write_model
from tests.support.engines import write_engines
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

SERVED, PARKED = "cf-served", "cf-kev"
KEV_ERROR = "unknown model architecture: 'kev'"
# The planner leads again at most this long after Consul has a leader: its check is
# passed every 2 s (a failed pass registers it again), a failed campaign waits 2 s.
LEADS_AGAIN_WITHIN_S = 15.0


def post(router: str, model: str, timeout: float = 60) -> tuple[int, dict]:
    try:
        return 200, http_json(f"{router}/v1/completions", {"model": model, "prompt": "hi",
                                                           "max_tokens": 1}, timeout)  # fmt: skip
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


class Client(threading.Thread):
    """Asks for `model` one request after the other until stopped: (status, code)."""

    def __init__(self, router: str, model: str) -> None:
        super().__init__(daemon=True)
        self.router, self.model = router, model
        self.answers: list[tuple[int, str]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            status, body = post(self.router, self.model)
            self.answers.append((status, (body.get("error") or {}).get("code", "")))
            self.halt.wait(0.2)

    def stop(self) -> list[tuple[int, str]]:
        self.halt.set()
        self.join(90)
        return self.answers


def kv(cluster: Cluster, key: str) -> list[dict] | None:
    try:
        return http_json(f"{cluster.consul_addr}/v1/kv/{key}?recurse=true", timeout=5)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def restored(cluster: Cluster) -> bool:
    """Both records back, and the parked model's state document parked again."""
    records = {e["Key"] for e in kv(cluster, "llmgw/models/") or []}
    state = kv(cluster, f"llmgw/state/{PARKED}") or [{}]
    value = base64.b64decode(state[0].get("Value") or b"").decode() or "{}"
    return records == {f"llmgw/models/{SERVED}", f"llmgw/models/{PARKED}"} and bool(
        json.loads(value).get("parked")
    )


def leads(cluster: Cluster) -> bool:
    holder = kv(cluster, "llmgw/leader")
    return bool(holder and holder[0].get("Session"))


def refusal(router: str, model: str) -> str:
    status, body = post(router, model)
    return "" if status == 200 else body["error"]["code"]


def test_a_consul_that_forgets_is_a_restart_not_a_disaster(
    binaries: Path, tiny_model: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    with own_cluster(tmp_path / "cluster") as cluster:
        engines = write_engines(tmp_path / "engines", binaries / "llama-server")
        env = {
            **os.environ,
            **cluster.env,
            "LLMGW_ENGINES": ",".join(f"{k}={v}" for k, v in engines.items()),
        }

        def planner(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "planner.cli.main", *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )

        folder = write_model(tmp_path / "models", SERVED, tiny_model)
        write_model(folder, PARKED, write_tiny_gguf(tmp_path / "kev.gguf", architecture="kev"))
        daemon = PlannerDaemon(env, cluster.root / "planner.log")
        daemon.start()
        try:
            applied = planner("apply", str(folder))
            assert applied.returncode == 0, applied.stderr
            with run_router(cluster, daemon.url) as router:
                _setup(router, daemon)
                cluster_up = time.monotonic() - started
                _with_no_planner(cluster, daemon, router, planner)
                _with_the_planner_running(cluster, daemon, router)
                _retry_of_a_purged_parked_job(cluster, daemon, router, planner, folder)
        finally:
            daemon.stop()
    print(f"cluster up and models placed/parked: {cluster_up:.1f} s; "
          f"whole test {time.monotonic() - started:.1f} s")  # fmt: skip


def _setup(router: str, daemon: PlannerDaemon) -> None:
    wait_for(lambda: post(router, SERVED, 10)[0] == 200, 60, f"{SERVED} served")
    wait_for(lambda: daemon.model(PARKED)["state"] == "parked", 90, f"{PARKED} parked")
    wait_for(lambda: refusal(router, PARKED) == "model_parked", 10, "the router to refuse it")


def _with_no_planner(
    cluster: Cluster, daemon: PlannerDaemon, router: str, planner: Callable
) -> None:
    """The gap held open: Consul restarted while no planner runs."""
    assert "no planner leads" not in planner("status").stderr
    daemon.stop()
    # Issue 19's fourth QA: with no planner, `status` showed documents as if current.
    idle = planner("status")
    assert "no planner leads now (llmgw/leader is not held)" in idle.stderr, idle.stderr
    client = Client(router, SERVED)
    client.start()
    restart_consul(cluster)
    shown = planner("status")
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "no model records in Consul, but Nomad runs 2 llmgw job(s)" in shown.stderr
    assert "restores them from the jobs' meta, or run `planner apply`" in shown.stderr
    assert "no models applied yet" not in shown.stderr
    # The router remembers what it knew: the parked model is still refused as parked.
    wait_for(lambda: "remembering the records" in (cluster.root / _router_log(cluster)).read_text(),
             30, "the router to see Consul's reset")  # fmt: skip
    assert refusal(router, PARKED) == "model_parked"
    daemon.start()
    wait_for(lambda: restored(cluster), 30, "records restored by the new leader")
    wait_for(lambda: (client.answers or [(0, "")])[-1][0] == 200, 90, f"{SERVED} served again")
    answers = client.stop()
    print(f"no planner: {SERVED} answered {_count(answers)}")
    assert all(status != 404 for status, _ in answers), answers
    assert refusal(router, PARKED) == "model_parked"


def _with_the_planner_running(cluster: Cluster, daemon: PlannerDaemon, router: str) -> None:
    client = Client(router, SERVED)
    client.start()
    consul_back = restart_consul(cluster)
    wait_for(lambda: leads(cluster), 30, "a leader again")
    led = time.monotonic() - consul_back
    wait_for(lambda: restored(cluster), 30, "records and parking restored")
    back = time.monotonic() - consul_back
    log = (cluster.root / "planner.log").read_text()
    assert "no longer knows this planner's service" in log
    print(f"Consul restarted under a running planner: leads again {led:.1f} s after Consul "
          f"had a leader; records and parking back after {back:.1f} s")  # fmt: skip
    assert led < LEADS_AGAIN_WITHIN_S
    wait_for(lambda: refusal(router, PARKED) == "model_parked", 10, "parked refused as parked")
    wait_for(lambda: (client.answers or [(0, "")])[-1][0] == 200, 90, f"{SERVED} served again")
    answers = client.stop()
    print(f"planner running: {SERVED} answered {_count(answers)}")
    assert all(status != 404 for status, _ in answers), answers
    assert daemon.model(PARKED)["state"] == "parked"


def _retry_of_a_purged_parked_job(
    cluster: Cluster, daemon: PlannerDaemon, router: str, planner: Callable, folder: Path
) -> None:
    """Item 5: the router says `planner retry`; with the job purged, retry says apply;
    apply keeps it parked; retry then starts it."""
    message = post(router, PARKED)[1]["error"]["message"]
    assert f"planner retry {PARKED}" in message
    urllib.request.urlopen(
        urllib.request.Request(f"{cluster.nomad_addr}/v1/job/{PARKED}?purge=true", method="DELETE"),
        timeout=10,
    ).close()
    retried = planner("retry", PARKED)
    assert retried.returncode != 0
    assert "run `planner apply` first" in retried.stderr
    assert f"then `planner retry {PARKED}`" in retried.stderr
    applied = json.loads(planner("apply", str(folder), "--output", "json").stdout)
    [change] = [c for c in applied["changes"] if c["model"] == PARKED]
    assert change["action"] == "create" and "still parked" in change["reason"], change
    job = http_json(f"{cluster.nomad_addr}/v1/job/{PARKED}")
    assert job["Stop"] is True and job["Meta"]["llmgw_parked_reason"]
    assert refusal(router, PARKED) == "model_parked"
    retried = planner("retry", PARKED)
    assert retried.returncode == 0, retried.stderr
    assert http_json(f"{cluster.nomad_addr}/v1/job/{PARKED}")["Stop"] is False


def _router_log(cluster: Cluster) -> str:
    [log] = [p.name for p in cluster.root.glob("router-*.log")]
    return log


def _count(answers: list[tuple[int, str]]) -> dict[str, int]:
    counted: dict[str, int] = {}
    for status, code in answers:
        key = f"{status} {code}".strip()
        counted[key] = counted.get(key, 0) + 1
    return counted
