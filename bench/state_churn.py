"""Measure what state churn costs requests: p99 at 16 connections, quiet vs while
1,000 models change state every second (issue 21, item 4).

Starts, all on 127.0.0.1 and all stopped at exit (bench/_support.py):

- a Consul dev agent, holding 1,000 model records and 1,000 state documents of
  about 12 KiB each (a 15-16 MiB answer to a read of ``llmgw/state/``, the size
  issue 21 measured), written as the planner shapes them: failure keys, two
  replica records with long errors, one model in ten unplaceable; and beside
  each, in the same transaction, its routing document (``llmgw/routing/``, what
  the router reads), written as the planner writes it: only when the model
  becomes unplaceable, parked or neither (``llmgw_contract.routing_of``);
- the stub upstream of bench/router_overhead.py (imported, not copied), serving
  the model ``bench``, whose own state never changes;
- the router (``python -m router serve``);
- a control: a second Consul dev agent holding only the model ``bench``, and a
  second router reading it. It shares the machine, and so the writer's and
  Consul's CPU, with everything else, but has no state to read: what the churn
  costs it is the machine's contention alone, and the router's figure less the
  control's is what reading the churn costs the router itself.

Then, in ``--rounds`` rounds, quiet and churning in alternating order (so a burst
of load from elsewhere hits both alike): a churning phase runs a writer process
that rewrites every state document once a second (``/v1/txn``, 20 documents a
transaction, evenly spread; each rewrite moves a failure count, and one model in
ten turns unplaceable or placeable again, so the router's entries really change:
100 routing documents a second).
Each phase measures p99 at ``--connections`` direct to the stub, through the
router and through the control (the two routers' order turned each round; wrk, on
PATH or its Debian package, else Python; bench/router_overhead.py's generators);
added p99 = router p99 - direct p99 of the same phase; then the same at one
connection, back to back (a light client: less contention in the figure). Target: the churning added
p99 within 1 ms of the quiet one (median over the rounds). Beside it, the router's
own share: its churning-less-quiet added p99 less the control's, per round (median).

First, in this process (no other load in the figure), one read of the routing
answer by the router's state view, all documents new, none changed, all changed:
its work and the longest the event loop waited meanwhile, against one parse of
the whole state answer (what the router read before routing documents). Then,
with no request at all, the router's CPU share quiet and while churning: the
cost of the state watch alone, which the machine's other load does not bend.

Client, router, stub, Consul and the writer share the machine's cores: on a small
machine the churning figures include the writer's and Consul's CPU, which no change
in the router can remove (the direct figures show how much). Usage::

    python bench/state_churn.py [--models 1000] [--duration 8] [--rounds 3]
                                [--output json]

Exit codes: 0 target met, 1 missed, 2 setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import router_overhead
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
    report,
    wait_for,
)
from router_overhead import MODEL, REQUEST_BODY, STUB_BODY, rps_python, rps_wrk

sys.path.insert(0, str(REPO))  # llmgw_contract and router, imported where used

TARGET_MS = 1.0
TXN_DOCS = 20  # documents a transaction: Consul 1.8 takes 64 operations, 512 KiB
ERROR = ("llama_model_load: error loading model: " + "x" * 60 + " ") * 30


def state_document(i: int, generation: int) -> dict:
    """Model ``m<i>``'s state document as the planner writes it, at ``generation``."""
    alloc = f"{i:08d}-aaaa-bbbb-cccc-"
    replicas = [
        {
            "alloc_id": f"{alloc}{r:012d}", "name": f"m{i}.server[{r}]", "node": "node-1",
            "definition_hash": "h" * 16, "consecutive_failures": generation % 5,
            "last_error": ERROR, "last_error_at": "2026-12-02T03:00:00Z",
            "healthy_entries": list(range(1_700_000_000_000_000_000, 1_700_000_000_000_000_008)),
        }
        for r in range(2)
    ]  # fmt: skip
    unplaceable = i % 10 == 0 and generation % 2 == 0
    return {
        "name": f"m{i}",
        "definition_hash": "h" * 16,
        "consecutive_failures": generation % 5,
        "start_failures_total": generation,
        "last_error": ERROR,
        "counted": [f"{alloc}{k:012d}/server/2026-12-02T03:00:{k % 60:02d}Z" for k in range(40)],
        "replicas": replicas,
        "unplaceable": {"reason": "no room", "placed": 0, "desired": 1} if unplaceable else None,
    }


