"""Measure how fast the router refuses a parked model: the 503 must come at once.

Starts, all on 127.0.0.1 and all stopped at exit (SIGTERM and Ctrl-C included):

- a Consul dev agent (``$LLMGW_CONSUL_BIN``, else ``consul`` on PATH, else
  ~/.cache/llmgw/bin/consul);
- the router (``python -m router serve``), after writing the model
  ``parked-bench`` to ``llmgw/models/`` and a parked record with a real
  llama-server "unknown model architecture" stderr tail to ``llmgw/state/``
  (the planner's shape), with its routing document (``llmgw/routing/``, what the
  router reads). A passing endpoint is registered too, one that would
  refuse connections: parked must win without the router trying it.

Then it sends ``POST /v1/completions`` for the parked model over keep-alive
connections and checks each answer is 503 ``model_parked``:

1. ``--requests`` (2000) one after another on one connection;
2. ``--concurrent-requests`` (200) spread over ``--connections`` (16)
   connections, one thread each;

and prints p50 / p99 / max latency in ms per phase, and the router's CPU per
refusal. Target: p99 <= 20 ms in both phases. Usage::

    python bench/refusal_latency.py [--requests 2000] [--output json]

Exit codes: 0 target met, 1 target missed, 2 setup failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

from _support import (
    REPO,
    Children,
    RawClient,
    cpu_seconds,
    define_model,
    exit_on_sigterm,
    free_port,
    http,
    percentile,
    wait_for,
)

sys.path.insert(0, str(REPO))
from llmgw_contract import StateDocument, encode, routing_of

MODEL = "parked-bench"
TARGET_P99_MS = 20.0
# Every socket read gives up after this: the bench never hangs on a stuck router.
SOCKET_TIMEOUT_S = 10.0
REQUEST_BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
KEV_LINE = "llama_model_load: error loading model: unknown model architecture: 'kev'"
LAST_ERROR = "\n".join(
    [
        "Terminated: Exit Code: 1",
        "0.00.002.058 I srv  llama_server: initializing ...",
        "0.00.007.933 I srv    load_model: loading model '/models/kev.gguf'",
        f"0.00.010.861 E {KEV_LINE}",
        "0.00.010.889 E llama_model_load_from_file_impl: failed to load model",
        "0.00.012.311 E cmn  common_init_: failed to load model '/models/kev.gguf'",
        "0.00.012.319 I srv    operator(): operator(): cleaning up before exit...",
        "0.00.013.184 E srv  llama_server: exiting due to model loading error",
    ]
)


def setup(children: Children) -> tuple[int, int]:
    """Start Consul and the router with a parked model; ``(router port, router pid)``."""
    consul_port, router_port = free_port(), free_port()
    consul = children.consul(consul_port)
    define_model(consul, MODEL)
    state = {
        "name": MODEL,
        "consecutive_failures": 5,
        "last_error": LAST_ERROR,
        "last_error_at": "2026-11-29T21:00:00+00:00",
        "counted": [f"alloc{i}/server/{i}" for i in range(5)],
        "healthy_allocs": [],
        "healthy_at_ns": 0,
        "parked": {
            "reason": "5 consecutive start failures",
            "last_error": LAST_ERROR,
            "since": "2026-11-29T21:00:05+00:00",
            "definition_hash": "bench",
        },
        "unplaceable": None,
    }
    http("PUT", f"{consul}/v1/kv/llmgw/state/{MODEL}", json.dumps(state).encode())
    # What the router reads, written beside it as the planner does.
    routing = routing_of(StateDocument.model_validate(state))
    http("PUT", f"{consul}/v1/kv/llmgw/routing/{MODEL}", encode(routing).encode())
    service = {
        "ID": "llmgw-parked-bench-1",
        "Name": f"llmgw-{MODEL}",
        "Address": "127.0.0.1",
        "Port": free_port(),  # nothing listens: a request that got here would fail
        "Check": {"CheckID": "parked-bench-ttl", "TTL": "1h", "Status": "passing"},
    }
    http("PUT", f"{consul}/v1/agent/service/register", json.dumps(service).encode())
    router = children.router_process(router_port, consul_port)
    health = f"http://127.0.0.1:{router_port}/health"
    wait_for(lambda: json.loads(http("GET", health))["status"] == "ok", 30, "router to sync")
    return router_port, router.pid


def check_refusal(body: bytes) -> None:
    error = json.loads(body)["error"]
    if error["code"] != "model_parked" or KEV_LINE not in error["message"]:
        raise RuntimeError(f"not the parked refusal: {error}")


def summary(seconds: list[float]) -> dict:
    ms = 1000.0
    return {
        "requests": len(seconds),
        "p50_ms": percentile(seconds, 0.5) * ms,
        "p99_ms": percentile(seconds, 0.99) * ms,
        "max_ms": max(seconds) * ms,
    }


def sequential(port: int, requests: int) -> dict:
    client = RawClient(port, REQUEST_BODY, expect=503, timeout=SOCKET_TIMEOUT_S)
    try:
        for _ in range(100):  # warm up: connection, caches, the message cache
            client.roundtrip()
        check_refusal(client.last_body)
        return summary([client.roundtrip() for _ in range(requests)])
    finally:
        client.close()


def concurrent(port: int, requests: int, connections: int) -> dict:
    clients = [
        RawClient(port, REQUEST_BODY, expect=503, timeout=SOCKET_TIMEOUT_S)
        for _ in range(connections)
    ]
    seconds: list[float] = []
    failures: list[BaseException] = []
    start = threading.Barrier(connections)

    def worker(client: RawClient, count: int) -> None:
        try:
            client.roundtrip()  # warm this connection
            start.wait(timeout=SOCKET_TIMEOUT_S)
            seconds.extend(client.roundtrip() for _ in range(count))
        except BaseException as exc:
            failures.append(exc)

    shares = [requests // connections + (i < requests % connections) for i in range(connections)]
    threads = [
        threading.Thread(target=worker, args=pair) for pair in zip(clients, shares, strict=True)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=SOCKET_TIMEOUT_S * (max(shares) + 2))
    finally:
        for client in clients:
            client.close()
    if failures or len(seconds) != requests:
        raise RuntimeError(f"concurrent phase failed: {failures[:3]}")
    return {**summary(seconds), "connections": connections}


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-refusal-") as workdir:
        children = Children(workdir)
        try:
            try:
                port, pid = setup(children)
            except Exception as exc:
                print(f"setup failed: {exc}", file=sys.stderr)
                print(json.dumps(children.logs(), indent=1), file=sys.stderr)
                sys.exit(2)
            cpu_before = cpu_seconds(pid)
            result = {"cpus": os.cpu_count(), "model": MODEL}
            result["sequential"] = sequential(port, args.requests)
            result["concurrent"] = concurrent(port, args.concurrent_requests, args.connections)
            sent = args.requests + args.concurrent_requests + 100 + args.connections
            result["router_cpu_us_per_refusal"] = (cpu_seconds(pid) - cpu_before) / sent * 1e6
        finally:
            children.close()
    result["target_p99_ms"] = TARGET_P99_MS
    result["met"] = all(
        result[phase]["p99_ms"] <= TARGET_P99_MS for phase in ("sequential", "concurrent")
    )
    return result


def print_table(r: dict) -> None:
    print(f"{'refusal of a parked model':<34} {'p50':>8} {'p99':>8} {'max':>8}  target  ok")
    for phase, label in (
        ("sequential", f"{r['sequential']['requests']} sequential, 1 conn"),
        ("concurrent", f"{r['concurrent']['requests']} over {r['concurrent']['connections']} conn"),
    ):
        row = r[phase]
        ok = "yes" if row["p99_ms"] <= r["target_p99_ms"] else "NO"
        print(
            f"{label:<34} {row['p50_ms']:>5.2f} ms {row['p99_ms']:>5.2f} ms "
            f"{row['max_ms']:>5.2f} ms  p99<=20  {ok}"
        )
    print(
        f"(router CPU per refusal {r['router_cpu_us_per_refusal']:.0f} us; "
        f"{r['cpus']} CPUs shared by client, router and Consul)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="sequential, 1 connection")
    parser.add_argument("--concurrent-requests", type=int, default=200)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--output", choices=("table", "json"), default="table")
    args = parser.parse_args()
    if min(args.requests, args.concurrent_requests, args.connections) < 1:
        parser.error("counts must be at least 1")
    exit_on_sigterm()
    result = measure(args)
    if args.output == "json":
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    sys.exit(0 if result["met"] else 1)


if __name__ == "__main__":
    main()
