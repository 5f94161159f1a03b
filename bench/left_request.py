"""How soon a replica stops a non-streaming completion whose client left, while other
results keep arriving at that replica (issue 21 item 8: within a second).

Real llama-servers (Gemma 3 270M, CPU, 127.0.0.1) behind the router in process. Three
cases a round, each from a fresh start; X is a 3,000-token story without streaming whose
client leaves after 2 s, Y the same story streamed:

- ``quiet``: two replicas (``-np 1``), Y on one and X on the other, the shared-load
  sampler reading both every 0.1 s (:class:`router.replicaload.LoadSampler`, the
  default) with this router's quiet after a leave
  (:data:`router.replicaload.QUIET_AFTER_LEAVE_S`);
- ``another router``: the same with the quiet set to 0, which is what a second router
  does (it does not know X's client left);
- ``stream beside``: one replica with two slots, Y and X on it, no sampler: Y's tokens
  are the other results.

The figure is the time from the leave to llama-server's ``stop: cancel task`` line in
X's replica's log (its own clock, from its start). Unpatched llama-server restarted its
1 s wait for X's next result on every other result (devcluster/llama_patches.py); pass
an unpatched build with ``--binary`` to compare. Needs ``make demo`` or ``make test`` to
have filled ``~/.cache/llmgw`` first.

    .venv/bin/python bench/left_request.py --rounds 3 [--binary PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster.ports import free_port  # noqa: E402
from router import replicaload  # noqa: E402
from router.catalog import ServiceAddress  # noqa: E402
from router.settings import RouterSettings  # noqa: E402
from tests.support.router_harness import asgi_messages, in_process_router  # noqa: E402

CACHE = Path.home() / ".cache/llmgw"
BINARY = CACHE / "bin/llama-server"
GEMMA = CACHE / "models/gemma-3-270m-q4_k_m.gguf"
STORY = {"model": "m", "prompt": "Write a very long story:", "max_tokens": 3000, "ignore_eos": True}
LEAVE_AFTER_S = 2.0
# Y streams this long; X's replica is watched until then.
WATCH_S = 16.0
# llama-server's log time: minutes.seconds.milliseconds.microseconds since its start.
CANCEL = re.compile(rb"^(\d+)\.(\d+)\.(\d+)\.(\d+) W srv +stop: cancel task", re.M)


class Replica:
    def __init__(self, folder: Path, binary: Path, slots: int = 1) -> None:
        self.port = free_port()
        self.log = folder / f"llama-server-{self.port}.log"
        command = [str(binary), "-m", str(GEMMA), "--host", "127.0.0.1", "--port", str(self.port),
                   "-np", str(slots), "-c", str(4096 * slots), "--metrics", "-t", "1"]  # fmt: skip
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=self.log.open("wb"), stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            time.sleep(0.25)
        raise SystemExit(f"llama-server on {self.port} not ready in {timeout_s} s: {self.log}")

    def cancelled_at(self) -> float | None:
        """Seconds after its start that it cancelled a task (its log), or None."""
        found = CANCEL.search(self.log.read_bytes())
        if found is None:
            return None
        minutes, seconds, ms, us = (int(g) for g in found.groups())
        return minutes * 60 + seconds + ms / 1e3 + us / 1e6

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


async def one_round(folder: Path, binary: Path, case: str) -> float | None:
    """Seconds from X's client leaving to its replica cancelling it; None: not within
    the watch."""
    replicaload.QUIET_AFTER_LEAVE_S = 2.0 if case == "quiet" else 0.0
    beside = case == "stream beside"
    replicas = (
        [Replica(folder, binary, slots=2)]
        if beside
        else [Replica(folder, binary), Replica(folder, binary)]
    )
    try:
        for replica in replicas:
            replica.wait_ready()
        async with in_process_router(RouterSettings(activation=False), replicas=2) as app:
            table, proxy = app.state.table, app.state.proxy
            table.set_endpoints("m", [ServiceAddress("127.0.0.1", r.port) for r in replicas])
            sampler = replicaload.LoadSampler(
                lambda: (e.endpoints for e in table.entries()), lambda: proxy.control, 0.1
            )
            if not beside:
                sampler.start()
            y = asyncio.ensure_future(
                asgi_messages(app, {**STORY, "stream": True}, leave_after_s=WATCH_S)
            )
            await asyncio.sleep(1.5)
            free = [e.address.port for e in table.get("m").endpoints if e.inflight == 0]
            x_replica = replicas[0] if beside else next(r for r in replicas if r.port == free[0])
            await asgi_messages(app, STORY, leave_after_s=LEAVE_AFTER_S)
            left = time.monotonic() - x_replica.started
            await y
            await sampler.close()
        cancelled = x_replica.cancelled_at()
        return None if cancelled is None else cancelled - left
    finally:
        for replica in replicas:
            replica.stop()


CASES = ("quiet", "another router", "stream beside")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--binary", type=Path, default=BINARY, help="llama-server to run")
    args = parser.parse_args()
    if not (args.binary.exists() and GEMMA.exists()):
        raise SystemExit(f"needs {args.binary} and {GEMMA}: run `make demo` once")
    folder = Path(f"/tmp/llmgw-left-request-{time.time_ns()}")
    folder.mkdir()
    results: dict[str, list[float | None]] = {case: [] for case in CASES}
    for n in range(args.rounds):
        for case in CASES:
            results[case].append(asyncio.run(one_round(folder, args.binary, case)))
        print(f"round {n + 1}/{args.rounds} done", file=sys.stderr)
    print(f"llama-server: {args.binary.resolve().name}")
    for case, delays in results.items():
        shown = ", ".join(
            f"{d:.2f} s" if d is not None else f"> {WATCH_S - 3.5:.0f} s" for d in delays
        )
        print(f"{case:16} X cancelled after its client left: {shown}")


if __name__ == "__main__":
    main()
