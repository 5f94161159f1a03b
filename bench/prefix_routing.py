"""Measure cache-aware routing: prompt tokens llama-server reuses, and time to first token.

Starts, all on 127.0.0.1 and all stopped at exit (SIGTERM and Ctrl-C included):

- a Consul dev agent, and 2 real llama-server replicas of a small random-weight
  model (tests/support/tiny_gguf.py, ``--width`` 256 x ``--layers`` 4, byte
  tokens: a 1,000-character conversation is 1,000 tokens to process), each
  with 4 slots of 4,096 tokens and its own prompt cache (``cache_prompt`` is on by default),
  registered as ``llmgw-prefix-bench`` with an HTTP check on ``/health``;
- for each run, fresh replicas (empty caches) and a router
  (``LLMGW_ROUTING=least-outstanding`` or ``prefix``; activation off; each
  replica's limit from its ``/props``); ``--rounds`` (2) runs per strategy, in
  the order A B, B A, ... so the machine's drifting load falls on both alike.

The workload, once per run: ``--conversations`` (8: as many as the two
replicas have slots) chats at once, each ``--turns`` (6) turns long, each
turn resending the whole conversation (a short system prompt shared by all,
the chat's own first message of ``--document-words`` (120) words, a document
to talk about, then every turn so far) with ``stream: true``. Each run gets
its own texts, so nothing a previous run cached helps it.

Per strategy it reports the prompt tokens sent, those llama-server took from
its cache (``timings.cache_n`` of the last chunk, the figure behind
``usage.prompt_tokens_details.cached_tokens``), and the mean and p50 time to
the first streamed token, over every turn and over turns 2 and later (the
ones a cache can serve).

Usage::

    python bench/prefix_routing.py [--conversations 8] [--turns 6] [--rounds 2]
                                   [--output json]

Exit codes: 0 prefix routing cached more tokens and had a lower mean time to
first token than least-outstanding, 1 it did not, 2 setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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

sys.path.insert(0, str(REPO))

from devcluster.bootstrap import BIN

MODEL = "prefix-bench"
STRATEGIES = ("least-outstanding", "prefix")
WORDS = (
    "cache",
    "replica",
    "token",
    "prefix",
    "router",
    "model",
    "slot",
    "prompt",
    "server",
    "nomad",
    "consul",
    "health",
    "stream",
    "answer",
    "question",
    "turn",
)


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + ". "


class Run:
    """One strategy's run: two fresh llama-servers of the model (empty caches),
    registered in Consul with an HTTP check, and a router; :meth:`stop` ends them."""

    def __init__(self, children: Children, consul: str, model: Path, name: str) -> None:
        self.consul = consul
        self.ports = [free_port(), free_port()]
        self.ids = [f"{name}-{i}" for i in range(2)]
        self.procs: list[subprocess.Popen] = [
            children.spawn(
                [
                    str(BIN / "llama-server"),
                    "-m",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "-c",
                    "16384",
                    "--parallel",
                    "4",
                    "--threads",
                    "1",
                    # requests_processing / requests_deferred: in flight, sampled.
                    "--metrics",
                ],
                f"llama-server-{service_id}",
            )
            for port, service_id in zip(self.ports, self.ids, strict=True)
        ]
        for port, service_id in zip(self.ports, self.ids, strict=True):
            wait_for(
                lambda p=port: http("GET", f"http://127.0.0.1:{p}/health") != b"",
                60,
                f"llama-server {service_id}",
            )
            service = {
                "ID": service_id,
                "Name": f"llmgw-{MODEL}",
                "Address": "127.0.0.1",
                "Port": port,
                "Check": {"HTTP": f"http://127.0.0.1:{port}/health", "Interval": "1s"},
            }
            http("PUT", f"{consul}/v1/agent/service/register", json.dumps(service).encode())
        define_model(consul, MODEL)

    def stop(self) -> None:
        for service_id in self.ids:
            http("PUT", f"{self.consul}/v1/agent/service/deregister/{service_id}")
        for proc in self.procs:
            proc.terminate()
            proc.wait(10)


def start_router(
    children: Children,
    consul_port: int,
    strategy: str,
    name: str,
    load_interval: float | None = None,
) -> tuple[str, subprocess.Popen]:
    """A router reading the replicas' load every `load_interval` seconds
    (LLMGW_ROUTER_SHARED_LOAD_INTERVAL; None: the router's default; 0: balancing on
    its own requests only, as before router.replicaload)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLMGW_ACTIVATION": "0",
        "LLMGW_ROUTING": strategy,
    }
    if load_interval is not None:
        env["LLMGW_ROUTER_SHARED_LOAD_INTERVAL"] = f"{load_interval:g}"
    proc = children.spawn(
        [
            sys.executable,
            "-m",
            "router",
            "serve",
            "--port",
            str(port),
            "--consul-addr",
            f"127.0.0.1:{consul_port}",
            "--log-level",
            "warning",
        ],
        f"router-{name}",
        cwd=REPO,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"

    def routes() -> bool:
        health = json.loads(http("GET", f"{url}/health"))
        return health["models_with_endpoints"] == 1

    wait_for(routes, 60, f"the {strategy} router to see both replicas")
    # Let /props raise each replica's limit to its slot count (read once it joins).
    time.sleep(1.0)
    return url, proc


async def turn(session: aiohttp.ClientSession, url: str | RoundRobin, messages: list[dict]) -> dict:
    """One streamed chat turn: time to first token, the reply, prompt and cached tokens."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 16,
        "stream": True,
        "temperature": 0,
    }
    started = time.perf_counter()
    first: float | None = None
    text, timings = [], {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter() - started
                    text.append(content)
            timings = chunk.get("timings") or timings
    if not timings:
        raise RuntimeError("no timings in the stream's last chunk")
    cached = timings.get("cache_n", 0)
    return {
        "ttft_s": first if first is not None else time.perf_counter() - started,
        "reply": "".join(text) or "ok",
        "prompt_tokens": timings["prompt_n"] + cached,
        "cached_tokens": cached,
    }


async def conversation(
    session: aiohttp.ClientSession,
    url: str | RoundRobin,
    system: str,
    index: int,
    turns: int,
    document_words: int,
    rng: random.Random,
) -> list[dict]:
    messages = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": f"Conversation {index}. About this document: "
            + sentence(rng, document_words),
        },
    ]
    results = []
    for n in range(turns):
        result = await turn(session, url, messages)
        result["turn"] = n + 1
        results.append(result)
        messages += [
            {"role": "assistant", "content": result["reply"]},
            {"role": "user", "content": sentence(rng, 12)},
        ]
        await asyncio.sleep(rng.uniform(0.0, 0.2))  # a person reads, then types
    return results


class RoundRobin:
    """The front of several routers: each request to the next one, in turn (a load
    balancer with no affinity, as one in front of the router job's instances)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.sent = 0

    def __str__(self) -> str:
        url = self.urls[self.sent % len(self.urls)]
        self.sent += 1
        return url


def inflight_of(text: str) -> float:
    """Requests a llama-server holds (processing and deferred), from its /metrics."""
    total = 0.0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("llamacpp:requests_processing", "llamacpp:requests_deferred"):
            total += float(value)
    return total


async def sample_inflight(ports: list[int], samples: list[list[float]], every_s: float) -> None:
    """Append each replica's requests in flight to ``samples`` every ``every_s`` s."""
    async with aiohttp.ClientSession() as session:
        while True:
            row = []
            for port in ports:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    row.append(inflight_of(await resp.text()))
            samples.append(row)
            await asyncio.sleep(every_s)


def balance(samples: list[list[float]]) -> dict:
    """How evenly one run's replicas carried the requests in flight (processing and
    deferred in llama-server, sampled every 0.1 s): the busiest one's share of the
    mean in flight (0.5 is even on 2 replicas) and the mean, over samples with any in
    flight, of |a - b| / (a + b)."""
    busy = [row for row in samples if sum(row) > 0]
    if not busy:
        return {"busiest_share": 0.0, "imbalance": 0.0, "samples": 0, "mean_inflight": 0.0}
    means = [statistics.fmean(column) for column in zip(*busy, strict=True)]
    return {
        "busiest_share": max(means) / sum(means),
        "imbalance": statistics.fmean((max(r) - min(r)) / sum(r) for r in busy),
        "samples": len(busy),
        "mean_inflight": sum(means),
    }


async def workload(
    url: str | RoundRobin, args: argparse.Namespace, seed: int, ports: list[int] | None = None
) -> tuple[list[dict], list[list[float]]]:
    """Every conversation's turns (each to ``str(url)``: a round-robin front picks
    its router per request), and the replicas' in-flight samples when ``ports``."""
    samples: list[list[float]] = []
    sampler = asyncio.ensure_future(sample_inflight(ports, samples, 0.1)) if ports else None
    try:
        return await _conversations(url, args, seed), samples
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)


async def _conversations(url: str | RoundRobin, args: argparse.Namespace, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = f"Run {seed}. You answer questions about documents. " + sentence(rng, 12)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        runs = await asyncio.gather(
            *(
                conversation(
                    session,
                    url,
                    system,
                    i,
                    args.turns,
                    args.document_words,
                    random.Random(seed * 1000 + i),
                )
                for i in range(args.conversations)
            )
        )
    return [r for run in runs for r in run]


def summarize(results: list[dict]) -> dict:
    later = [r for r in results if r["turn"] > 1]
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    return {
        "turns": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in results),
        "ttft_p50_s": percentile([r["ttft_s"] for r in results], 0.5),
        "later_turns_ttft_mean_s": statistics.fmean(r["ttft_s"] for r in later),
        "later_turns_cached_fraction": sum(r["cached_tokens"] for r in later)
        / max(1, sum(r["prompt_tokens"] for r in later)),
    }


Variant = tuple[str, int, float | None]
"""(routing strategy, routers behind the round-robin front, how often each reads the
replicas' load in seconds: None the router's default; `--routers 3:own` is 3 routers
each on its own load (0), `--routers 2:0.1` 2 routers reading it every 0.1 s)."""


def variants(args: argparse.Namespace) -> list[Variant]:
    if args.routers:
        chosen: list[Variant] = []
        for item in args.routers.split(","):
            count, _, interval = item.strip().partition(":")
            try:
                routers = int(count)
                load = None if not interval else 0.0 if interval == "own" else float(interval)
            except ValueError:
                routers, load = 0, None
            if routers < 1 or (load is not None and not (math.isfinite(load) and load >= 0)):
                raise SystemExit(
                    f"--routers: {item!r} is not COUNT, COUNT:own or COUNT:SECONDS "
                    "(a count of 1 or more; seconds finite and >= 0)"
                )
            chosen.append((args.strategy, routers, load))
        return chosen
    return [(strategy, 1, None) for strategy in STRATEGIES]


def _load_tag(load: float | None) -> str:
    return "" if load is None else "own" if load == 0 else f"{load:g}s"


def label(variant: Variant, args: argparse.Namespace) -> str:
    strategy, routers, load = variant
    if not args.routers:
        return strategy
    tag = _load_tag(load)
    return f"{strategy} x{routers}" + (
        "" if not tag else " own load" if load == 0 else f" load {tag}"
    )


def run_variant(
    children: Children, consul: str, consul_port: int, model: Path, variant: Variant, seed: int
) -> tuple[str, list[str], list[subprocess.Popen], Run]:
    strategy, routers, load = variant
    tag = _load_tag(load)
    name = f"{strategy}-{routers}r{'-' + tag if tag else ''}-{seed}"
    run = Run(children, consul, model, name)
    started = [
        start_router(children, consul_port, strategy, f"{name}-{i}", load) for i in range(routers)
    ]
    return name, [url for url, _ in started], [proc for _, proc in started], run


def measure(args: argparse.Namespace) -> dict:
    from tests.support.tiny_gguf import write_tiny_gguf

    chosen = variants(args)
    with tempfile.TemporaryDirectory(prefix="llmgw-prefix-bench-") as workdir:
        children = Children(workdir)
        try:
            try:
                consul_port = free_port()
                consul = children.consul(consul_port)
                model = write_tiny_gguf(
                    Path(workdir) / "model.gguf", width=args.width, layers=args.layers
                )
            except Exception as exc:
                print(f"setup failed: {exc}", file=sys.stderr)
                print(json.dumps(children.logs(), indent=1), file=sys.stderr)
                sys.exit(2)
            result: dict = {
                "conversations": args.conversations,
                "turns": args.turns,
                "rounds": args.rounds,
                "model": f"tiny {args.width}x{args.layers}",
                "replicas": 2,
                "slots_per_replica": 4,
                "cpus": os.cpu_count(),
                "columns": [label(v, args) for v in chosen],
            }
            results: dict[Variant, list[dict]] = {v: [] for v in chosen}
            # Per run: its replicas are its own, so balance is judged run by run.
            balances: dict[Variant, list[dict]] = {v: [] for v in chosen}
            # A B B A ...: the machine's load drifts, and each order gets it alike.
            schedule = [chosen[::-1] if r % 2 else chosen for r in range(args.rounds)]
            seed = 0
            for order in schedule:
                for variant in order:
                    seed += 1
                    name, urls, routers, run = run_variant(
                        children, consul, consul_port, model, variant, seed
                    )
                    front: str | RoundRobin = urls[0] if len(urls) == 1 else RoundRobin(urls)
                    try:
                        turns, seen = asyncio.run(workload(front, args, seed, run.ports))
                    except Exception:
                        print(json.dumps(children.logs(), indent=1), file=sys.stderr)
                        raise
                    results[variant] += turns
                    balances[variant].append(balance(seen))
                    for router in routers:
                        router.terminate()
                        router.wait(10)
                    run.stop()
                    print(f"{name}: {summarize(turns)} {balance(seen)}", file=sys.stderr)
            for variant in chosen:
                runs = balances[variant]
                result[label(variant, args)] = {
                    **summarize(results[variant]),
                    **{k: statistics.fmean(b[k] for b in runs) for k in runs[0]},
                    "busiest_share_runs": [b["busiest_share"] for b in runs],
                }
        finally:
            children.close()
    result["met"] = targets_met(result, chosen, args)
    return result


def targets_met(result: dict, chosen: list[Variant], args: argparse.Namespace) -> dict:
    """Default: prefix routing cached more and answered sooner than least-outstanding.
    With ``--routers``: each count's cached fraction and busiest replica's share of
    the requests in flight within 10 % of one router's (issue 21)."""
    if not args.routers:
        lo, px = result["least-outstanding"], result["prefix"]
        return {
            "more_cached": px["cached_tokens"] > lo["cached_tokens"],
            "lower_ttft": px["ttft_mean_s"] < lo["ttft_mean_s"],
        }
    # The reference: one router at the default interval when it ran, else the first single.
    ones = sorted((v for v in chosen if v[1] == 1), key=lambda v: v[2] is not None)
    met: dict = {}
    if not ones:
        return met
    one = result[label(ones[0], args)]
    for variant in chosen:
        if variant[1] == 1:
            continue
        r = result[label(variant, args)]
        tag = f"x{variant[1]}" + (f"_{_load_tag(variant[2])}" if variant[2] is not None else "")
        met[f"cached_{tag}"] = r["cached_fraction"] >= one["cached_fraction"] * 0.9
        met[f"balance_{tag}"] = r["busiest_share"] <= one["busiest_share"] * 1.1
    return met


def print_table(r: dict) -> None:
    print(
        f"{r['conversations']} chats x {r['turns']} turns, {r['rounds']} rounds per "
        f"column, 2 replicas of {r['model']} ({r['slots_per_replica']} slots each), "
        f"{r['cpus']} CPUs"
    )
    columns = r["columns"]
    width = max(20, *(len(c) + 2 for c in columns))
    print(f"{'':<48}" + "".join(f"{c:>{width}}" for c in columns))
    rows = [
        ("prompt tokens", "prompt_tokens", "{:,}"),
        ("cached prompt tokens", "cached_tokens", "{:,}"),
        ("cached fraction", "cached_fraction", "{:.0%}"),
        ("cached fraction, turns 2+", "later_turns_cached_fraction", "{:.0%}"),
        ("time to first token, mean (s)", "ttft_mean_s", "{:.3f}"),
        ("time to first token, p50 (s)", "ttft_p50_s", "{:.3f}"),
        ("time to first token, turns 2+ (s)", "later_turns_ttft_mean_s", "{:.3f}"),
        ("in flight on the busiest replica (mean of runs)", "busiest_share", "{:.0%}"),
        ("in-flight imbalance |a-b|/(a+b)", "imbalance", "{:.0%}"),
        ("mean requests in flight", "mean_inflight", "{:.2f}"),
    ]
    for text, key, fmt in rows:
        print(f"{text:<48}" + "".join(f"{fmt.format(r[c][key]):>{width}}" for c in columns))
    print(
        "busiest replica's share, each run: "
        + "; ".join(
            f"{c} " + ", ".join(f"{x:.0%}" for x in r[c]["busiest_share_runs"]) for c in columns
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument(
        "--document-words",
        type=int,
        default=120,
        help="length of each chat's first message (its own context)",
    )
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each strategy, alternating (A B, then B A, ...)",
    )
    parser.add_argument(
        "--routers",
        default="",
        help="router counts behind a round-robin front, e.g. 1,2,3 (each with "
        "--strategy); 3:own: 3 routers balancing on their own load only; 2:0.1: 2 routers "
        "reading the replicas' load every 0.1 s (default: the router's); side by side",
    )
    parser.add_argument("--strategy", choices=STRATEGIES, default="prefix")
    parser.add_argument("--width", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="model layers")
    parser.add_argument("--output", choices=("table", "json"), default="table")
    args = parser.parse_args()
    exit_on_sigterm()
    result = measure(args)
    report(result, args.output, print_table)


if __name__ == "__main__":
    main()
