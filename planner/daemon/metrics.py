"""The planner's Prometheus metrics, on a registry owned by one `planner serve`.

Served at `GET /metrics` on the admin port (`planner.api.admin`). Names and
labels are part of the alerting contract (monitoring/llmgw.rules.yml,
docs/operations.md). Model series come from the leader's `StatusBook`, one
sample per defined model, zeros included, and vanish with a pruned model;
followers publish only the planner's own series (with `llmgw_planner_leader`
0), so a sum over instances never counts a model twice.

    llmgw_model_desired_replicas{model}            replicas it should have now
    llmgw_model_ready_replicas{model}              replicas passing their check
    llmgw_model_state{model,state}                 1 for its state, 0 for the others
    llmgw_model_consecutive_start_failures{model}
    llmgw_model_start_failures_total{model}
    llmgw_model_parked{model}                      0/1
    llmgw_model_unplaceable{model}                 0/1 (not while the room first being made
                                                   for it is still coming, nor for a scaling
                                                   model serving short of a scale-up: see
                                                   unplaced_replicas)
    llmgw_model_unplaced_replicas{model}           replicas the job asks for that Nomad left
                                                   unplaced (a scale-up that fits nowhere)
    llmgw_model_update_failed{model}               0/1: its update was rolled back
    llmgw_model_min_replicas{model}, llmgw_model_max_replicas{model}
                                                   a scaling model's bounds (issue 22)
    llmgw_model_at_max_replicas{model}             0/1: a scaling model at max whose demand
                                                   asks for more (alert LlmgwModelAtMaxReplicas)
    llmgw_model_demand_requests{model}             requests in flight and waiting, summed over
                                                   the routers' latest reports, or what the
                                                   replicas say when more (planner.daemon.demand;
                                                   leader only)
    llmgw_model_scaling_decisions_total{model,direction}  scales load-based scaling made (up|down)
    llmgw_planner_leader                           1 on the leader, 0 elsewhere
    llmgw_planner_leader_changes_total
    llmgw_planner_leader_forward_refusals_total{code}  writes a follower refused: llmgw/leader
                                                   disagrees with the lock holder's registration
    llmgw_planner_event_stream_reconnects_total
    llmgw_planner_event_stream_losses_total{kind}  gap: the stream started later than asked
                                                   (Nomad's buffer had dropped events); reset:
                                                   Nomad's index went back. Each is followed by
                                                   a reconcile of every model
    llmgw_planner_event_stream_last_message_timestamp_seconds
    llmgw_planner_reconcile_duration_seconds       histogram
    llmgw_certificate_expiry_timestamp_seconds{path}, llmgw_certificate_read_success{path}
    llmgw_engine_installed{node,engine,version}    leader only: 1 where the node's metadata
                                                   records that version, per schedulable node
                                                   and defined engine: the defined version
                                                   (0 where missing), and a different one a
                                                   node records (1)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from llmgw_contract import ModelState
from llmgw_contract.certificates import CertificateCollector
from planner.daemon.engine_install import NodeInstall
from planner.daemon.statusbook import Row
from planner.errors import PlannerError

# A reconcile reads every model's job, allocations and evaluations: milliseconds for a
# few models, seconds for hundreds.
_RECONCILE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ModelCollector(Collector):
    """The per-model series, rendered from the status book's rows at each scrape."""

    def __init__(self, rows: Callable[[], Sequence[Row]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        rows = self._rows()

        def gauge(name: str, help_: str, value: Callable[[Row], float]) -> Metric:
            family = GaugeMetricFamily(name, help_, labels=["model"])
            for row in rows:
                family.add_metric([row.status.name], value(row))
            return family

        yield gauge(
            "llmgw_model_desired_replicas",
            "Replicas the model should have now: "
            "its definition's replicas (even while parked or stopped), or for an "
            "on-demand model its replicas while asked for within idle_after, else 0.",
            lambda r: r.wanted,
        )
        yield gauge(
            "llmgw_model_ready_replicas",
            "Replicas of the model passing their health check in Consul.",
            lambda r: r.status.ready,
        )
        state = GaugeMetricFamily(
            "llmgw_model_state",
            "1 for the state the model is in, 0 for every other state (see docs/architecture.md).",
            labels=["model", "state"],
        )
        for row in rows:
            for kind in ModelState:
                state.add_metric([row.status.name, str(kind)], float(row.status.state == kind))
        yield state
        yield gauge(
            "llmgw_model_consecutive_start_failures",
            "Start failures in a row "
            "(forgiven after a stable run); the model parks at --park-after with no "
            "healthy replica.",
            lambda r: r.status.consecutive_failures,
        )
        total = CounterMetricFamily(
            "llmgw_model_start_failures",
            "Start failures counted for the model, ever.",
            labels=["model"],
        )
        for row in rows:
            total.add_metric([row.status.name], row.status.start_failures_total)
        yield total
        yield gauge(
            "llmgw_model_parked",
            "1 while the model is parked: stopped after too "
            "many start failures until its definition changes or `planner retry`.",
            lambda r: float(r.status.state == ModelState.PARKED),
        )
        yield gauge(
            "llmgw_model_unplaceable",
            "1 while Nomad's last answer left replicas "
            "of the model unplaced (not while the room first being made for it is still "
            "coming, nor for a "
            "scaling model serving short of a scale-up).",
            lambda r: float(r.unplaceable),
        )
        yield gauge(
            "llmgw_model_unplaced_replicas",
            "Replicas the model's job asks for that Nomad's last answer left unplaced "
            "(not while the room first being made for it is still coming); with "
            "llmgw_model_unplaceable 0, a scaling "
            "model serving what it has.",
            lambda r: float(r.unplaced),
        )
        scaling = [r for r in rows if r.status.scaling is not None]

        def bound(name: str, help_: str, key: str) -> Metric:
            family = GaugeMetricFamily(name, help_, labels=["model"])
            for row in scaling:
                family.add_metric([row.status.name], float((row.status.scaling or {})[key]))
            return family

        yield bound("llmgw_model_min_replicas", "A scaling model's min replicas.", "min")
        yield bound("llmgw_model_max_replicas", "A scaling model's max replicas.", "max")
        yield bound(
            "llmgw_model_at_max_replicas",
            "1 while a scaling model runs its max replicas and its demand asks for more "
            "(the average per replica above its target).",
            "at_max",
        )
        yield gauge(
            "llmgw_model_update_failed",
            "1 while the applied definition is one "
            "Nomad rolled back: the model serves the definition before it.",
            lambda r: float(r.status.update_failed is not None),
        )

    def describe(self) -> Sequence[Metric]:
        return []


class DemandCollector(Collector):
    """`llmgw_model_demand_requests`: the leader's summed router load per model now."""

    def __init__(self, demand: Callable[[], dict[str, float]]) -> None:
        self._demand = demand

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "llmgw_model_demand_requests",
            "Requests for the model in flight and waiting, summed over every router's "
            "latest report, or what its replicas say they run and queue when that is "
            "more (what load-based scaling averages; on the leader only).",
            labels=["model"],
        )
        for name, value in self._demand().items():
            family.add_metric([name], value)
        yield family

    def describe(self) -> Sequence[Metric]:
        return []


class EngineCollector(Collector):
    """`llmgw_engine_installed`, from `planner.daemon.engine_install.installs` at each scrape
    (an empty list on a follower), read at most every `min_interval` seconds: one node
    read per node, so a fast scraper does not multiply the load on Nomad."""

    def __init__(
        self, rows: Callable[[], Sequence[NodeInstall]], min_interval: float = 10.0
    ) -> None:
        self._rows, self._min_interval = rows, min_interval
        self._cached: tuple[float, Sequence[NodeInstall]] = (float("-inf"), ())

    def _read(self) -> Sequence[NodeInstall]:
        at, rows = self._cached
        if time.monotonic() - at >= self._min_interval:
            try:
                rows = self._rows()
            except PlannerError:
                rows = ()  # Nomad unreachable: no answer rather than a stale one
            self._cached = (time.monotonic(), rows)
        return rows

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "llmgw_engine_installed",
            "1 where the node's metadata records this version of "
            "the engine (llmgw_engine_<name>), 0 where a schedulable node lacks the defined "
            "version: models that need it are not placed there.",
            labels=["node", "engine", "version"],
        )
        for row in self._read():
            family.add_metric([row.node, row.engine, row.wanted], float(row.ok))
            if row.installed and not row.ok:
                family.add_metric([row.node, row.engine, row.installed], 1.0)
        yield family

    def describe(self) -> Sequence[Metric]:
        return []


