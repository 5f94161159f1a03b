"""The main path on real parts: apply -> Nomad runs llama-server -> Consul passes
its check -> the router serves completions (C03 streaming, C04 disconnect),
and an https:// source downloaded by Nomad itself."""

from __future__ import annotations

import hashlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devcluster.cluster import Cluster
from tests.conftest import (
    PlannerDaemon,
    http_json,
    nomad_get,
    passing_endpoints,
    run_router,
    wait_for,
)
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.tls import TlsCA, serve_https

pytestmark = pytest.mark.integration

# Slow enough to stream for several seconds: a wider, deeper random model
# and a long generation that ignores end-of-sequence.
SLOW_PROFILE = (
    'context: 4096\n  cpu: 100\n  memory: 512MiB\n  args: ["--threads", "1", "--parallel", "1"]'
)


def serve(planner: Callable, folder: Path, cluster: Cluster, model: str) -> str:
    """Apply and wait until the model passes; returns its endpoint host:port."""
    result = planner("apply", str(folder), "--wait", "--timeout", "120")
    assert result.returncode == 0, result.stdout + result.stderr
    [endpoint] = passing_endpoints(cluster, f"llmgw-{model}")
    return endpoint


def router_has(router: str, model: str) -> bool:
    """The router's table has caught up once a request for `model` is not a 503."""
    try:
        http_json(f"{router}/v1/completions", {"model": model, "prompt": "a", "max_tokens": 1})
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return False
        raise
    return True


