"""Measure routing under overload: success rate and p99 time to first token at twice the
replicas' capacity, prefix routing against least-outstanding (issue 21, item 6).

A prefix-only scorer is known to collapse under overload: every turn of a popular
conversation goes to one replica, whose queue grows while the others idle. The
router's prefix routing bounds each replica's load (router.prefix: consistent
hashing with bounded loads), and this bench checks that it holds at 2x capacity.

Starts, all on 127.0.0.1 and all stopped at exit (bench/_support.py):

- a Consul dev agent;
- ``--replicas`` (3) STUB replicas in one child process (not llama-server: a real
  CPU replica's capacity would move with the machine's other load, and this is
  about the router's choices): each has ``--slots`` (2) slots, says so in
  ``GET /props``, answers ``/health``, and serves a streamed completion in a
  fixed time: a prefill of ``--miss-ms`` (200 ms) or, when the replica served the
  same conversation recently (its last ``2 x slots`` conversations: the prompt
  cache llama-server keeps per slot), ``--hit-ms`` (40 ms); then ``--tokens``
  (10) tokens ``--token-ms`` (10 ms) apart. A replica never runs more than its
  slots at once; the rest wait in its own queue, as in llama-server;
- for each run a router (``LLMGW_ROUTING=least-outstanding`` or ``prefix``,
  ``LLMGW_QUEUE_TIMEOUT`` ``--queue-timeout`` (5 s), activation off), runs in
  alternating order (A B, B A, ...), the replicas' caches emptied before each.

The load: open-loop Poisson arrivals for ``--duration`` (20 s) at twice the
capacity, capacity = replicas x slots / (miss prefill + tokens), every request a
turn of one of ``--conversations`` (64) conversations picked with Zipf weights
(1/rank: a few hot ones). A request succeeds when its stream ends with
``[DONE]``; TTFT is the time to its first token, p99 over the successful ones.
Target: prefix routing's success rate and p99 TTFT no worse than
least-outstanding's (5 % and 10 % of slack for run-to-run noise).

Usage::

    python bench/overload.py [--rounds 2] [--duration 20] [--output json]

Exit codes: 0 target met, 1 missed, 2 setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict

import aiohttp
from _support import (
    REPO,
    Children,
    define_model,
    exit_on_sigterm,
    free_port,
    http,
    percentile,
    report,
    wait_for,
)

MODEL = "overload"
POLICIES = ("least-outstanding", "prefix")
SUCCESS_SLACK = 0.05
TTFT_SLACK = 1.10


# --- stub replicas ---------------------------------------------------------------


def serve_replicas(ports: list[int], args: argparse.Namespace) -> None:
    from aiohttp import web

    async def main() -> None:
        runners = []
        for port in ports:
            app = web.Application()
            replica = _Replica(args)
            app.add_routes(
                [
                    web.get("/props", replica.props),
                    web.get("/health", replica.health),
                    web.post("/reset", replica.reset),
                    web.post("/v1/completions", replica.complete),
                ]
            )
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
            runners.append(runner)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        for runner in runners:
            await runner.cleanup()

    asyncio.run(main())


class _Replica:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.slots = asyncio.Semaphore(args.slots)
        self.cache: OrderedDict[str, None] = OrderedDict()
        self.hits = self.misses = 0

    async def props(self, request):
        from aiohttp import web

        return web.json_response({"total_slots": self.args.slots})

    async def health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok"})

    async def reset(self, request):
        from aiohttp import web

        counts = {"hits": self.hits, "misses": self.misses}
        self.cache.clear()
        self.hits = self.misses = 0
        return web.json_response(counts)

    async def complete(self, request):
        from aiohttp import web

        body = await request.json()
        key = body["prompt"][:100]
        async with self.slots:
            hit = key in self.cache
            self.hits += hit
            self.misses += not hit
            self.cache[key] = None
            self.cache.move_to_end(key)
            while len(self.cache) > 2 * self.args.slots:
                self.cache.popitem(last=False)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await asyncio.sleep((self.args.hit_ms if hit else self.args.miss_ms) / 1000)
            for i in range(self.args.tokens):
                if i:
                    await asyncio.sleep(self.args.token_ms / 1000)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response


# --- processes ---------------------------------------------------------------------


class Cluster(Children):
    def __init__(self, workdir: str, args: argparse.Namespace) -> None:
        super().__init__(workdir)
        self.args = args
        self.consul_port = free_port()
        self.replica_ports = [free_port() for _ in range(args.replicas)]

    def start(self) -> None:
        self.spawn(
            [sys.executable, __file__, "--serve-replicas", ",".join(map(str, self.replica_ports)),
             *self.stub_args()],
            "replicas",
        )  # fmt: skip
        consul = self.consul(self.consul_port)
        for port in self.replica_ports:
            wait_for(lambda p=port: http("GET", f"http://127.0.0.1:{p}/health"), 10, "replicas")
            service = {
                "ID": f"llmgw-{MODEL}-{port}",
                "Name": f"llmgw-{MODEL}",
                "Address": "127.0.0.1",
                "Port": port,
                "Check": {"CheckID": f"ttl-{port}", "TTL": "1h", "Status": "passing"},
            }
            http("PUT", f"{consul}/v1/agent/service/register", json.dumps(service).encode())
        define_model(consul, MODEL)

    def hit_rate(self) -> float:
        """The replicas' prompt-cache hit rate since the last reset (and reset them)."""
        counts = [
            json.loads(http("POST", f"http://127.0.0.1:{port}/reset", b""))
            for port in self.replica_ports
        ]
        hits = sum(c["hits"] for c in counts)
        return hits / max(1, hits + sum(c["misses"] for c in counts))

    def stub_args(self) -> list[str]:
        a = self.args
        return [
            "--slots", str(a.slots), "--miss-ms", str(a.miss_ms), "--hit-ms", str(a.hit_ms),
            "--tokens", str(a.tokens), "--token-ms", str(a.token_ms),
        ]  # fmt: skip

    def router(self, policy: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        # Not Children.router_process: that one lifts the replicas' limit above any
        # load, and here each replica's limit is its slots, read from /props.
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "LLMGW_REPLICA_CONCURRENCY": "0",
            "LLMGW_ROUTING": policy,
            "LLMGW_ACTIVATION": "0",
            "LLMGW_QUEUE_TIMEOUT": str(self.args.queue_timeout),
        }
        proc = self.spawn(
            [sys.executable, "-m", "router", "serve", "--port", str(port),
             "--consul-addr", f"127.0.0.1:{self.consul_port}", "--log-level", "warning"],
            f"router-{policy}", cwd=REPO, env=env,
        )  # fmt: skip
        body = json.dumps({"model": MODEL, "prompt": "warm", "stream": True}).encode()
        url = f"http://127.0.0.1:{port}/v1/completions"
        wait_for(lambda: b"[DONE]" in http("POST", url, body), 30, f"{policy} router")
        for replica in self.replica_ports:
            http("POST", f"http://127.0.0.1:{replica}/reset", b"")
        return proc, port


