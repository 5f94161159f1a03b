"""What the routers see of each model's load, summed: the leader's memory (issue 22).

Every router reports, with its usage (`POST /v1/usage`, `llmgw_contract.UsageReport`),
its requests in flight and waiting per model, and what the model's replicas said they
run and queue when that was more than its own (`ModelLoad.replicas`). A model's load
is `_totals`: the requests the routers sent (summed) or what the replicas say (the
largest read: each read counts every client's requests, so reads are not summed),
whichever is more, plus the requests waiting in the routers. The replicas' word adds
what no report carries (a router whose reports fail, a client that bypasses the
routers); with every request through reporting routers the two agree.
`DemandBook.report` keeps the latest report of each router, and after each one the
load per model as a sample (time, value);
`demand` gives a model's time-weighted average over a window and the sum now, as
`planner.model.autoscale.Demand`, for its worker's observation
(`planner.daemon.observe`).

A router that stops reporting (stopped, partitioned, refused by the planner) counts for
nothing once `EXPIRE_INTERVALS` of its intervals passed without a report. Its load is
then unknown, not gone, so it is counted as `Demand.lost` for the hold asked for (the
scaler's `down_after`: no scale-down meanwhile), unless its last report was a goodbye:
a router that shuts down sends an empty report with an interval of at most
`USAGE_GOODBYE_INTERVAL_S` (`router.usage`), and is forgotten at once. A model no router
reports for has a sum of 0 while any router reports; with no router fresh at all there
is no signal (`Demand.routers == 0`: the scaler holds).

A surge (`Demand.surge`) is judged on the sums at each report of the last
`PANIC_INTERVALS` report intervals (the longest of the fresh routers'): their lowest,
once one router reported twice in it (the load held for a whole interval), else 0.

Memory is bounded: one entry per router (dropped when expired), and per model the
samples of the last `KEEP_S` seconds (the longest window a definition may ask for).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from llmgw_contract import ModelLoad, UsageReport
from llmgw_contract.documents import USAGE_GOODBYE_INTERVAL_S
from planner.model.autoscale import Demand

EXPIRE_INTERVALS = 3
KEEP_S = 600.0
# Two reports of one router fit in 2.5 of its intervals whatever the phase.
PANIC_INTERVALS = 2.5


@dataclass(frozen=True)
class _Report:
    at: float  # Unix s
    interval_s: float
    load: dict[str, ModelLoad]


def _totals(reports: Iterable[_Report]) -> dict[str, float]:
    """Each model's load over `reports` (see the module docstring)."""
    sent: dict[str, float] = {}
    said: dict[str, float] = {}
    waiting: dict[str, float] = {}
    for report in reports:
        for name, load in report.load.items():
            sent[name] = sent.get(name, 0.0) + load.inflight
            said[name] = max(said.get(name, 0.0), float(load.replicas))
            waiting[name] = waiting.get(name, 0.0) + load.waiting
    return {name: max(sent[name], said[name]) + waiting[name] for name in sent}


class DemandBook:
    """Latest report per router and the summed samples per model; thread-safe."""

    def __init__(self, clock: Callable[[], datetime]) -> None:
        self._clock = clock
        self._routers: dict[str, _Report] = {}
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._since = 0.0  # the first report this book holds (0: none yet)
        # Each report's (time, router, sums per model), for the panic window.
        self._recent: deque[tuple[float, str, dict[str, float]]] = deque()
        self._lost: dict[str, float] = {}  # router -> when it went silent (Unix s)
        self._lock = threading.Lock()

    def report(self, report: UsageReport) -> None:
        """A router's report arrived now (one without a router id carries no load)."""
        if not report.router:
            return
        t = self._clock().timestamp()
        load = dict(report.load)
        goodbye = not report.load and not report.models
        goodbye = goodbye and report.interval_s <= USAGE_GOODBYE_INTERVAL_S
        with self._lock:
            self._since = self._since or t
            self._lost.pop(report.router, None)
            if goodbye:
                self._routers.pop(report.router, None)
            else:
                self._routers[report.router] = _Report(t, max(report.interval_s, 0.1), load)
            self._sample(t, report.router)

    def _sample(self, t: float, router: str) -> None:
        """Append each model's sum over the fresh routers at `t` (lock held)."""
        fresh = self._fresh(t)
        totals = _totals(fresh)
        self._recent.append((t, router, totals))
        panic = PANIC_INTERVALS * max((r.interval_s for r in fresh), default=0.0)
        while self._recent and self._recent[0][0] < t - panic:
            self._recent.popleft()
        for name in set(totals) | set(self._samples):
            series = self._samples.setdefault(name, deque())
            value = totals.get(name, 0.0)
            if not series or series[-1][1] != value:
                series.append((t, value))
            while len(series) > 1 and series[1][0] <= t - KEEP_S:
                series.popleft()
            if value == 0.0 and len(series) == 1 and series[0][0] <= t - KEEP_S:
                del self._samples[name]

    def _fresh(self, t: float) -> list[_Report]:
        for router, r in list(self._routers.items()):
            if t - r.at > EXPIRE_INTERVALS * r.interval_s:
                del self._routers[router]
                self._lost[router] = t
        for router, when in list(self._lost.items()):
            if when <= t - KEEP_S:
                del self._lost[router]
        return list(self._routers.values())

    def _surge(self, name: str, t: float) -> float:
        """The lowest sum at the reports of the panic window, once one router reported
        twice in it; else 0 (lock held)."""
        fresh = self._routers.values()
        panic = PANIC_INTERVALS * max((r.interval_s for r in fresh), default=0.0)
        recent = [(router, sums) for at, router, sums in self._recent if at >= t - panic]
        routers = [router for router, _ in recent]
        if len(set(routers)) == len(routers):
            return 0.0
        return min(sums.get(name, 0.0) for _, sums in recent)

    def demand(self, name: str, window_s: float, hold_s: float = 0.0) -> Demand:
        """Model `name`'s load over the last `window_s` seconds (since this book's first
        report at the earliest; 0 before the model's first sample) and now; `lost`
        counts the routers gone silent within the last `hold_s` seconds (at most `KEEP_S`)."""
        t = self._clock().timestamp()
        with self._lock:
            routers = len(self._fresh(t))
            now = _totals(self._routers.values()).get(name, 0.0)
            series = list(self._samples.get(name, ()))
            since = self._since
            surge = self._surge(name, t)
            lost = sum(1 for when in self._lost.values() if when > t - hold_s)
        if not since:
            return Demand(average=0.0, now=0.0, covered_s=0.0, routers=0)
        start = max(t - window_s, since)
        # A step function: each sample holds until the next, the last until now.
        points = [*series, (t, now)]
        area = 0.0
        for (t0, value), (t1, _) in itertools.pairwise(points):
            lo, hi = max(t0, start), min(t1, t)
            if hi > lo:
                area += value * (hi - lo)
        covered = t - start
        average = area / covered if covered > 0 else now
        return Demand(
            average=average, now=now, covered_s=covered, routers=routers, surge=surge, lost=lost
        )

    def snapshot(self) -> dict[str, float]:
        """Each model's summed load now (models with a sample), for /metrics."""
        t = self._clock().timestamp()
        with self._lock:
            self._fresh(t)
            totals = _totals(self._routers.values())
            return {name: totals.get(name, 0.0) for name in sorted(self._samples)}

    def clear(self) -> None:
        """A new leader: start over (reports reach it within one interval)."""
        with self._lock:
            self._routers.clear()
            self._samples.clear()
            self._recent.clear()
            self._lost.clear()
            self._since = 0.0