def routing_document(i: int, generation: int) -> dict:
    """Model ``m<i>``'s routing document at ``generation``, as the planner derives it."""
    from llmgw_contract import StateDocument, routing_of

    state = StateDocument.model_validate(state_document(i, generation))
    return routing_of(state).model_dump(mode="json")


def _b64json(document: dict) -> str:
    return base64.b64encode(json.dumps(document, separators=(",", ":")).encode()).decode()


def state_ops(models: range, generation: int, every_routing: bool = False) -> bytes:
    """The ``/v1/txn`` body that writes the state documents of ``models`` and, as the
    planner does, the routing documents of those whose routing part changes from the
    generation before (one in ten: unplaceable flips); ``every_routing``: all of them
    (the first write)."""
    ops = [
        {
            "KV": {
                "Verb": "set",
                "Key": f"llmgw/state/m{i}",
                "Value": _b64json(state_document(i, generation)),
            }
        }
        for i in models
    ]
    ops += [
        {"KV": {"Verb": "set", "Key": f"llmgw/routing/m{i}",
                "Value": _b64json(routing_document(i, generation))}}
        for i in models
        if every_routing or i % 10 == 0
    ]  # fmt: skip
    return json.dumps(ops).encode()


def txn(conn: HTTPConnection, body: bytes) -> None:
    conn.request("PUT", "/v1/txn", body)
    resp = conn.getresponse()
    answer = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"txn: HTTP {resp.status}: {answer[:200]!r}")


def churn(consul_port: int, models: int, counter: str) -> None:
    """Rewrite every state document once a second until SIGTERM; the documents
    written so far go to ``counter`` at each batch."""
    exit_on_sigterm()
    conn = HTTPConnection("127.0.0.1", consul_port, timeout=30)
    batches = [range(s, min(s + TXN_DOCS, models)) for s in range(0, models, TXN_DOCS)]
    # Two generations, alternating, encoded once: the writer's own CPU stays small
    # (it shares the machine with what is measured).
    bodies = {g: [state_ops(batch, g) for batch in batches] for g in (1, 2)}
    spacing = 1.0 / len(batches)
    written, generation, started = 0, 1, time.monotonic()
    while True:
        for n, batch in enumerate(batches):
            due = started + generation - 1 + n * spacing
            if (ahead := due - time.monotonic()) > 0:
                time.sleep(ahead)
            txn(conn, bodies[2 - generation % 2][n])
            written += len(batch)
            # Replaced whole, never rewritten in place: a SIGTERM between the
            # truncation and the write left the bench an empty count to read.
            Path(f"{counter}.new").write_text(f"{written} {time.monotonic() - started:.3f}")
            os.replace(f"{counter}.new", counter)
        generation += 1