# --- load ----------------------------------------------------------------------------


def conversations(count: int, seed: int) -> tuple[list[str], list[float]]:
    rng = random.Random(seed)
    texts = [
        f"conversation {i}: " + " ".join(rng.choice("abcdefgh") * 5 for _ in range(40))
        for i in range(count)
    ]
    return texts, [1.0 / (rank + 1) for rank in range(count)]


async def offer(port: int, args: argparse.Namespace, seed: int) -> dict:
    capacity = args.replicas * args.slots / ((args.miss_ms + args.tokens * args.token_ms) / 1000)
    rate = 2 * capacity
    texts, weights = conversations(args.conversations, seed)
    rng = random.Random(seed)
    url = f"http://127.0.0.1:{port}/v1/completions"
    ttfts: list[float] = []
    outcomes: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.queue_timeout + 60)

    async def one(session: aiohttp.ClientSession, text: str) -> None:
        body = {"model": MODEL, "prompt": text + " next turn", "stream": True, "max_tokens": 10}
        sent = time.perf_counter()
        first = None
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    outcome = f"http_{resp.status}"
                    await resp.read()
                else:
                    data = b""
                    async for chunk in resp.content.iter_any():
                        if first is None and b'"choices"' in chunk:
                            first = time.perf_counter() - sent
                        data += chunk
                    outcome = "ok" if data.rstrip().endswith(b"data: [DONE]") else "truncated"
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome == "ok" and first is not None:
            ttfts.append(first)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        started = time.perf_counter()
        due = started
        while due - started < args.duration:
            due += rng.expovariate(rate)
            with contextlib.suppress(ValueError):
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            text = rng.choices(texts, weights)[0]
            tasks.append(asyncio.ensure_future(one(session, text)))
        await asyncio.gather(*tasks)
    sent = sum(outcomes.values())
    return {
        "offered_rps": sent / args.duration,
        "capacity_rps": capacity,
        "requests": sent,
        "outcomes": outcomes,
        "success_rate": outcomes.get("ok", 0) / sent,
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1000 if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000 if ttfts else None,
    }


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as workdir:
        cluster = Cluster(workdir, args)
        try:
            try:
                cluster.start()
            except Exception as exc:
                print(f"setup failed: {exc}\n{json.dumps(cluster.logs(), indent=1)}")
                sys.exit(2)
            runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
            for i in range(args.rounds):
                order = POLICIES if i % 2 == 0 else POLICIES[::-1]
                for policy in order:
                    proc, port = cluster.router(policy)
                    try:
                        run = asyncio.run(offer(port, args, seed=i))
                        run["cache_hit_rate"] = cluster.hit_rate()
                        runs[policy].append(run)
                    finally:
                        proc.terminate()
                        proc.wait(20)
        finally:
            cluster.close()
    result: dict = {
        "stub": "replicas are stubs with fixed service times, not llama-server",
        "replicas": args.replicas,
        "slots": args.slots,
        "duration_s": args.duration,
        "queue_timeout_s": args.queue_timeout,
        "conversations": args.conversations,
        "runs": runs,
    }
    for policy, policy_runs in runs.items():
        result[f"{policy}_success_rate"] = statistics.fmean(r["success_rate"] for r in policy_runs)
        result[f"{policy}_ttft_p99_ms"] = statistics.fmean(
            r["ttft_p99_ms"] or float("inf") for r in policy_runs
        )
        result[f"{policy}_ttft_p50_ms"] = statistics.fmean(
            r["ttft_p50_ms"] or float("inf") for r in policy_runs
        )
    lor, pre = "least-outstanding", "prefix"
    result["met"] = {
        "success_rate": result[f"{pre}_success_rate"]
        >= result[f"{lor}_success_rate"] - SUCCESS_SLACK,
        "ttft_p99": result[f"{pre}_ttft_p99_ms"] <= result[f"{lor}_ttft_p99_ms"] * TTFT_SLACK,
    }
    return result


