"""Measure the router's memory under many slow, large uploads (issue 18, item 3).

Starts, all on 127.0.0.1 and all stopped at exit: a Consul dev agent, a stub
replica (a raw asyncio server in this process that reads each body and drops it
as it comes, then answers a small JSON), and the router (``python -m router
serve``) with its default bounds unless told: bodies held at once
(``--max-bodies-bytes``; 0: the router's default, a quarter of the memory, at
most 1 GiB).

Then ``--clients`` (200) clients each upload ``--body-mib`` (50) MiB bodies at
``--rate-mib`` (2) MiB/s, half announcing a Content-Length, half chunked
(``--mode``: ``mixed``; ``chunked`` or ``announced`` for all), for
``--duration`` (40) seconds: a client refused (503 ``router_overloaded``, or its
connection closed mid-body) waits the Retry-After and tries again, so the
router is pressed at its bound the whole time. It reports the router's RSS
before the load, its peak (``VmHWM``), its RSS once the load is over and no body
is held (idle), the bound, uploads completed and refused, and whether peak RSS
<= bound + ``--overhead-mib`` (the fixed part: the interpreter, the app, the
connections' buffers).

Usage::

    python bench/slow_uploads.py [--clients 200] [--body-mib 50] [--rate-mib 2]
                                 [--duration 40] [--max-bodies-bytes 0]
                                 [--overhead-mib 200] [--mode mixed|chunked|announced]
                                 [--output json]

Exit codes: 0 the target met, 1 missed, 2 setup failed. Stops by itself after
``--duration`` seconds (plus at most 30 s to let the uploads in flight end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _support import (
    REPO,
    Children,
    consul_binary,
    define_model,
    exit_on_sigterm,
    free_port,
    http,
    report,
    wait_for,
)

MODEL = "uploads"
CHUNK = 256 * 1024
ANSWER = b'{"object": "text_completion", "choices": []}'


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field}")


# --- the stub replica -------------------------------------------------------------


async def stub(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read each request's Content-Length body, drop it, answer 200."""
    try:
        while line := await reader.readline():
            del line
            length = 0
            while (header := await reader.readline()) not in (b"\r\n", b""):
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":", 1)[1])
            while length:
                chunk = await reader.read(min(length, 1 << 20))
                if not chunk:
                    return
                length -= len(chunk)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
            )
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


# --- the clients --------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.completed = 0
        self.refused_503 = 0
        self.cut = 0  # connection closed mid-body (a chunked body refused past the bound)
        self.other: dict[str, int] = {}


