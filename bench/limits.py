"""What per-key limits shared through Consul cost, and whether they hold across routers.

Starts, all on 127.0.0.1 and all stopped at exit: a Consul dev agent, the stub
upstream of ``bench/accounting_overhead.py`` (its own process: a fixed
non-streaming completion carrying ``usage``), and three routers on that Consul
and stub, all with API keys: ``off`` (its key has no limits), ``on`` and ``on2``
(keys with ``requests_per_minute`` and ``tokens_per_day``, shared through Consul,
the default).

1. **Added latency**, side by side: ``--requests`` completions to ``on`` and to
   ``off``, alternating (on, off, off, on...) on one keep-alive connection each,
   so a burst of load from elsewhere hits both alike: p50 / p99 of each and the
   difference. The ``on`` key's limit (``--rpm``) is set so that its router
   takes several leases during the run (a lease is 5% of the limit): the
   figure includes those Consul round trips, counted in ``on_consul_calls``.
2. **One lease's price**: ``--cas`` compare-and-sets through the router's own
   client (:class:`router.sharedlimits.ConsulCounters`) with nobody else
   writing (one round trip each), then two clients alternating on one document
   (each write finds the other's: read and write), p50 / p99. A request pays
   this once per lease: ``per_request_us`` = p50 / lease size.
3. **Two routers, one limit**: a key limited to ``--n`` requests a minute gets
   ``10 n`` requests spread over ``on`` and ``on2`` (16 at once): how many
   passed (expected ``n``, at most one lease per router fewer), how many got
   429, and how many UTC minutes the load touched (it starts early in a minute:
   the bench waits for the next one when fewer than 30 s are left).

Usage::

    python bench/limits.py [--requests 2000] [--rpm 6000] [--n 100] [--cas 300] [--output json]

Figures are from a shared machine: other processes' load bends them; compare
the side-by-side columns of one run, not runs with each other. Exit codes: 0
done, 1 the two-router count was outside its bound, 2 setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _support import Children, define_model, free_port, http, percentile, report, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from router.limits import REQUEST_LEASE_FRACTION
from router.sharedlimits import ConsulCounters
from router.windows import Period, lease_size, window_of

MODEL = "bench"
BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
SECRETS = {"off": "sk-bench-off-0123456789", "on": "sk-bench-on-0123456789",
           "n": "sk-bench-n-0123456789"}  # fmt: skip


def keys_files(workdir: str, rpm: int, n: int) -> dict[str, str]:
    """The ``off`` routers' keys file (no limits) and the ``on`` routers' (limits)."""

    def entry(name: str, limits: str) -> str:
        digest = hashlib.sha256(SECRETS[name].encode()).hexdigest()
        return f"  - name: key-{name}\n    sha256: {digest}\n" + (
            f"    limits: {limits}\n" if limits else ""
        )

    files = {
        "off": "keys:\n" + entry("off", ""),
        "on": "keys:\n"
        + entry("on", f"{{requests_per_minute: {rpm}, tokens_per_day: 1000000000}}")
        + entry("n", f"{{requests_per_minute: {n}}}"),
    }
    paths = {}
    for name, text in files.items():
        paths[name] = os.path.join(workdir, f"keys-{name}.yaml")
        Path(paths[name]).write_text(text)
    return paths


async def timed(session, url: str, secret: str) -> float:
    started = time.perf_counter()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}
    async with session.post(url, data=BODY, headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
    return time.perf_counter() - started


async def side_by_side(ports: dict[str, int], requests: int) -> dict[str, list[float]]:
    import aiohttp

    sessions = {n: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for n in ports}
    urls = {n: f"http://127.0.0.1:{p}/v1/completions" for n, p in ports.items()}
    times: dict[str, list[float]] = {n: [] for n in ports}
    try:
        for _ in range(100):  # warm pools and caches
            for name in ports:
                await timed(sessions[name], urls[name], SECRETS[name])
        for i in range(requests):
            for name in list(ports) if i % 2 == 0 else list(reversed(ports)):
                times[name].append(await timed(sessions[name], urls[name], SECRETS[name]))
    finally:
        for session in sessions.values():
            await session.close()
    return times


async def cas_rounds(consul: str, rounds: int) -> dict[str, float]:
    """p50/p99 ms of one take through the router's client, alone and contended."""
    one = ConsulCounters(consul)
    two = ConsulCounters(consul)
    out: dict[str, float] = {}
    try:
        window, _ = window_of(Period.MINUTE, time.time())
        for label, clients in (("uncontended", [one]), ("contended", [one, two])):
            kind = f"bench-{label}"
            await one.take("cas", kind, window, 10**12, 1, 0)  # the first read
            times = []
            for i in range(rounds):
                started = time.perf_counter()
                await clients[i % len(clients)].take("cas", kind, window, 10**12, 1, 0)
                times.append(time.perf_counter() - started)
            out[f"cas_{label}_p50_ms"] = percentile(times, 0.5) * 1000
            out[f"cas_{label}_p99_ms"] = percentile(times, 0.99) * 1000
    finally:
        await one.close()
        await two.close()
    return out