class Cluster(Children):
    def __init__(self, workdir: str, models: int) -> None:
        super().__init__(workdir)
        self.models = models
        self.consul_port = free_port()
        self.stub_port = free_port()
        self.router_port = free_port()
        self.router: subprocess.Popen | None = None
        self.control_consul_port = free_port()
        self.control_port = free_port()
        self.consul_pid = 0
        self.idle_consul_cpu = 0.0

    def start(self) -> None:
        overhead = str(Path(__file__).with_name("router_overhead.py"))
        self.spawn([sys.executable, overhead, "--serve-stub", str(self.stub_port)], "stub")
        consul = self.consul(self.consul_port)
        self.consul_pid = self.procs[-1].pid
        control = self.consul(self.control_consul_port, "control-consul")
        wait_for(lambda: socket.create_connection(("127.0.0.1", self.stub_port)), 10, "stub")
        service = {
            "ID": "llmgw-bench-1",
            "Name": f"llmgw-{MODEL}",
            "Address": "127.0.0.1",
            "Port": self.stub_port,
            "Check": {"CheckID": "bench-ttl", "TTL": "1h", "Status": "passing"},
        }
        for url in (consul, control):
            http("PUT", f"{url}/v1/agent/service/register", json.dumps(service).encode())
            define_model(url, MODEL)
        conn = HTTPConnection("127.0.0.1", self.consul_port, timeout=30)
        for start in range(0, self.models, TXN_DOCS):
            batch = range(start, min(start + TXN_DOCS, self.models))
            ops = [
                {
                    "KV": {
                        "Verb": "set",
                        "Key": f"llmgw/models/m{i}",
                        "Value": base64.b64encode(
                            json.dumps(
                                {"name": f"m{i}", "definition_hash": "h", "replicas": 1}
                            ).encode()
                        ).decode(),
                    }
                }
                for i in batch
            ]
            txn(conn, json.dumps(ops).encode())
            txn(conn, state_ops(batch, 0, every_routing=True))
        # No planner here: a model without replicas is refused, not activated.
        os.environ["LLMGW_ACTIVATION"] = "0"
        self.router = self.router_process(self.router_port, self.consul_port)
        self.router_process(self.control_port, self.control_consul_port, name="control")
        for port in (self.router_port, self.control_port):
            url = f"http://127.0.0.1:{port}/v1/completions"
            wait_for(lambda u=url: http("POST", u, REQUEST_BODY) == STUB_BODY, 60, "routers")
        url = f"http://127.0.0.1:{self.router_port}/v1/completions"
        # Every model known and its state read: m0 is unplaceable at generation 0.
        body = json.dumps({"model": "m0", "prompt": "x"}).encode()
        wait_for(lambda: _refusal(url, body) == "model_unplaceable", 60, "states read")

    def answer_bytes(self, prefix: str) -> int:
        """The size of Consul's answer to a read of ``prefix`` (recursive)."""
        return len(http("GET", f"http://127.0.0.1:{self.consul_port}/v1/kv/{prefix}?recurse"))


def _refusal(url: str, body: bytes) -> str | None:
    import urllib.error

    try:
        http("POST", url, body)
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())["error"]["code"]
    return None


def p99_ms(
    port: int, args: argparse.Namespace, workdir: str, generator: str
) -> tuple[float, str | None]:
    """p99 at ``args.connections`` in ms, and what failed: a request that failed or
    timed out (wrk: after 2 s) makes the p99 infinite."""
    try:
        if generator == "wrk":
            return rps_wrk(port, args.connections, args.duration, workdir)[2][0] * 1000, None
        lat = rps_python(port, args.connections, args.duration)[2]
        return percentile(lat, 0.99) * 1000, None
    except RuntimeError as exc:
        return math.inf, str(exc)


def idle_cpu(cluster: Cluster, args: argparse.Namespace, workdir: str, churning: bool) -> float:
    """The router's CPU share over ``args.duration`` seconds with no request: what the
    state watch alone costs it, a figure the other processes' load does not bend."""
    assert cluster.router is not None
    writer = None
    counter = os.path.join(workdir, "written-idle")
    if churning:
        writer = cluster.spawn(
            [sys.executable, __file__, "--churn", str(cluster.consul_port), str(args.models),
             counter],
            "churn-idle",
        )  # fmt: skip
        wait_for(lambda: Path(counter).exists(), 10, "the writer's first batch")
    try:
        cpu = cpu_seconds(cluster.router.pid)
        consul = cpu_seconds(cluster.consul_pid)
        time.sleep(args.duration)
        cluster.idle_consul_cpu = (cpu_seconds(cluster.consul_pid) - consul) / args.duration
        return (cpu_seconds(cluster.router.pid) - cpu) / args.duration
    finally:
        if writer is not None:
            writer.terminate()
            writer.wait(10)
            time.sleep(3)  # the router's last reads of the churn (see phase)


