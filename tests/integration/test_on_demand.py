"""On-demand models on real parts: activation through the router with a bounded
wait, a fresh placement answer per request, idle scale to zero (C10-C13), also over an
activation Nomad placed in part."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from collections.abc import Callable
from email.message import Message
from pathlib import Path

import openai
import pytest

from devcluster.cluster import Cluster
from tests.conftest import (
    PlannerDaemon,
    forget_models,
    http_json,
    nomad_get,
    passing_endpoints,
    run_router,
    wait_for,
)
from tests.support.sparse_gguf import write_sparse_gguf
from tests.support.tls import TlsCA, serve_https

pytestmark = pytest.mark.integration

SMALL = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'


def on_demand_model(
    folder: Path,
    name: str,
    source: str,
    profile: str = SMALL,
    idle_after: str = "15m",
    replicas: int = 1,
) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\nsource: {source}\nprofile:\n  {profile}\nreplicas: {replicas}\n"
        f"on_demand:\n  idle_after: {idle_after}\n"
    )
    return folder


def complete(router: str, model: str, timeout: float = 60) -> dict:
    return http_json(
        f"{router}/v1/completions",
        {"model": model, "prompt": "hi", "max_tokens": 4},
        timeout=timeout,
    )


def refusal(router: str, model: str) -> tuple[int, dict, Message]:
    """(status, error object, headers) of a request that must be refused."""
    with pytest.raises(urllib.error.HTTPError) as info:
        complete(router, model)
    return info.value.code, json.load(info.value)["error"], info.value.headers


def job_count(cluster: Cluster, name: str) -> int:
    return nomad_get(cluster, f"/v1/job/{name}")["TaskGroups"][0]["Count"]


def attempts_since(cluster: Cluster, name: str, index: int) -> list[dict]:
    """Evaluations a placement attempt creates (scale or forced evaluation), after `index`;
    the blocked evaluations Nomad makes for unplaced allocations are not attempts."""
    return [
        e
        for e in nomad_get(cluster, f"/v1/job/{name}/evaluations")
        if e["CreateIndex"] > index and e["TriggeredBy"] in ("job-scaling", "job-eval")
    ]


def test_c10_idle_on_demand_model_is_served_scaled_to_zero_and_served_again(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    folder = on_demand_model(tmp_path / "m", "c10-od", f"file://{tiny_model}", idle_after="10s")
    assert planner("apply", str(folder)).returncode == 0
    assert job_count(cluster, "c10-od") == 0
    rows = json.loads(planner("status", "--output", "json").stdout)
    [row] = [r for r in rows if r["name"] == "c10-od"]
    assert row["state"] == "idle"  # idle and unasked-for is what it should be

    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused")  # default timeouts
    started = time.monotonic()
    first = client.completions.create(model="c10-od", prompt="hi", max_tokens=4)
    print(f"cold start through the router: {time.monotonic() - started:.2f} s")
    assert first.usage.completion_tokens > 0
    assert job_count(cluster, "c10-od") == 1

    wait_for(lambda: job_count(cluster, "c10-od") == 0, 60, "idle scale to zero")
    wait_for(lambda: not passing_endpoints(cluster, "llmgw-c10-od"), 20, "no endpoint left")
    second = complete(router, "c10-od")
    assert second["usage"]["completion_tokens"] > 0


def test_an_activation_placed_in_part_idles_to_zero(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """Replicas of 3/5 of the node's free memory: a request's activation asks for 2 and
    Nomad places 1. The request is served by the replica placed (the activation answers
    "loading", never model_unplaceable for a model that will serve; issue 22), and the
    shortfall stays in the model's status. Its deployment waits for room for good
    (progress_deadline 0), and Nomad refuses a scale while it runs; when idle the model
    still goes to 0 (the idle scale-down is a register of the job with count 0, which
    supersedes it)."""
    name = "od-part"
    memory_mb = free_memory_mb(cluster) * 3 // 5
    profile = f'context: 512\n  cpu: 100\n  memory: {memory_mb}MiB\n  args: ["--threads", "1"]'
    folder = on_demand_model(
        tmp_path / "m", name, f"file://{tiny_model}", profile, idle_after="10s", replicas=2
    )
    try:
        assert planner("apply", str(folder)).returncode == 0
        started = time.monotonic()
        try:
            served = complete(router, name)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"refused {exc.code}: {json.load(exc)['error']}")
        answered = f"served in {time.monotonic() - started:.1f} s"
        assert served["usage"]["completion_tokens"] > 0
        assert job_count(cluster, name) == 2
        wait_for(lambda: passing_endpoints(cluster, f"llmgw-{name}"), 60, "1 replica serving")
        wait_for(  # the shortfall is told, once the planner's pass has recorded it
            lambda: "1 of 2 replicas placed" in planner_daemon.model(name)["reason"],
            30,
            "the shortfall in the model's status",
        )
        running = [
            d["ID"]
            for d in nomad_get(cluster, f"/v1/job/{name}/deployments")
            if d["Status"] == "running"
        ]
        assert running, "the activation's deployment waits for room"
        wait_for(lambda: job_count(cluster, name) == 0, 60, "idle scale to zero")
        wait_for(lambda: not passing_endpoints(cluster, f"llmgw-{name}"), 30, "no endpoint left")
        left = [
            d["ID"]
            for d in nomad_get(cluster, f"/v1/job/{name}/deployments")
            if d["Status"] == "running"
        ]
        print(f"the request: {answered}; deployments running while short: {running}")
        assert left == []
    finally:
        forget_models(cluster, name)


def test_c11_twenty_clients_get_the_reason_fast_from_one_attempt(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    folder = on_demand_model(
        tmp_path / "m", "c11-gpu", f"file://{tiny_model}", profile="gpus: 1\n  memory: 256MiB"
    )
    assert planner("apply", str(folder)).returncode == 0
    before = max(
        (e["ModifyIndex"] for e in nomad_get(cluster, "/v1/job/c11-gpu/evaluations")), default=0
    )
    results: list[tuple[float, int, dict]] = []
    barrier = threading.Barrier(20)

    def ask() -> None:
        barrier.wait()
        started = time.monotonic()
        status, error, _ = refusal(router, "c11-gpu")
        results.append((time.monotonic() - started, status, error))

    threads = [threading.Thread(target=ask) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 20
    slowest = max(r[0] for r in results)
    print(f"C11: 20 refusals, slowest {slowest:.2f} s")
    assert slowest < 3
    for _, status, error in results:
        assert status == 503 and error["code"] == "model_unplaceable"
        assert "no node has an nvidia/gpu device" in error["message"]
    assert len(attempts_since(cluster, "c11-gpu", before)) == 1

    # The official SDK (default: 2 retries on a 503) takes the answer as final.
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused")
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="c11-gpu", prompt="hi", max_tokens=4)
    assert refused.value.status_code == 503 and time.monotonic() - started < 1


def free_memory_mb(cluster: Cluster) -> int:
    """The dev node's memory that no running allocation (of any test) has reserved, read
    once none is stopping: a stopped replica keeps its memory through its shutdown_delay
    (30 s by default) and would give it back in the middle of the caller's test."""
    [node] = nomad_get(cluster, "/v1/nodes")
    total = nomad_get(cluster, f"/v1/node/{node['ID']}")["NodeResources"]["Memory"]["MemoryMB"]

    def settled() -> tuple[list[dict]] | None:
        allocs = nomad_get(cluster, f"/v1/node/{node['ID']}/allocations")
        live = [a for a in allocs if a["ClientStatus"] in ("pending", "running")]
        return None if any(a["DesiredStatus"] != "run" for a in live) else (live,)

    [live] = wait_for(settled, 120, "no allocation on the node stopping")
    used = sum(
        task["Memory"]["MemoryMB"]
        for alloc in live
        for task in (alloc.get("AllocatedResources") or {}).get("Tasks", {}).values()
    )
    return total - used


