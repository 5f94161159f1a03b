"""``router serve --workers N``: N router processes behind one port (``SO_REUSEPORT``).

Called by :mod:`router.cli`. One router process runs one event loop on one core;
on a node with cores to spare, N workers serve N times the requests a core
allows (measured in docs/benchmarks.md). The process started with ``--workers
N`` (env ``LLMGW_ROUTER_WORKERS``; N > 1) serves nothing itself: it starts N
copies of its own command line, each marked with :data:`WORKER_ENV` (its
index), and each binds the port with ``SO_REUSEPORT`` (:func:`listen_socket`),
so the kernel spreads new connections over the workers by a hash of the
connection's addresses (nginx's ``reuseport``: no worker wakes for a connection
another takes). A keep-alive connection stays with the worker that accepted it.

What the workers share: the port, nothing else. Each has its own Consul
watches and endpoint table (N times the watch connections to Consul), its own
in-flight counts and admission queue per replica (each admits up to a
replica's slot count by itself, as separate router instances do: N workers
may send a replica N times its slots, the rest waiting in llama-server's own
queue), its own ejections (a dead replica costs each worker its own first
request there), its own prefix ring loads (the ring and the hash are the same
everywhere, so a prefix maps to the same replica until a worker's local load
spills it), its own activation calls and usage reports (the planner takes
them from any number of routers), and its own ``/metrics``: a scrape through
the shared port reads the worker that accepted it. Where exact metrics or one
view of ejections matter, run more router instances (the router job's count)
rather than workers.

Bounds the router holds as a whole are split: each worker holds
``1/N`` of ``max_requests`` and of the request-body budget (the default or an
explicit ``LLMGW_ROUTER_MAX_BODIES_BYTES``), so N workers together hold what
one router would (:func:`share`; N reaches the workers on the command line
they are started with). Per-key limits (:mod:`router.limits`) are not split: a
key's connections are not spread evenly (one keep-alive connection stays on
one worker), so with N workers a key gets up to N times its limits, as with N
router instances; :func:`shared_state_warnings` says so in the log.

Supervision: SIGTERM or SIGINT is passed to every worker, each drains as one
router does, and the command exits 0 when all exited 0. During the first
start, a worker that exits with 2 (invalid settings) or 3 (ACL denied), or
with 1 within :data:`START_GRACE_S` of its start (could not start: the port,
a lifespan error), stops the others and the command exits with that code:
every worker would fail alike. Later, a worker that ends (a crash, or one
started again that exits 2 or 3 because the keys file is being edited or a
TLS file is being rotated) is logged and started again after a delay doubling
from :data:`BACKOFF_BASE_S` to :data:`BACKOFF_MAX_S` (:func:`backoff_s`),
the others serving meanwhile: a failed reload never stops the healthy
workers, as a single router keeps its old keys when a reload fails. Workers
run in a process group of their own and end with the supervisor, even one
killed outright (``PR_SET_PDEATHSIG``, then a check that the supervisor did
not die before it was set).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

log = logging.getLogger(__name__)

# Set in a worker's environment: its index (0..N-1). A worker serves, never supervises.
WORKER_ENV = "LLMGW_ROUTER_WORKER"
START_GRACE_S = 5.0
# A worker that ended after the first start is started again after a delay of
# BACKOFF_BASE_S doubling to BACKOFF_MAX_S per failure in a row; one that ran
# BACKOFF_RESET_S before it ended starts the count again. The doubling and the
# 30 s cap are systemd's and Kubernetes' restart backoff shape (Kubernetes:
# 10 s doubling to 5 min); the router starts in about a second, so 1 s first.
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 60.0
# How often the supervisor looks for ended workers while a delayed start waits.
POLL_S = 0.1
_FATAL = (2, 3)  # invalid settings, ACL denied: every worker would fail alike
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_index() -> int | None:
    """This process's worker index, or ``None`` when it is not a worker."""
    raw = os.environ.get(WORKER_ENV)
    return int(raw) if raw is not None and raw.isdigit() else None


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (and
    ``SO_REUSEADDR``), not listening yet: uvicorn listens once the app has started,
    and the kernel hands connections only to listening sockets of the group, so a
    worker (started again) gets none while it starts; the others take them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def share(total: int, workers: int) -> int:
    """One worker's share of a bound the router holds as a whole (requests held,
    body bytes held): ``total // workers``, at least 1; 0 (no bound) stays 0."""
    return max(1, total // workers) if total else 0


def backoff_s(failures: int) -> float:
    """Seconds before starting a worker again after its ``failures``-th (>= 1) failure
    in a row: :data:`BACKOFF_BASE_S` doubling, at most :data:`BACKOFF_MAX_S`."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** min(failures - 1, 32))


def shared_state_warnings(workers: int, api_keys: bool, shared_limits: bool = True) -> list[str]:
    """What an operator of ``--workers`` must know that the workers do not share
    (logged by :mod:`router.cli` when the supervisor starts); ``api_keys``: keys are
    configured (a file or Consul), which may carry per-key limits; ``shared_limits``:
    requests per minute and budgets are counted in Consul (each worker takes its own
    leases, as a router does), so only the concurrency limit is per worker."""
    if workers < 2:
        return []
    warnings = [
        f"/metrics is per worker: a scrape through the shared port reads whichever of the "
        f"{workers} workers accepted it (docs/router.md#workers)"
    ]
    if api_keys and shared_limits:
        warnings.append(
            f"per-key concurrent_requests are per worker: with {workers} workers a key gets "
            f"up to {workers} times that limit (requests per minute and budgets are shared "
            f"through Consul; docs/router.md#workers)"
        )
    elif api_keys:
        warnings.append(
            f"per-key limits (requests_per_minute, concurrent_requests, budgets) are per worker: "
            f"with {workers} workers a key gets up to {workers} times its limits "
            f"(docs/router.md#workers)"
        )
    return warnings


class Supervisor:
    """Starts ``workers`` copies of ``command`` and keeps them running (see above)."""

    def __init__(self, command: list[str], workers: int) -> None:
        self.command = command
        self.workers = workers
        # pid: (index, process, when it started, whether it is the index's first)
        self.procs: dict[int, tuple[int, subprocess.Popen[bytes], float, bool]] = {}
        # index: when its delayed start is due (time.monotonic)
        self.pending: dict[int, float] = {}
        # index: failures in a row (backoff_s)
        self.failures: dict[int, int] = {}
        self.stopping = False

    def _start(self, index: int, first: bool = False) -> None:
        env = {**os.environ, WORKER_ENV: str(index)}
        die = functools.partial(_die_with_parent, os.getpid())
        # A process group of its own: a terminal's Ctrl-C reaches the supervisor
        # alone, which passes it on once (a second signal would force the worker
        # out without draining); and a supervisor killed outright takes its
        # workers with it (PR_SET_PDEATHSIG), never leaving them on the port.
        proc = subprocess.Popen(self.command, env=env, process_group=0, preexec_fn=die)
        self.procs[proc.pid] = (index, proc, time.monotonic(), first)

    def _signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        for _, proc, _, _ in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        """Run until every worker ended; the command's exit code."""
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._signal) for sig in signals}
        try:
            for index in range(self.workers):
                self._start(index, first=True)
            log.info("started %d router workers sharing the port", self.workers)
            return self._wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _wait(self) -> int:
        code = 0
        while self.procs or (self.pending and not self.stopping):
            self._start_due()
            pid, status = self._reap()
            if pid not in self.procs:
                continue
            index, proc, started, first = self.procs.pop(pid)
            exit_code = os.waitstatus_to_exitcode(status)
            proc.returncode = exit_code
            if self.stopping:
                code = code or (0 if exit_code == 0 else 1)
                continue
            ran = time.monotonic() - started
            if first and (exit_code in _FATAL or (exit_code == 1 and ran < START_GRACE_S)):
                log.error("router worker %d exited with %d: stopping the others", index, exit_code)
                self._signal(signal.SIGTERM, None)
                code = exit_code
                continue
            failures = 1 if ran >= BACKOFF_RESET_S else self.failures.get(index, 0) + 1
            self.failures[index] = failures
            delay = backoff_s(failures)
            log.error(
                "router worker %d exited with %d: starting another in %g s "
                "(failure %d in a row; the other workers serve meanwhile)",
                index,
                exit_code,
                delay,
                failures,
            )
            self.pending[index] = time.monotonic() + delay
        return code

    def _start_due(self) -> None:
        """Start the workers whose delayed start is due (none once stopping)."""
        if self.stopping:
            self.pending.clear()
            return
        now = time.monotonic()
        for index, due in sorted(self.pending.items()):
            if due <= now:
                del self.pending[index]
                log.info("starting router worker %d again", index)
                self._start(index)

    def _reap(self) -> tuple[int, int]:
        """The next worker that ended (pid, wait status), or ``(0, 0)`` when a delayed
        start is due (or the command is stopping) first."""
        if not self.pending or self.stopping:
            try:
                return os.wait()
            except ChildProcessError:  # stopping while every worker waited for its start
                return 0, 0
        due = min(self.pending.values())
        while (left := due - time.monotonic()) > 0 and not self.stopping:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # every worker is waiting for its start
                pid, status = 0, 0
            if pid:
                return pid, status
            time.sleep(min(POLL_S, left))
        return 0, 0


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM when the supervisor (pid ``parent``) dies
    (Linux); exits at once when it died before that was set."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # A supervisor that died between the fork and the prctl sends no signal: the
    # child, adopted by another process already, would serve on alone.
    if os.getppid() != parent:
        os._exit(1)


def supervise(workers: int) -> int:
    """Run ``workers`` copies of this command line as workers; the exit code."""
    command = [sys.executable, "-m", "router", *sys.argv[1:]]
    return Supervisor(command, workers).run()