async def upload(port: int, body_bytes: int, rate: float, chunked: bool, tally: Tally) -> float:
    """One upload; returns the seconds to wait before the next (Retry-After, else 0)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = [
        b"POST /v1/completions HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Content-Type: application/json",
        b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % body_bytes,
    ]
    start = b'{"model": "%s", "prompt": "' % MODEL.encode()
    end = b'"}'
    filler = b"x" * CHUNK
    answer: asyncio.Future[bytes] | None = None
    try:
        writer.write(b"\r\n".join(head) + b"\r\n\r\n")
        sent = 0
        began = time.monotonic()
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        while sent < body_bytes and not answer.done():
            piece = min(CHUNK, body_bytes - sent)
            data = (
                start + filler[: piece - len(start)]
                if sent == 0
                else filler[: piece - len(end)] + end
                if sent + piece == body_bytes
                else filler[:piece]
            )
            writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            await writer.drain()
            sent += piece
            # Paced: this client's upload runs at `rate` bytes/s.
            ahead = began + sent / rate - time.monotonic()
            if ahead > 0:
                await asyncio.wait([answer], timeout=ahead)
        if chunked and not answer.done():
            writer.write(b"0\r\n\r\n")
        headers = (await asyncio.wait_for(answer, 60)).decode("latin-1").lower()
    except (ConnectionError, asyncio.IncompleteReadError):
        tally.cut += 1
        return 1.0
    finally:
        if answer is not None:
            answer.cancel()
        writer.close()
    status = int(headers.split(" ", 2)[1])
    if status == 200:
        tally.completed += 1
        return 0.0
    if status == 503:
        tally.refused_503 += 1
        for line in headers.split("\r\n"):
            if line.startswith("retry-after:"):
                return float(line.split(":", 1)[1])
        return 1.0
    tally.other[str(status)] = tally.other.get(str(status), 0) + 1
    return 1.0


async def client(
    port: int, args: argparse.Namespace, chunked: bool, stop_at: float, tally: Tally
) -> None:
    while time.monotonic() < stop_at:
        try:
            pause = await upload(
                port, args.body_mib << 20, args.rate_mib * (1 << 20), chunked, tally
            )
        except (TimeoutError, OSError) as exc:
            tally.other[type(exc).__name__] = tally.other.get(type(exc).__name__, 0) + 1
            pause = 1.0
        await asyncio.sleep(pause)


async def load(
    router: subprocess.Popen, port: int, stub_port: int, args: argparse.Namespace
) -> dict:
    tally = Tally()
    peak_rss = 0
    stop_at = time.monotonic() + args.duration
    server = await asyncio.start_server(stub, "127.0.0.1", stub_port)
    chunked = {
        "mixed": lambda i: i % 2 == 1,
        "chunked": lambda i: True,
        "announced": lambda i: False,
    }[args.mode]
    clients = [
        asyncio.ensure_future(client(port, args, chunked(i), stop_at, tally))
        for i in range(args.clients)
    ]
    try:
        while time.monotonic() < stop_at:
            peak_rss = max(peak_rss, status_kib(router.pid, "VmRSS"))
            await asyncio.sleep(0.2)
        await asyncio.wait(clients, timeout=30)
    finally:
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        server.close()
    return {
        "completed": tally.completed,
        "refused_503": tally.refused_503,
        "cut_mid_body": tally.cut,
        "other": tally.other,
        "sampled_peak_rss_mib": peak_rss / 1024,
    }


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as workdir:
        children = Children(workdir)
        try:
            consul_port, stub_port, port = free_port(), free_port(), free_port()
            consul_binary()
            consul = children.consul(consul_port)
            service = {
                "ID": "llmgw-uploads-1",
                "Name": f"llmgw-{MODEL}",
                "Address": "127.0.0.1",
                "Port": stub_port,
                "Meta": {"llmgw_model": MODEL, "llmgw_definition_hash": "bench"},
                "Check": {"CheckID": "uploads-ttl", "TTL": "1h", "Status": "passing"},
            }
            http("PUT", f"{consul}/v1/agent/service/register", json.dumps(service).encode())
            define_model(consul, MODEL)
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "LLMGW_REPLICA_CONCURRENCY": "1024",
                "LLMGW_ACTIVATION": "0",
            }
            router = children.spawn(
                [sys.executable, "-m", "router", "serve", "--port", str(port),
                 "--consul-addr", f"127.0.0.1:{consul_port}", "--log-level", "warning",
                 "--max-bodies-bytes", str(args.max_bodies_bytes)],
                "router", cwd=REPO, env=env,
            )  # fmt: skip
            metrics = f"http://127.0.0.1:{port}/metrics"
            wait_for(
                lambda: b'llmgw_router_endpoints{model="uploads"} 1.0' in http("GET", metrics),
                30,
                "router to see the stub",
            )
        except Exception as exc:
            children.close()
            print(f"setup failed: {exc}\n{json.dumps(children.logs(), indent=1)}", file=sys.stderr)
            sys.exit(2)
        try:
            limit = next(
                float(line.split()[1])
                for line in http("GET", metrics).decode().splitlines()
                if line.startswith("llmgw_router_request_body_limit_bytes ")
            )
            before = status_kib(router.pid, "VmRSS") / 1024
            result = asyncio.run(load(router, port, stub_port, args))
            result["peak_rss_mib"] = status_kib(router.pid, "VmHWM") / 1024
            wait_for(
                lambda: b"llmgw_router_request_body_bytes 0.0" in http("GET", metrics),
                30,
                "the router to let every body go",
            )
            http("GET", metrics)  # one more request: the last one's frees are done
            result["idle_rss_mib"] = status_kib(router.pid, "VmRSS") / 1024
        finally:
            children.close()
    result.update(
        {
            "clients": args.clients,
            "body_mib": args.body_mib,
            "rate_mib_s": args.rate_mib,
            "duration_s": args.duration,
            "bound_mib": limit / (1 << 20),
            "mode": args.mode,
            "rss_before_mib": before,
            "overhead_mib": args.overhead_mib,
        }
    )
    result["met"] = {
        "peak_rss": result["peak_rss_mib"] <= result["bound_mib"] + args.overhead_mib,
        "some_completed": result["completed"] > 0,
    }
    return result


def print_table(r: dict) -> None:
    print(
        f"{r['clients']} clients x {r['body_mib']} MiB at {r['rate_mib_s']} MiB/s each, "
        f"{r['duration_s']:g} s ({r['mode']})"
    )
    print(f"bodies held at once, bound   {r['bound_mib']:10.1f} MiB")
    print(f"router RSS before the load   {r['rss_before_mib']:10.1f} MiB")
    print(
        f"router peak RSS (VmHWM)      {r['peak_rss_mib']:10.1f} MiB   target <= bound + "
        f"{r['overhead_mib']} MiB: {'yes' if r['met']['peak_rss'] else 'NO'}"
    )
    print(f"router RSS idle after        {r['idle_rss_mib']:10.1f} MiB")
    print(
        f"uploads completed {r['completed']}, refused 503 {r['refused_503']}, "
        f"cut mid-body {r['cut_mid_body']}, other {r['other']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--body-mib", type=int, default=50)
    parser.add_argument("--rate-mib", type=float, default=2.0, help="MiB/s per client")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--max-bodies-bytes", type=int, default=0)
    parser.add_argument("--overhead-mib", type=int, default=200)
    parser.add_argument(
        "--mode",
        choices=("mixed", "chunked", "announced"),
        default="mixed",
        help="which uploads announce a Content-Length",
    )
    parser.add_argument("--output", choices=("table", "json"), default="table")
    args = parser.parse_args()
    exit_on_sigterm()
    report(measure(args), args.output, print_table)


if __name__ == "__main__":
    main()