def kv_answer(models: int, generation: int, kind: str = "routing") -> bytes:
    """Consul's answer to a read of ``llmgw/<kind>/`` at ``generation`` (its shape)."""
    document = routing_document if kind == "routing" else state_document
    entries = [
        {
            "LockIndex": 0, "Key": f"llmgw/{kind}/m{i}", "Flags": 0,
            "Value": _b64json(document(i, generation)),
            "CreateIndex": 1, "ModifyIndex": 10 + generation * models + i,
        }
        for i in range(models)
    ]  # fmt: skip
    return json.dumps(entries, separators=(",", ":")).encode()


def loop_gaps(models: int) -> dict:
    """In this process, no other load in the figure: the work of one read of the routing
    answer by the router's :class:`router.states.StateView` (all new, none changed,
    all changed: every model turned parked or unplaceable at once, the worst case) and
    the longest the event loop waited meanwhile, against the parse of the whole state
    answer in one block that the router did before both (``json.loads``, base64, pydantic)."""
    from llmgw_contract import StateDocument, decode
    from router.states import StateView, pieces_of

    first, second = kv_answer(models, 1), kv_answer(models, 2)
    result: dict = {}

    async def run() -> None:
        view = StateView()
        gaps: list[float] = []
        done = False

        async def ticker() -> None:
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.ensure_future(ticker())
        for label, data in (("all_new", first), ("none_changed", first), ("all_changed", second)):
            gaps.clear()
            await view.read(pieces_of(data), 1)
            result[f"{label}_work_ms"] = view.cost_s * 1000
            result[f"{label}_longest_gap_ms"] = max(gaps, default=0.0) * 1000
        done = True
        await task

    asyncio.run(run())
    whole = kv_answer(models, 2, "state")
    started = time.perf_counter()
    for entry in json.loads(whole):
        decode(StateDocument, base64.b64decode(entry["Value"]))
    result["old_parse_block_ms"] = (time.perf_counter() - started) * 1000
    return result


def p99_one_ms(port: int, seconds: float) -> float:
    """p99 in ms of back-to-back requests on one connection for ``seconds``: a light
    client, so less of the machine's contention lands in the figure."""
    client = RawClient(port, REQUEST_BODY)
    try:
        times: list[float] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            times.append(client.roundtrip())
        return percentile(times, 0.99) * 1000
    finally:
        client.close()


def phase(
    cluster: Cluster,
    args: argparse.Namespace,
    workdir: str,
    generator: str,
    churning: bool,
    control_first: bool = False,
) -> dict:
    assert cluster.router is not None
    writer = None
    counter = os.path.join(workdir, "written")
    if churning:
        writer = cluster.spawn(
            [sys.executable, __file__, "--churn", str(cluster.consul_port), str(args.models),
             counter],
            "churn",
        )  # fmt: skip
        wait_for(lambda: Path(counter).exists(), 10, "the writer's first batch")
    # The router's CPU share is taken while it is loaded (not while the control is).
    cpu = seconds = 0.0

    def timed(port: int, measure: Callable[[], Any]) -> Any:
        nonlocal cpu, seconds
        if port != cluster.router_port:
            return measure()
        assert cluster.router is not None
        cpu_before, started = cpu_seconds(cluster.router.pid), time.monotonic()
        try:
            return measure()
        finally:
            seconds += time.monotonic() - started
            cpu += cpu_seconds(cluster.router.pid) - cpu_before

    try:
        routers = [cluster.router_port, cluster.control_port]
        if control_first:
            routers.reverse()
        direct, _ = p99_ms(cluster.stub_port, args, workdir, generator)
        many = {
            port: timed(port, lambda p=port: p99_ms(p, args, workdir, generator))
            for port in routers
        }
        direct_one = p99_one_ms(cluster.stub_port, args.duration / 2)
        one = {
            port: timed(port, lambda p=port: p99_one_ms(p, args.duration / 2)) for port in routers
        }
        router, failed = many[cluster.router_port]
        control, control_failed = many[cluster.control_port]
    finally:
        if writer is not None:
            writer.terminate()
            writer.wait(10)
    result = {
        "direct_p99_ms": direct,
        "router_p99_ms": router,
        "added_p99_ms": router - direct,
        "added_p99_1conn_ms": one[cluster.router_port] - direct_one,
        "control_added_p99_ms": control - direct,
        "control_added_p99_1conn_ms": one[cluster.control_port] - direct_one,
        "router_cpu_share": cpu / seconds,
    }
    if failed:
        result["router_failed"] = failed
    if control_failed:
        result["control_failed"] = control_failed
    if writer is not None:
        written, took = Path(counter).read_text().split()
        result["writes_per_s"] = int(written) / float(took)
        Path(counter).unlink()
        # The router's last reads of the churn end within its read interval (its
        # cost x 10, about a second): the quiet phase starts after them.
        time.sleep(3)
    return result