def test_c12_room_made_then_next_request_is_placed_not_refused(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    hog = tmp_path / "hog"
    hog.mkdir()
    hog_memory = free_memory_mb(cluster) - 1024  # leaves less than B's 2 GiB
    hog_profile = f'cpu: 100\n  memory: {hog_memory}MiB\n  args: ["--threads", "1"]'
    (hog / "c12-a.yaml").write_text(
        f"name: c12-a\nsource: file://{tiny_model}\nprofile:\n  {hog_profile}\nreplicas: 1\n"
    )
    assert planner("apply", str(hog), "--wait", "--timeout", "60").returncode == 0
    folder = on_demand_model(
        tmp_path / "m", "c12-b", f"file://{tiny_model}", profile="cpu: 100\n  memory: 2GiB"
    )
    assert planner("apply", str(folder)).returncode == 0

    status, error, _ = refusal(router, "c12-b")
    assert status == 503 and error["code"] == "model_unplaceable"
    assert "memory exhausted" in error["message"]

    (hog / "c12-a.yaml").write_text(
        f"name: c12-a\nsource: file://{tiny_model}\nprofile:\n  {hog_profile}\nreplicas: 0\n"
    )
    assert planner("apply", str(hog)).returncode == 0
    wait_for(lambda: not passing_endpoints(cluster, "llmgw-c12-a"), 20, "A stopped")
    try:
        answer = complete(router, "c12-b")
    except urllib.error.HTTPError as exc:
        pytest.fail(f"c12-b refused: {exc.code} {exc.read().decode()}")
    assert answer["usage"]["completion_tokens"] > 0


def test_c13_huge_https_source_that_fits_nowhere_downloads_nothing(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    test_ca: TlsCA,
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    # A 70B f16 model's header (apply reads it to judge the fit: ~131 GiB, within the
    # profile's 4 x 80 GiB) before 128 GiB of weights that are a sparse hole.
    header = write_sparse_gguf(site / "huge.gguf")
    server = serve_https(site, test_ca)
    try:
        folder = on_demand_model(
            tmp_path / "m",
            "c13-huge",
            f"{server.url}/huge.gguf",
            profile="gpus: 4\n  gpu_memory: 80GiB\n  memory: 256GiB",
        )
        assert planner("apply", str(folder)).returncode == 0
        status, error, _ = refusal(router, "c13-huge")
        assert status == 503 and error["code"] == "model_unplaceable"
        assert "nvidia/gpu" in error["message"]
        time.sleep(2)
        assert server.requests == []  # nothing was downloaded whole
        # apply read the header with range requests, and no further than 4x its size.
        assert server.ranges and max(last for _, _, last in server.ranges) < 4 * header
    finally:
        server.close()


def test_window_shorter_than_load_gives_retry_after_then_serves(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    folder = on_demand_model(
        tmp_path / "m",
        "window-od",
        f"file://{tiny_model}",
        profile=SMALL + "\n  engine: wait8-llama.cpp",
    )
    assert planner("apply", str(folder)).returncode == 0
    with run_router(cluster, planner_daemon.url, LLMGW_ACTIVATION_WINDOW="3") as short:
        started = time.monotonic()
        status, error, headers = refusal(short, "window-od")
        waited = time.monotonic() - started
        assert status == 503 and error["code"] == "model_loading"
        assert 2.5 < waited < 6
        assert int(headers["Retry-After"]) > 0
        assert "loading" in error["message"]
        wait_for(lambda: passing_endpoints(cluster, "llmgw-window-od"), 30, "loaded")
        assert complete(short, "window-od")["usage"]["completion_tokens"] > 0