def print_table(r: dict) -> None:
    print(f"{'policy':<18} {'success':>8} {'TTFT p50':>10} {'TTFT p99':>10}  runs")
    for policy in POLICIES:
        runs = r["runs"][policy]
        print(
            f"{policy:<18} {r[f'{policy}_success_rate'] * 100:>7.1f}% "
            f"{r[f'{policy}_ttft_p50_ms']:>7.0f} ms {r[f'{policy}_ttft_p99_ms']:>7.0f} ms  "
            + "; ".join(
                f"{x['success_rate'] * 100:.0f}% {x['ttft_p99_ms'] or 0:.0f} ms "
                f"hits {x['cache_hit_rate'] * 100:.0f}% {x['outcomes']}"
                for x in runs
            )
        )
    first = r["runs"][POLICIES[0]][0]
    print(
        f"(STUB replicas: {r['replicas']} x {r['slots']} slots, capacity "
        f"{first['capacity_rps']:.0f} req/s, offered {first['offered_rps']:.0f} req/s for "
        f"{r['duration_s']:g} s; queue timeout {r['queue_timeout_s']:g} s; "
        f"{r['conversations']} conversations, Zipf; met: {r['met']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--miss-ms", type=float, default=200.0)
    parser.add_argument("--hit-ms", type=float, default=40.0)
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--token-ms", type=float, default=10.0)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--queue-timeout", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--serve-replicas", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_replicas:
        serve_replicas([int(p) for p in args.serve_replicas.split(",")], args)
        return
    exit_on_sigterm()
    report(measure(args), args.output, print_table)


if __name__ == "__main__":
    main()