class PlannerMetrics:
    """The registry and the instruments the node, leadership and watcher update."""

    def __init__(
        self,
        rows: Callable[[], Sequence[Row]],
        certificate_paths: Callable[[], Iterable[str | None]] = lambda: (),
        engines: Callable[[], Sequence[NodeInstall]] = lambda: (),
        demand: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.registry = CollectorRegistry()
        self.leader = Gauge(
            "llmgw_planner_leader",
            "1 on the planner instance that holds the leader lock and acts, 0 on the others.",
            registry=self.registry,
        )
        self.leader_changes = Counter(
            "llmgw_planner_leader_changes",
            "Times this planner instance became or stopped being the leader.",
            registry=self.registry,
        )
        self.forward_refusals = Counter(
            "llmgw_planner_leader_forward_refusals",
            "Writes this follower refused instead "
            "of forwarding, because llmgw/leader disagrees with where the lock holder "
            "registered (code: llmgw_contract.leadership.Refusal).",
            ["code"],
            registry=self.registry,
        )
        self.reconnects = Counter(
            "llmgw_planner_event_stream_reconnects",
            "Reconnects of the leader's Nomad event stream (each followed by a reconcile).",
            registry=self.registry,
        )
        self.losses = Counter(
            "llmgw_planner_event_stream_losses",
            "Events the leader's Nomad event stream may "
            "have lost: kind=gap (it started later than the index asked for: Nomad's bounded "
            "event buffer had dropped them), kind=reset (Nomad's index went back). Each is "
            "followed by a reconcile of every model.",
            ["kind"],
            registry=self.registry,
        )
        self.last_message = Gauge(
            "llmgw_planner_event_stream_last_message_timestamp_seconds",
            "Unix time of the "
            "last event or heartbeat on the leader's Nomad event stream (a heartbeat comes "
            "every 30 s); 0 when this instance does not lead.",
            registry=self.registry,
        )
        self.reconcile = Histogram(
            "llmgw_planner_reconcile_duration_seconds",
            "How long a reconcile from Nomad's "
            "list APIs took (on start, on every stream reconnect).",
            buckets=_RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self.scaling_decisions = Counter(
            "llmgw_model_scaling_decisions",
            "Scales load-based scaling made, by direction (up: demand asked for more "
            "replicas; down: for fewer).",
            ["model", "direction"],
            registry=self.registry,
        )
        self.registry.register(ModelCollector(rows))
        self.registry.register(DemandCollector(demand))
        self.registry.register(CertificateCollector(certificate_paths))
        self.registry.register(EngineCollector(engines))

    def message_seen(self) -> None:
        self.last_message.set(time.time())

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition of every series, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