async def two_routers(ports: list[int], n: int) -> dict[str, int]:
    import aiohttp

    if 60 - time.time() % 60 < 30:
        await asyncio.sleep(60 - time.time() % 60 + 0.5)  # the next minute's start
    first = int(time.time() // 60)
    statuses: list[int] = []
    gate = asyncio.Semaphore(16)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {SECRETS['n']}"}
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            async with gate:
                url = f"http://127.0.0.1:{ports[i % 2]}/v1/completions"
                async with session.post(url, data=BODY, headers=headers) as r:
                    await r.read()
                    statuses.append(r.status)

        await asyncio.gather(*(one(i) for i in range(10 * n)))
    return {
        "ok": statuses.count(200),
        "refused_429": statuses.count(429),
        "other": len(statuses) - statuses.count(200) - statuses.count(429),
        "minutes_touched": int(time.time() // 60) - first + 1,
    }


def consul_calls(port: int) -> dict[str, float]:
    calls = {}
    for line in http("GET", f"http://127.0.0.1:{port}/metrics").decode().splitlines():
        if line.startswith("llmgw_router_limits_consul_calls_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            calls[outcome] = float(line.rsplit(" ", 1)[1])
    return calls


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-limits-") as workdir:
        children = Children(workdir)
        try:
            stub = free_port()
            overhead = str(Path(__file__).with_name("accounting_overhead.py"))
            children.spawn([sys.executable, overhead, "--serve-stub", str(stub)], "stub")
            consul_port = free_port()
            consul = children.consul(consul_port)
            wait_for(lambda: socket.create_connection(("127.0.0.1", stub)), 10, "stub")
            service = {
                "ID": "llmgw-bench-1", "Name": f"llmgw-{MODEL}", "Address": "127.0.0.1",
                "Port": stub, "Meta": {"llmgw_model": MODEL, "llmgw_definition_hash": "bench"},
                "Check": {"CheckID": "bench-ttl", "TTL": "1h", "Status": "passing"},
            }  # fmt: skip
            http("PUT", f"{consul}/v1/agent/service/register", json.dumps(service).encode())
            define_model(consul, MODEL)
            keys = keys_files(workdir, args.rpm, args.n)
            ports = {"on": free_port(), "off": free_port(), "on2": free_port()}
            # No planner in this bench: never report usage to one a demo left running.
            os.environ["LLMGW_ACTIVATION"] = "0"
            for name, port in ports.items():
                os.environ["LLMGW_API_KEYS_FILE"] = keys["off" if name == "off" else "on"]
                children.router_process(port, consul_port, name=f"router-{name}")
            for name, port in ports.items():
                secret = SECRETS["off" if name == "off" else "on"]
                url = f"http://127.0.0.1:{port}/v1/completions"

                def up(url: str = url, secret: str = secret) -> bool:
                    auth = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
                    req = urllib.request.Request(url, BODY, auth)
                    with urllib.request.urlopen(req, timeout=5) as r:
                        return r.status == 200

                wait_for(up, 30, f"router {name}")
            result: dict = {
                "cpus": os.cpu_count(),
                "requests_each": args.requests,
                "rpm_on": args.rpm,
                "lease_on": lease_size(args.rpm, REQUEST_LEASE_FRACTION),
            }
            before = consul_calls(ports["on"])
            times = asyncio.run(
                side_by_side({"on": ports["on"], "off": ports["off"]}, args.requests)
            )
            for name, values in times.items():
                result[f"{name}_p50_ms"] = percentile(values, 0.5) * 1000
                result[f"{name}_p99_ms"] = percentile(values, 0.99) * 1000
            for q in ("p50", "p99"):
                result[f"{q}_added_ms"] = result[f"on_{q}_ms"] - result[f"off_{q}_ms"]
            after = consul_calls(ports["on"])
            result["on_consul_calls"] = {k: after[k] - before.get(k, 0) for k in after}
            result.update(asyncio.run(cas_rounds(consul, args.cas)))
            result["per_request_us"] = result["cas_uncontended_p50_ms"] * 1000 / result["lease_on"]
            lease_n = lease_size(args.n, REQUEST_LEASE_FRACTION)
            counted = asyncio.run(two_routers([ports["on"], ports["on2"]], args.n))
            result["two_routers"] = {"n": args.n, "lease": lease_n, **counted}
            low = args.n - 2 * (lease_n - 1)
            result["met"] = {
                "two_routers_within_bound": low
                <= counted["ok"]
                <= args.n * counted["minutes_touched"]
            }
        except Exception as exc:
            raise SystemExit(f"failed: {exc}\n{json.dumps(children.logs(), indent=1)}") from exc
        finally:
            children.close()
    return result


def table(result: dict) -> None:
    print(
        f"latency, limits on vs off ({result['requests_each']} each, alternating): "
        f"p50 {result['on_p50_ms']:.3f} / {result['off_p50_ms']:.3f} ms "
        f"(added {result['p50_added_ms']:+.3f}); p99 {result['on_p99_ms']:.3f} / "
        f"{result['off_p99_ms']:.3f} ms (added {result['p99_added_ms']:+.3f}); "
        f"Consul calls of 'on': {result['on_consul_calls']} (lease {result['lease_on']})"
    )
    print(
        f"one compare-and-set: p50 {result['cas_uncontended_p50_ms']:.2f} ms, p99 "
        f"{result['cas_uncontended_p99_ms']:.2f} ms alone; p50 "
        f"{result['cas_contended_p50_ms']:.2f} ms, p99 {result['cas_contended_p99_ms']:.2f} ms "
        f"with two writers; per request {result['per_request_us']:.1f} us"
    )
    two = result["two_routers"]
    print(
        f"two routers, {two['n']}/min under {10 * two['n']}: {two['ok']} passed, "
        f"{two['refused_429']} got 429, {two['other']} other (lease {two['lease']}, "
        f"{two['minutes_touched']} minute(s) touched)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rpm", type=int, default=6000)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--cas", type=int, default=300)
    parser.add_argument("--output", choices=("table", "json"), default="table")
    args = parser.parse_args()
    report(measure(args), args.output, table)


if __name__ == "__main__":
    main()