def measure(args: argparse.Namespace) -> dict:
    loop = loop_gaps(args.models)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as workdir:
        cluster = Cluster(workdir, args.models)
        try:
            try:
                cluster.start()
            except Exception as exc:
                print(f"setup failed: {exc}\n{json.dumps(cluster.logs(), indent=1)}")
                sys.exit(2)
            router_overhead.use_wrk()
            generator = "wrk" if router_overhead.WRK is not None else "python-aiohttp"
            result: dict = {
                "cpus": os.cpu_count(),
                "models": args.models,
                "state_answer_mib": cluster.answer_bytes("llmgw/state/") / 2**20,
                "routing_answer_kib": cluster.answer_bytes("llmgw/routing/") / 2**10,
                "connections": args.connections,
                "duration_s": args.duration,
                "load_generator": generator,
                "rounds": [],
                "loop": loop,
            }
            result["idle_quiet_cpu_share"] = idle_cpu(cluster, args, workdir, False)
            result["idle_churn_cpu_share"] = idle_cpu(cluster, args, workdir, True)
            result["idle_churn_consul_cpu_share"] = cluster.idle_consul_cpu
            for i in range(args.rounds):
                order = (False, True) if i % 2 == 0 else (True, False)
                pair = {}
                for churning in order:
                    name = "churn" if churning else "quiet"
                    pair[name] = phase(cluster, args, workdir, generator, churning, i % 2 == 1)
                result["rounds"].append(pair)
        finally:
            cluster.close()
    for name in ("quiet", "churn"):
        for key in (
            "added_p99_ms", "router_p99_ms", "direct_p99_ms", "router_cpu_share",
            "added_p99_1conn_ms", "control_added_p99_ms", "control_added_p99_1conn_ms",
        ):  # fmt: skip
            result[f"{name}_{key}"] = statistics.median(r[name][key] for r in result["rounds"])
    for suffix in ("", "_1conn"):
        result[f"router_share{suffix}_ms"] = statistics.median(
            _router_share(r, suffix) for r in result["rounds"]
        )
    result["churn_writes_per_s"] = statistics.median(
        r["churn"]["writes_per_s"] for r in result["rounds"]
    )
    result["added_p99_difference_ms"] = result["churn_added_p99_ms"] - result["quiet_added_p99_ms"]
    result["target_ms"] = TARGET_MS
    result["met"] = {
        "churn_within_1ms": result["added_p99_difference_ms"] <= TARGET_MS,
        "router_share_within_1ms": result["router_share_ms"] <= TARGET_MS,
    }
    return result


def _router_share(pair: dict, suffix: str) -> float:
    """One round's churn cost to the router less the control's (the machine's share):
    infinite, so never met, when a figure of either is not finite (a failed run)."""
    figures = [
        pair[phase][f"{who}added_p99{suffix}_ms"]
        for phase in ("churn", "quiet")
        for who in ("", "control_")
    ]
    if not all(math.isfinite(f) for f in figures):
        return math.inf
    churn, control_churn, quiet, control_quiet = figures
    return (churn - quiet) - (control_churn - control_quiet)


