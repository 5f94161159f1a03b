"""Prometheus metrics of the router, on a registry owned by one app instance.

Series (names and labels are part of the alerting contract):

- ``llmgw_router_requests_total{model,code}``: proxied and refused requests by HTTP status
- ``llmgw_router_refusals_total{model,reason}``: requests the router answered
  itself instead of proxying, by :class:`router.errors.Refusal` (parked,
  unplaceable, stopped, not_ready, loading, replicas_busy, planner_unavailable;
  unknown_model, unauthorized, not_allowed, rate_limited (:mod:`router.limits`),
  router_starting and router_overloaded under ``model=""``);
  published at 0
- ``llmgw_router_activations_total{model,outcome}``: activate calls this router
  made to the planner (one per call, however many requests shared it), by the
  planner's answer (every :class:`llmgw_contract.ActivationStatus`) or
  ``error`` (no usable answer); published at 0
- ``llmgw_router_activation_wait_seconds{model}``: how long a request that
  found no passing endpoint waited, from then (the activate call included)
  until it got an endpoint or was refused, left or timed out
- ``llmgw_router_request_duration_seconds{model}``: time to the last byte sent
- ``llmgw_router_inflight_requests{model}``: requests being served now
- ``llmgw_router_queued_requests{model}``: requests waiting for a free slot on
  one of the model's replicas (:mod:`router.admission`)
- ``llmgw_router_queue_wait_seconds{model}``: how long a request that found
  every replica at its limit waited, until it got a slot, timed out (503
  ``replicas_busy``) or left; requests that found a free slot at once are
  not observed, so the hot path never touches it
- ``llmgw_router_endpoints{model}``: passing endpoints; published at 0 for every
  defined model so "desired > 0 and ready == 0" can alert
- ``llmgw_router_replica_ejections_total{model,reason}``: replicas ejected by
  passive outlier detection (:mod:`router.outliers`), by what they did
  (connect_error, connection_broken, liveness_failed, stalled, http_5xx:
  :class:`router.outliers.Failure`);
  published at 0
- ``llmgw_router_ejected_replicas{model}``: passing replicas ejected now
- ``llmgw_router_request_body_bytes`` / ``llmgw_router_request_body_limit_bytes``:
  bytes of request bodies held now, and the most the router holds at once
  (:mod:`router.intake`; past it, 503 ``router_overloaded``)
- ``llmgw_router_planner_leader_refusals_total{code}``: times ``llmgw/leader`` was
  found to disagree with where its lock holder registered
  (:class:`llmgw_contract.leadership.Refusal`); the router then sends nothing to
  the address the key names.
- ``llmgw_router_planner_switches_total``: times the planner that answers this
  router's calls changed (a failover, or the lead handed over;
  :mod:`router.planners`); published at 0

Accounting (:mod:`router.accounting`; off with ``LLMGW_ROUTER_ACCOUNTING=false``).
``key`` is the name of the request's router API key in the keys file, never
the key (:mod:`router.keys`): ``anonymous`` when the router asks for no keys,
``unauthenticated`` when the request's key was refused. Series of a (model,
key) pair appear with its first request and go with the model (a key removed
from the keys file keeps its series until then, or until the router restarts):

- ``llmgw_router_tokens_total{model,key,type}``: tokens the replicas reported in
  their answers' ``usage``, by ``type``: ``prompt``, ``cached_prompt`` (the part
  of ``prompt`` served from the prompt cache, not extra tokens) and ``completion``
- ``llmgw_router_key_requests_total{model,key,outcome}``: requests by
  :data:`OUTCOMES`: ``ok`` (status < 400), ``refused`` (the router answered
  itself: llmgw_router_refusals_total says why), ``rate_limited`` (429: the
  key's limits, :mod:`router.limits`; counted under ``model=""``, as the limit
  is checked before the body is read), ``client_error`` and
  ``upstream_error`` (the replica's or the upstream's 4xx / 5xx),
  ``client_closed`` (499); the outcomes of a pair are published at 0
- ``llmgw_router_unmetered_requests_total{model}``: successful answers on a
  metered route (:data:`METERED_ROUTES`), and requests the client left (499),
  that carried no usage the router could read (a stream the client left, a body
  too large to parse on the loop): their tokens are missing from
  ``llmgw_router_tokens_total`` (a key's limits charge an estimate instead,
  :mod:`router.limits`)
- ``llmgw_router_time_to_first_token_seconds{model}``: streams only, from the
  request received to the first byte of the replica's stream (a non-streaming
  answer's first byte is its last)
- ``llmgw_router_time_per_output_token_seconds{model}``: streams with at least
  two completion tokens: (last byte - first byte) / (completion tokens - 1)

The proxy calls :meth:`RouterMetrics.for_model` once per request and then only
touches pre-bound label children, so the hot path does no label lookups.
The endpoint table calls :meth:`RouterMetrics.model_defined` /
:meth:`RouterMetrics.model_removed` as models come and go. Requests naming
an undefined model are counted under ``model=""``: client-chosen strings must
not create series.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from llmgw_contract import ActivationStatus
from router.accounting import Usage
from router.endpoint import Failure
from router.errors import ROUTER_REFUSALS, Refusal
from router.sharedlimits import CALL_OUTCOMES as LIMITS_CALL_OUTCOMES

UNKNOWN_MODEL = ""

# Accounting's key names besides the keys file's (router.keys): no keys asked
# for, and a request whose key was refused.
KEY_ANONYMOUS = "anonymous"
KEY_UNAUTHENTICATED = "unauthenticated"
TOKEN_TYPES = ("prompt", "cached_prompt", "completion")
OK, REFUSED, RATE_LIMITED, CLIENT_ERROR, UPSTREAM_ERROR, CLIENT_CLOSED = (
    "ok", "refused", "rate_limited", "client_error", "upstream_error", "client_closed",
)  # fmt: skip
OUTCOMES = (OK, REFUSED, RATE_LIMITED, CLIENT_ERROR, UPSTREAM_ERROR, CLIENT_CLOSED)
# Routes whose successful answers carry usage (router.routes' names).
METERED_ROUTES = frozenset(
    {
        "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completion",
        "/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
    }
)  # fmt: skip

# Refusals a defined model can get; published at 0 so rate() sees the first one.
_MODEL_REFUSALS = tuple(
    r
    for r in Refusal
    if r
    not in (
        Refusal.UNKNOWN_MODEL,
        Refusal.UNAUTHORIZED,
        Refusal.NOT_ALLOWED,
        Refusal.RATE_LIMITED,
        Refusal.OVER_BUDGET,
    )
    and r not in ROUTER_REFUSALS
)

# Outcomes of an activate call: each answer the contract allows, or no usable answer.
ACTIVATION_ERROR = "error"
ACTIVATION_OUTCOMES = (*(str(s) for s in ActivationStatus), ACTIVATION_ERROR)

# LLM requests run from milliseconds (embeddings) to minutes (long generations).
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# An activation wait is a planner answer (~0.1-2 s), or a model load (seconds
# to the 45 s default window).
_WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 45, 60, 120)
# A queue wait is one generation ending (milliseconds to seconds), up to the
# 30 s default queue timeout.
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
# First token: a short prompt on a GPU (tens of ms) to a long one on a CPU (a minute).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 45, 90)
# Per output token: ~5 ms (a small model on a GPU) to ~0.5 s (a large one on a CPU).
_TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class KeyAccount:
    """Pre-bound accounting children of one (model, key) pair, and what was counted
    for them since the registry was last collected (:meth:`RouterMetrics.fold`)."""

    __slots__ = (
        "cached_prompt", "cached_prompt_n", "completion", "completion_n", "outcome_n",
        "outcomes", "prompt", "prompt_n",
    )  # fmt: skip

    def __init__(self, owner: RouterMetrics, model: str, key: str) -> None:
        self.prompt = owner.tokens.labels(model=model, key=key, type="prompt")
        self.cached_prompt = owner.tokens.labels(model=model, key=key, type="cached_prompt")
        self.completion = owner.tokens.labels(model=model, key=key, type="completion")
        self.outcomes = {
            o: owner.key_requests.labels(model=model, key=key, outcome=o) for o in OUTCOMES
        }
        self.outcome_n = dict.fromkeys(OUTCOMES, 0)
        self.prompt_n = self.cached_prompt_n = self.completion_n = 0

    def fold(self) -> None:
        """Add the counts since the last fold to the children."""
        for kind, n in self.outcome_n.items():
            if n:
                self.outcomes[kind].inc(n)
                self.outcome_n[kind] = 0
        for child, n in (
            (self.prompt, self.prompt_n),
            (self.cached_prompt, self.cached_prompt_n),
            (self.completion, self.completion_n),
        ):
            if n:
                child.inc(n)
        self.prompt_n = self.cached_prompt_n = self.completion_n = 0


def outcome(status: int, refused: bool) -> str:
    """The accounting outcome of a request answered with ``status``; ``refused``:
    the router answered it itself."""
    if status < 400:
        return OK
    if refused:
        return RATE_LIMITED if status == 429 else REFUSED
    if status == 499:
        return CLIENT_CLOSED
    return CLIENT_ERROR if status < 500 else UPSTREAM_ERROR


class RequestMetrics:
    """Pre-bound request counters of one model label (or of undefined models)."""

    __slots__ = (
        "_accounts", "_code_n", "_codes", "_owner", "_refusal_family", "_refusals", "_requests",
        "duration", "model", "tpot", "ttft", "unmetered",
    )  # fmt: skip

    def __init__(self, owner: RouterMetrics, model: str, refusals: tuple[Refusal, ...]) -> None:
        self.model = model
        self._owner = owner
        self._accounts: dict[str, KeyAccount] = {}
        # Bound by ModelMetrics: an undefined model is never proxied.
        self.ttft: Histogram | None = None
        self.tpot: Histogram | None = None
        self.unmetered: Counter | None = None
        self._requests = owner.requests
        self._codes: dict[int, Counter] = {}
        # Requests answered since the registry was last collected, by status.
        self._code_n: dict[int, int] = {}
        self.duration = owner.duration.labels(model=model)
        self._refusal_family = owner.refusals
        self._refusals = {r: owner.refusals.labels(model=model, reason=r) for r in refusals}

    def observe(self, status: int, seconds: float) -> None:
        """Record one finished request: its HTTP status and duration in seconds."""
        counts = self._code_n
        counts[status] = counts.get(status, 0) + 1
        self.duration.observe(seconds)

    def fold(self) -> None:
        """Add the counts since the last fold to their children (:meth:`RouterMetrics.fold`)."""
        for status, n in self._code_n.items():
            child = self._codes.get(status)
            if child is None:
                child = self._requests.labels(model=self.model, code=str(status))
                self._codes[status] = child
            child.inc(n)
        self._code_n.clear()
        for account in self._accounts.values():
            account.fold()

    def account(
        self,
        key: str,
        status: int,
        refused: bool,
        usage: Usage | None,
        first_s: float | None = None,
        last_s: float | None = None,
        metered: bool = False,
    ) -> None:
        """Record one finished request for ``key`` (a key name): its outcome, the
        tokens of its ``usage``, and for a stream (``first_s``: seconds from the
        request to its first byte, ``last_s``: to its last) the time to first token
        and per output token. ``metered``: its route answers with usage, so a
        successful answer without any is counted unmetered."""
        account = self._accounts.get(key)
        if account is None:
            account = self._accounts[key] = KeyAccount(self._owner, self.model, key)
        kind = outcome(status, refused)
        account.outcome_n[kind] += 1
        if usage is not None:
            account.prompt_n += usage.prompt
            account.cached_prompt_n += usage.cached
            account.completion_n += usage.completion
        elif metered and kind in (OK, CLIENT_CLOSED) and self.unmetered is not None:
            self.unmetered.inc()
        if first_s is not None and self.ttft is not None:
            self.ttft.observe(first_s)
            if usage is not None and usage.completion > 1 and last_s is not None:
                assert self.tpot is not None
                self.tpot.observe((last_s - first_s) / (usage.completion - 1))

    def refused(self, reason: Refusal) -> None:
        """Count one request the router refused itself (its status goes to :meth:`observe`)."""
        child = self._refusals.get(reason)
        if child is None:
            child = self._refusals[reason] = self._refusal_family.labels(
                model=self.model, reason=reason
            )
        child.inc()


class ModelMetrics(RequestMetrics):
    """All label children of one defined model, bound once and reused."""

    __slots__ = (
        "activation_wait", "activations", "ejected", "ejections", "endpoints", "inflight",
        "queue_wait", "queued",
    )  # fmt: skip

    def __init__(self, owner: RouterMetrics, model: str) -> None:
        super().__init__(owner, model, _MODEL_REFUSALS)
        self.inflight = owner.inflight.labels(model=model)
        self.queued = owner.queued.labels(model=model)
        self.queue_wait = owner.queue_wait.labels(model=model)
        self.endpoints = owner.endpoints.labels(model=model)
        self.activations = {
            o: owner.activations.labels(model=model, outcome=o) for o in ACTIVATION_OUTCOMES
        }
        self.activation_wait = owner.activation_wait.labels(model=model)
        self.ejections = {f: owner.ejections.labels(model=model, reason=f) for f in Failure}
        self.ejected = owner.ejected.labels(model=model)
        self.ttft = owner.ttft.labels(model=model)
        self.tpot = owner.tpot.labels(model=model)
        self.unmetered = owner.unmetered.labels(model=model)


class _Folding:
    """A collector that publishes nothing: collecting it calls ``fold``."""

    def __init__(self, fold: Callable[[], None]) -> None:
        self._fold = fold

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        self._fold()
        return []


class RouterMetrics:
    """The router's metric families on a private :class:`CollectorRegistry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Registered first: the registry collects in the order of registration, so
        # the counts kept as plain ints on the request path are in the families
        # below before any of them is read (a scrape, or a test's read).
        self.registry.register(_Folding(self.fold))
        self.requests = Counter(
            "llmgw_router_requests_total",
            "Requests answered by the router, by model and HTTP status code.",
            ("model", "code"),
            registry=self.registry,
        )
        self.refusals = Counter(
            "llmgw_router_refusals_total",
            "Requests the router refused itself instead of proxying, by model and reason.",
            ("model", "reason"),
            registry=self.registry,
        )
        self.duration = Histogram(
            "llmgw_router_request_duration_seconds",
            "Seconds from request received to last response byte sent.",
            ("model",),
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.inflight = Gauge(
            "llmgw_router_inflight_requests",
            "Requests the router is serving now.",
            ("model",),
            registry=self.registry,
        )
        self.queued = Gauge(
            "llmgw_router_queued_requests",
            "Requests waiting for a free slot on one of the model's replicas.",
            ("model",),
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "llmgw_router_queue_wait_seconds",
            "Seconds a request waited for a free slot, when every replica of its model "
            "was at its concurrency limit.",
            ("model",),
            buckets=_QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.endpoints = Gauge(
            "llmgw_router_endpoints",
            "Passing endpoints the router can send a model's requests to.",
            ("model",),
            registry=self.registry,
        )
        self.activations = Counter(
            "llmgw_router_activations_total",
            "Activate calls this router made to the planner, by model and outcome.",
            ("model", "outcome"),
            registry=self.registry,
        )
        self.activation_wait = Histogram(
            "llmgw_router_activation_wait_seconds",
            "Seconds a request waited for a passing endpoint of a model that had none "
            "(the activate call included).",
            ("model",),
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.ejections = Counter(
            "llmgw_router_replica_ejections_total",
            "Replicas ejected by passive outlier detection, by model and what they did.",
            ("model", "reason"),
            registry=self.registry,
        )
        self.ejected = Gauge(
            "llmgw_router_ejected_replicas",
            "Replicas of the model ejected by passive outlier detection now.",
            ("model",),
            registry=self.registry,
        )
        self.planner_leader_refusals = Counter(
            "llmgw_router_planner_leader_refusals_total",
            "Times llmgw/leader disagreed with where its lock holder registered in Consul: "
            "the router sent nothing to the address the key named.",
            ("code",),
            registry=self.registry,
        )
        self.planner_switches = Counter(
            "llmgw_router_planner_switches_total",
            "Times the planner answering this router's activate and usage calls changed.",
            registry=self.registry,
        )
        self.body_bytes = Gauge(
            "llmgw_router_request_body_bytes",
            "Bytes of request bodies the router holds now (reserved as they are read).",
            registry=self.registry,
        )
        self.body_limit_bytes = Gauge(
            "llmgw_router_request_body_limit_bytes",
            "Bytes of request bodies the router holds at most, at once.",
            registry=self.registry,
        )
        self.tokens = Counter(
            "llmgw_router_tokens_total",
            "Tokens the replicas reported in their answers' usage, by model, API key name "
            "and type (prompt, cached_prompt: the cached part of prompt, completion).",
            ("model", "key", "type"),
            registry=self.registry,
        )
        self.key_requests = Counter(
            "llmgw_router_key_requests_total",
            "Requests by model, API key name and outcome (ok, refused, client_error, "
            "upstream_error, client_closed).",
            ("model", "key", "outcome"),
            registry=self.registry,
        )
        self.unmetered = Counter(
            "llmgw_router_unmetered_requests_total",
            "Successful answers, and requests the client left, on a route that reports "
            "usage whose usage the router could not read (their tokens are not counted).",
            ("model",),
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmgw_router_time_to_first_token_seconds",
            "Streams: seconds from request received to the first byte of the replica's stream.",
            ("model",),
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "llmgw_router_time_per_output_token_seconds",
            "Streams: seconds between first and last byte per completion token after the first.",
            ("model",),
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.limits_fail_open = Counter(
            "llmgw_router_limits_fail_open_total",
            "Requests of limited API keys admitted without the limits every router shares, "
            "because Consul did not answer (router.limits: each router's own limit holds).",
            registry=self.registry,
        )
        self.limits_consul_calls = Counter(
            "llmgw_router_limits_consul_calls_total",
            "Consul calls for the shared per-key limits, by outcome (written: a lease taken; "
            "conflict: another router wrote first; read; error).",
            ("outcome",),
            registry=self.registry,
        )
        for call in LIMITS_CALL_OUTCOMES:
            self.limits_consul_calls.labels(outcome=call)
        self.limits_shared = Gauge(
            "llmgw_router_limits_shared",
            "1 while the per-key limits are shared through Consul, 0 while they fail open "
            "(or are per router: LLMGW_ROUTER_SHARED_LIMITS=false).",
            registry=self.registry,
        )
        self._models: dict[str, ModelMetrics] = {}
        # Only request counters: "0 endpoints for model ''" would be noise.
        self.unknown = RequestMetrics(
            self, UNKNOWN_MODEL, (Refusal.UNKNOWN_MODEL, *sorted(ROUTER_REFUSALS))
        )

    def fold(self) -> None:
        """Add what the request path counted as plain ints (requests by status, key
        outcomes and tokens) to their counters. Four counter increments were about
        2.5 of the router's 22 us of its own CPU per request (bench/proxy_cpu.py,
        2026-12-03); a scrape folds each series' count once."""
        self.unknown.fold()
        for bound in self._models.values():
            bound.fold()

    def follow_bodies(self, held: Callable[[], float], limit: int) -> None:
        """Publish the bytes of bodies ``held()`` at each scrape, and the ``limit``."""
        self.body_bytes.set_function(held)
        self.body_limit_bytes.set(limit)

    def for_model(self, model: str) -> ModelMetrics:
        """Bound children for a defined ``model`` (created on first use).

        Raises ``ValueError`` for the empty name, which counts undefined models.
        """
        if model == UNKNOWN_MODEL:
            raise ValueError("model name must not be empty")
        bound = self._models.get(model)
        if bound is None:
            bound = self._models[model] = ModelMetrics(self, model)
        return bound

    def model_defined(self, model: str) -> ModelMetrics:
        """Publish ``model``'s series at zero as soon as it is defined."""
        bound = self.for_model(model)
        bound.endpoints.set(0)
        bound.inflight.inc(0)
        bound.queued.inc(0)
        return bound

    def model_removed(self, model: str) -> None:
        """Drop the series of a model that is no longer defined."""
        bound = self._models.pop(model, None)
        if bound is None:
            return
        families = (
            self.duration, self.inflight, self.queued, self.queue_wait, self.endpoints,
            self.activation_wait, self.ejected, self.ttft, self.tpot, self.unmetered,
        )  # fmt: skip
        for family in families:
            family.remove(model)
        for failure in bound.ejections:
            self.ejections.remove(model, failure)
        for outcome in bound.activations:
            self.activations.remove(model, outcome)
        for status in bound._codes:
            self.requests.remove(model, str(status))
        for reason in bound._refusals:
            self.refusals.remove(model, reason)
        for key in bound._accounts:
            for kind in TOKEN_TYPES:
                self.tokens.remove(model, key, kind)
            for name in OUTCOMES:
                self.key_requests.remove(model, key, name)

    def exposition(self) -> tuple[bytes, str]:
        """Current text exposition and its content type, for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
