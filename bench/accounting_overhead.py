"""What token accounting adds to the router's hot path: accounting on against off.

Starts, all on 127.0.0.1 and all stopped at exit: a Consul dev agent, a stub
upstream in its own process (a raw asyncio HTTP/1.1 server answering a
non-streaming completion with a fixed body that carries ``usage``, and a
streaming one with ``--tokens`` events, chunked, one chunk per event, the last
with llama-server's ``timings``), and two routers on the same Consul and stub:
one with ``LLMGW_ROUTER_ACCOUNTING=false``, one with it on (the default).

Then, side by side in one run, alternating requests (on, off, on, off...) on
one keep-alive connection each, so a burst of load from elsewhere hits both
alike:

1. ``--requests`` non-streaming completions to each: p50 / p99 latency;
2. ``--requests`` streaming completions to each (time to the last byte);
3. each router's CPU seconds per request over all of it, the figure the
   machine's other load bends least.

Usage::

    python bench/accounting_overhead.py [--requests 2000] [--tokens 32] [--output json]

Exit codes: 0 done (no targets: the figures are reported), 2 setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from typing import ClassVar

from _support import Children, cpu_seconds, define_model, free_port, http, percentile, wait_for

MODEL = "bench"
USAGE = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
WHOLE = json.dumps(
    {"id": "cmpl-bench", "object": "text_completion", "model": MODEL,
     "choices": [{"index": 0, "text": " world", "finish_reason": "length"}], "usage": USAGE}
).encode()  # fmt: skip
PLAIN = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
STREAM = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1, "stream": True}).encode()


def sse_events(tokens: int) -> list[bytes]:
    """A llama-server-shaped completion stream of ``tokens`` tokens."""
    out = []
    for i in range(tokens):
        doc = {"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}],
               "object": "text_completion", "model": MODEL, "id": "cmpl-bench"}  # fmt: skip
        out.append(b"data: " + json.dumps(doc).encode() + b"\n\n")
    last = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
            "timings": {"cache_n": 0, "prompt_n": 2, "predicted_n": tokens}}  # fmt: skip
    out.append(b"data: " + json.dumps(last).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


class _Stub(asyncio.Protocol):
    whole = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(WHOLE)).encode() + b"\r\n\r\n" + WHOLE
    )  # fmt: skip
    stream_head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    events: ClassVar[list[bytes]] = []

    def connection_made(self, transport):
        self.transport = transport
        self.buffer = b""

    def data_received(self, data):
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            body, self.buffer = self.buffer[end + 4 : total], self.buffer[total:]
            if b'"stream": true' not in body:
                self.transport.write(self.whole)
                continue
            self.transport.write(self.stream_head)
            for event in self.events:
                self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.transport.write(b"0\r\n\r\n")


def serve_stub(port: int, tokens: int) -> None:
    _Stub.events = sse_events(tokens)
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(_Stub, "127.0.0.1", port, backlog=1024))
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    with contextlib.suppress(KeyboardInterrupt):
        loop.run_forever()
    server.close()


async def timed(session, url: str, body: bytes) -> float:
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        data = await r.read()
        if r.status != 200 or not data:
            raise RuntimeError(f"HTTP {r.status}")
    return time.perf_counter() - started


async def side_by_side(ports: dict[str, int], body: bytes, requests: int) -> dict[str, list]:
    import aiohttp

    sessions = {
        name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for name in ports
    }
    urls = {name: f"http://127.0.0.1:{port}/v1/completions" for name, port in ports.items()}
    times: dict[str, list[float]] = {name: [] for name in ports}
    try:
        for _ in range(100):  # warm pools and caches
            for name in ports:
                await timed(sessions[name], urls[name], body)
        for i in range(requests):
            order = list(ports) if i % 2 == 0 else list(reversed(ports))
            for name in order:
                times[name].append(await timed(sessions[name], urls[name], body))
    finally:
        for session in sessions.values():
            await session.close()
    return times


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-acct-") as workdir:
        children = Children(workdir)
        try:
            stub = free_port()
            children.spawn(
                [sys.executable, __file__, "--serve-stub", str(stub), "--tokens", str(args.tokens)],
                "stub",
            )
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
            ports = {"on": free_port(), "off": free_port()}
            procs = {}
            for name, port in ports.items():
                os.environ["LLMGW_ROUTER_ACCOUNTING"] = "true" if name == "on" else "false"
                procs[name] = children.router_process(port, consul_port)
            for port in ports.values():
                url = f"http://127.0.0.1:{port}/v1/completions"
                wait_for(lambda url=url: http("POST", url, PLAIN) == WHOLE, 30, "router")
            cpu = {name: cpu_seconds(p.pid) for name, p in procs.items()}
            result: dict = {"cpus": os.cpu_count(), "requests_each": args.requests,
                            "tokens_per_stream": args.tokens}  # fmt: skip
            for kind, body in (("whole", PLAIN), ("stream", STREAM)):
                times = asyncio.run(side_by_side(ports, body, args.requests))
                for name, values in times.items():
                    result[f"{kind}_{name}_p50_ms"] = percentile(values, 0.5) * 1000
                    result[f"{kind}_{name}_p99_ms"] = percentile(values, 0.99) * 1000
                for q in ("p50", "p99"):
                    result[f"{kind}_{q}_added_ms"] = (
                        result[f"{kind}_on_{q}_ms"] - result[f"{kind}_off_{q}_ms"]
                    )
            for name, proc in procs.items():
                spent = cpu_seconds(proc.pid) - cpu[name]
                result[f"{name}_cpu_us_per_request"] = spent / (2 * (args.requests + 100)) * 1e6
            metrics = http("GET", f"http://127.0.0.1:{ports['on']}/metrics").decode()
            result["on_counted"] = [
                line
                for line in metrics.splitlines()
                if line.startswith("llmgw_router_tokens_total")
            ]
        except Exception as exc:
            raise SystemExit(f"failed: {exc}\n{json.dumps(children.logs(), indent=1)}") from exc
        finally:
            children.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--serve-stub", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        serve_stub(args.serve_stub, args.tokens)
        return
    result = measure(args)
    if args.output == "json":
        print(json.dumps(result, indent=2))
        return
    for kind in ("whole", "stream"):
        print(
            f"{kind:>6}: p50 on {result[f'{kind}_on_p50_ms']:.3f} ms / off "
            f"{result[f'{kind}_off_p50_ms']:.3f} ms (added {result[f'{kind}_p50_added_ms']:+.3f}); "
            f"p99 on {result[f'{kind}_on_p99_ms']:.3f} / off {result[f'{kind}_off_p99_ms']:.3f} ms "
            f"(added {result[f'{kind}_p99_added_ms']:+.3f})"
        )
    print(
        f"router CPU per request: on {result['on_cpu_us_per_request']:.0f} us, "
        f"off {result['off_cpu_us_per_request']:.0f} us ({result['cpus']} CPUs shared)"
    )
    print("\n".join(result["on_counted"]))


if __name__ == "__main__":
    main()