def print_table(r: dict) -> None:
    lo = r["loop"]
    print(
        f"one read of the routing answer, in process: all new {lo['all_new_work_ms']:.1f} ms "
        f"of work, none changed {lo['none_changed_work_ms']:.1f} ms, all changed "
        f"{lo['all_changed_work_ms']:.1f} ms; the loop waited at most "
        f"{max(lo[k] for k in lo if k.endswith('gap_ms')):.2f} ms at a time (a parse of "
        f"the whole state answer: one block of {lo['old_parse_block_ms']:.0f} ms)"
    )
    print(
        f"{'phase':<8} {'direct p99':>11} {'router p99':>11} {'added p99':>10} {'router CPU':>11}"
        f"{'added p99 1 conn':>17}   control added p99, {r['connections']} / 1 conn"
    )
    for i, pair in enumerate(r["rounds"]):
        for name in ("quiet", "churn"):
            p = pair[name]
            print(
                f"{name:<8} {p['direct_p99_ms']:>8.2f} ms {p['router_p99_ms']:>8.2f} ms "
                f"{p['added_p99_ms']:>7.2f} ms {p['router_cpu_share'] * 100:>10.0f}%"
                f"{p['added_p99_1conn_ms']:>14.2f} ms"
                f"{p['control_added_p99_ms']:>15.2f} / {p['control_added_p99_1conn_ms']:.2f} ms"
                + (f"  round {i + 1}" if name == "quiet" else "")
            )
    print(
        f"router CPU with no request: quiet {r['idle_quiet_cpu_share'] * 100:.1f}%, while "
        f"1,000 models churn {r['idle_churn_cpu_share'] * 100:.1f}% of one core (Consul "
        f"meanwhile: {r['idle_churn_consul_cpu_share'] * 100:.0f}%)"
    )
    print(
        f"median added p99 at 1 connection: quiet {r['quiet_added_p99_1conn_ms']:.2f} ms, "
        f"churning {r['churn_added_p99_1conn_ms']:.2f} ms"
    )
    ok = "yes" if r["met"]["churn_within_1ms"] else "NO"
    own = "yes" if r["met"]["router_share_within_1ms"] else "NO"
    print(
        f"median added p99 of the control (no state to read): quiet "
        f"{r['quiet_control_added_p99_ms']:.2f} ms, churning {r['churn_control_added_p99_ms']:.2f}"
        f" ms; the router's own share of the churn cost (its difference less the control's, "
        f"per round): {r['router_share_ms']:+.2f} ms at {r['connections']} connections "
        f"(<= {r['target_ms']:g} ms: {own}), {r['router_share_1conn_ms']:+.2f} ms at one"
    )
    print(
        f"median added p99: quiet {r['quiet_added_p99_ms']:.2f} ms, churning "
        f"{r['churn_added_p99_ms']:.2f} ms; difference {r['added_p99_difference_ms']:+.2f} ms "
        f"(target <= {r['target_ms']:g} ms: {ok})"
    )
    print(
        f"({r['models']} models, a {r['state_answer_mib']:.1f} MiB state answer and a "
        f"{r['routing_answer_kib']:.0f} KiB routing answer, "
        f"{r['churn_writes_per_s']:.0f} state writes/s while churning; {r['connections']} "
        f"connections, {r['duration_s']:g} s a phase, {len(r['rounds'])} rounds in "
        f"alternating order; {r['load_generator']}; {r['cpus']} CPUs shared by client, "
        "router, stub, Consul and the writer)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds a measurement")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="quiet/churn pairs")
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--churn", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.churn:
        churn(int(args.churn[0]), int(args.churn[1]), args.churn[2])
        return
    exit_on_sigterm()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    report(measure(args), args.output, print_table)


if __name__ == "__main__":
    main()