def raw_stream(url: str, body: dict) -> list[tuple[float, bytes]]:
    """POST and read the SSE body line by line: [(seconds since request, line)]."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    lines = []
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for line in response:
            lines.append((time.monotonic() - started, line))
    return lines


@pytest.fixture(scope="module")
def serving(
    cluster: Cluster,
    planner: Callable,
    router: str,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
) -> str:
    folder = tmp_path_factory.mktemp("serving")
    (folder / "main.yaml").write_text(
        f"name: main-tiny\nsource: file://{tiny_model}\nprofile:\n  context: 512\n"
        '  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]\nreplicas: 1\n'
    )
    endpoint = serve(planner, folder, cluster, "main-tiny")
    wait_for(lambda: router_has(router, "main-tiny"), 10, "router to list main-tiny")
    return endpoint


def test_job_service_and_status_are_visible(
    cluster: Cluster, planner: Callable, serving: str
) -> None:
    job = nomad_get(cluster, "/v1/job/main-tiny")
    assert job["Status"] == "running"
    assert job["Meta"]["llmgw_model"] == "main-tiny"
    services = http_json(f"{cluster.consul_addr}/v1/catalog/services")
    assert "llmgw-main-tiny" in services
    status = planner("status", "--output", "json")
    [row] = [r for r in json.loads(status.stdout) if r["name"] == "main-tiny"]
    assert (row["state"], row["desired"], row["ready"]) == ("serving", 1, 1)


def test_completion_through_router(router: str, serving: str) -> None:
    body = {"model": "main-tiny", "prompt": "hello", "max_tokens": 8}
    answer = http_json(f"{router}/v1/completions", body)
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] > 0
    chat = http_json(
        f"{router}/v1/chat/completions",
        {"model": "main-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"


def test_c03_stream_same_bytes_as_direct(router: str, serving: str) -> None:
    body = {
        "model": "main-tiny",
        "prompt": "once",
        "max_tokens": 32,
        "stream": True,
        "temperature": 0,
        "seed": 7,
    }
    direct = raw_stream(f"http://{serving}/v1/completions", body)
    routed = raw_stream(f"{router}/v1/completions", body)
    assert routed[-2][1] == b"data: [DONE]\n" or routed[-1][1].startswith(b"data: [DONE]")

    def strip(lines: list[tuple[float, bytes]]) -> list[bytes]:
        # Each chunk carries its own creation time and id, and the second request
        # reuses the first one's prompt cache; the rest must match.
        out = []
        for _, line in lines:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                chunk.pop("created", None)
                chunk.pop("id", None)
                chunk.pop("timings", None)
                chunk.get("usage", {}).pop("prompt_tokens_details", None)
                out.append(json.dumps(chunk, sort_keys=True).encode())
            else:
                out.append(line)
        return out

    assert strip(routed) == strip(direct)
    assert len([1 for _, line in routed if line.startswith(b"data: {")]) > 3


def test_a_router_that_asks_for_stream_usage_strips_it(
    cluster: Cluster, planner_daemon: PlannerDaemon, serving: str
) -> None:
    """With LLMGW_ROUTER_ASK_STREAM_USAGE the router adds include_usage to a stream
    that did not ask: the client gets no usage event, and the router counts what
    llama-server reports for the same request sent to it directly."""
    chat = {
        "model": "main-tiny", "max_tokens": 6, "temperature": 0, "seed": 3, "stream": True,
        "messages": [{"role": "user", "content": "one two"}],
    }  # fmt: skip
    direct = raw_stream(
        f"http://{serving}/v1/chat/completions",
        {**chat, "stream_options": {"include_usage": True}},
    )
    [expected] = [json.loads(line[6:])["usage"] for _, line in direct if b'"usage"' in line]
    with run_router(cluster, planner_daemon.url, LLMGW_ROUTER_ASK_STREAM_USAGE="true") as asking:
        wait_for(lambda: router_has(asking, "main-tiny"), 10, "router to list main-tiny")
        before = router_tokens(asking, "main-tiny")
        routed = raw_stream(f"{asking}/v1/chat/completions", chat)
        after = router_tokens(asking, "main-tiny")
    assert not any(b'"usage"' in line for _, line in routed)
    assert routed[-2][1] == b"data: [DONE]\n"
    assert after["prompt"] - before["prompt"] == expected["prompt_tokens"]
    assert after["completion"] - before["completion"] == expected["completion_tokens"]


def test_a_key_over_its_requests_per_minute_gets_openais_429(
    cluster: Cluster, planner_daemon: PlannerDaemon, serving: str, tmp_path: Path
) -> None:
    """Two requests a minute for one key, through a real router to a real replica:
    the third is 429 rate_limit_exceeded with OpenAI's headers, and the openai
    client reads it as its RateLimitError; the key's usage is counted by name."""
    secret = "sk-limited-0123456789abcdef"
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: limited\n    sha256: {hashlib.sha256(secret.encode()).hexdigest()}\n"
        "    limits: {requests_per_minute: 2}\n"
    )
    with run_router(cluster, planner_daemon.url, LLMGW_API_KEYS_FILE=str(keys)) as limited:
        client = openai.OpenAI(base_url=f"{limited}/v1", api_key=secret, max_retries=0)
        wait_for(lambda: client.models.list().data, 10, "router to list main-tiny")
        # The limit counts per UTC minute (shared through Consul: router.limits):
        # the three requests go in one minute.
        if time.time() % 60 > 40:
            wait_for(lambda: time.time() % 60 < 20, 25, "the next UTC minute")
        for _ in range(2):
            client.completions.create(model="main-tiny", prompt="a", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="main-tiny", prompt="a", max_tokens=2)
        response = refused.value.response
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert response.headers["x-ratelimit-limit-requests"] == "2"
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
        # Until the minute ends.
        assert 1 <= int(response.headers["retry-after"]) <= 60
        with urllib.request.urlopen(f"{limited}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
    assert (
        'llmgw_router_key_requests_total{key="limited",model="main-tiny",outcome="ok"} 2.0'
        in metrics
    )
    assert 'llmgw_router_tokens_total{key="limited",model="main-tiny",type="completion"}' in metrics


def router_tokens(router: str, model: str) -> dict[str, float]:
    """The router's ``llmgw_router_tokens_total`` of `model` (keys off: ``anonymous``),
    by type, and its time-to-first-token count under ``ttft``."""
    with urllib.request.urlopen(f"{router}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {"prompt": 0, "cached_prompt": 0, "completion": 0, "ttft": 0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name == "llmgw_router_tokens_total":
                assert sample.labels["key"] == "anonymous"
                out[sample.labels["type"]] = sample.value
            elif sample.name == "llmgw_router_time_to_first_token_seconds_count":
                out["ttft"] = sample.value
    return out


def test_usage_counted_by_the_router_equals_llama_servers_own(router: str, serving: str) -> None:
    """A whole chat answer, a stream that did not ask for usage (the router asks,
    and the client never sees the usage event) and one that did: the router's
    counts are llama-server's usage (and, for the stream that did not ask, the
    timings llama-server sends in its last event)."""
    chat = {"model": "main-tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
    url = f"{router}/v1/chat/completions"
    before = router_tokens(router, "main-tiny")
    whole = http_json(url, chat)["usage"]

    plain = raw_stream(url, {**chat, "stream": True})
    events = [json.loads(line[6:]) for _, line in plain if line.startswith(b"data: {")]
    assert not any("usage" in e for e in events), (
        "the usage the router asked for reached the client"
    )
    assert plain[-2][1] == b"data: [DONE]\n"
    timings = events[-1]["timings"]

    asked = raw_stream(url, {**chat, "stream": True, "stream_options": {"include_usage": True}})
    [usage_event] = [
        json.loads(line[6:])
        for _, line in asked
        if line.startswith(b"data: {") and b'"usage"' in line
    ]
    assert usage_event["choices"] == []
    streamed = usage_event["usage"]

    after = router_tokens(router, "main-tiny")
    assert after["prompt"] - before["prompt"] == (
        whole["prompt_tokens"]
        + timings["prompt_n"]
        + timings["cache_n"]
        + streamed["prompt_tokens"]
    )
    assert after["cached_prompt"] - before["cached_prompt"] == (
        whole["prompt_tokens_details"]["cached_tokens"]
        + timings["cache_n"]
        + streamed["prompt_tokens_details"]["cached_tokens"]
    )
    assert after["completion"] - before["completion"] == (
        whole["completion_tokens"] + timings["predicted_n"] + streamed["completion_tokens"]
    )
    assert after["ttft"] - before["ttft"] == 2


def test_streams_back_to_back_never_reuse_a_connection_llama_server_closed(
    router: str, serving: str
) -> None:
    """llama-server closes the connection after a streamed answer without saying
    so (keep-alive advertised, no Connection: close). Found by
    bench/prefix_routing.py: a chat's next turn taken by that pooled connection
    got 502 ("Can not write request body"). Streams, then plain requests, back to back
    from a few clients: every one answered 200, whole."""
    import asyncio

    import aiohttp

    errors: list[str] = []

    async def client(session: aiohttp.ClientSession, i: int) -> list[int]:
        statuses = []
        for n in range(12):
            body = {
                "model": "main-tiny",
                "prompt": f"client {i} turn {n}",
                "max_tokens": 2,
                "stream": n % 3 != 2,
            }
            async with session.post(f"{router}/v1/completions", json=body) as resp:
                text = await resp.text()
                statuses.append(resp.status)
                if resp.status != 200:
                    errors.append(text[:300])
                if body["stream"] and resp.status == 200:
                    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
        return statuses

    async def run() -> list[int]:
        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(*(client(session, i) for i in range(4)))
        return [s for r in results for s in r]

    statuses = asyncio.run(run())
    assert statuses == [200] * len(statuses), errors


def test_openai_client_with_and_without_stream(router: str, serving: str) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused")
    answer = client.completions.create(model="main-tiny", prompt="hi", max_tokens=6)
    assert answer.choices[0].text is not None and answer.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="main-tiny",
            max_tokens=6,
            stream=True,
            messages=[{"role": "user", "content": "hi"}],
        )
    )
    assert len(chunks) > 1
    models = [m.id for m in client.models.list()]
    assert "main-tiny" in models


def test_unknown_model_is_404_in_openai_shape(router: str, serving: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        http_json(f"{router}/v1/completions", {"model": "no-such-model", "prompt": "x"})
    assert info.value.code == 404
    error = json.load(info.value)["error"]
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]


def test_defined_model_without_endpoint_is_503(
    router: str, planner: Callable, model_files: Callable[..., Path]
) -> None:
    assert planner("apply", str(model_files("zero-replicas", replicas=0))).returncode == 0

    def refused() -> dict | None:
        try:
            http_json(f"{router}/v1/completions", {"model": "zero-replicas", "prompt": "x"})
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, **json.load(exc)["error"]} if exc.code == 503 else None
        return None

    error = wait_for(refused, 10, "503 for a defined model with no endpoint")
    assert error["message"] and error["type"]


def slots_busy(endpoint: str) -> bool:
    return any(slot["is_processing"] for slot in http_json(f"http://{endpoint}/slots"))


def test_c04_client_disconnect_frees_the_slot(
    cluster: Cluster,
    planner: Callable,
    router: str,
    model_files: Callable[..., Path],
    tmp_path: Path,
) -> None:
    big = write_tiny_gguf(tmp_path / "slow.gguf", width=512, layers=8)
    endpoint = serve(
        planner,
        model_files("c04-slow", source=f"file://{big}", profile=SLOW_PROFILE),
        cluster,
        "c04-slow",
    )
    wait_for(lambda: router_has(router, "c04-slow"), 10, "router to list c04-slow")
    host, port = router.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": "c04-slow",
            "prompt": "go",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while received.count(b"data: ") < 5:
            received += sock.recv(65536)
        assert slots_busy(endpoint), "generation should still be running"
    closed_at = time.monotonic()
    wait_for(lambda: not slots_busy(endpoint), 5, "the llama-server slot to go idle")
    assert time.monotonic() - closed_at < 5


def test_https_source_is_downloaded_by_nomad(
    cluster: Cluster,
    planner: Callable,
    router: str,
    test_ca: TlsCA,
    model_files: Callable[..., Path],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "weights.gguf").write_bytes(tiny_model.read_bytes())
    digest = hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    server = serve_https(site, test_ca)
    try:
        folder = model_files(
            "https-tiny", source=f"{server.url}/weights.gguf", extra=f"sha256: {digest}\n"
        )
        serve(planner, folder, cluster, "https-tiny")
        assert server.requests == ["/weights.gguf"]
        wait_for(lambda: router_has(router, "https-tiny"), 10, "router to list https-tiny")
    finally:
        server.close()
