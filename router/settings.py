"""Router settings: one frozen value built from defaults, environment and CLI flags.

Read once by :mod:`router.cli` (``RouterSettings.from_env`` then flag
overrides) and handed to :func:`router.app.create_app`; nothing else reads the
environment.

Environment variables (all optional):

- ``CONSUL_HTTP_ADDR``: ``host:port`` or ``http(s)://host:port`` (default ``127.0.0.1:8500``)
- ``CONSUL_HTTP_SSL``: ``true`` talks HTTPS to Consul even when the address has no
  scheme (TLS is never turned off once the address or this asks for it)
- ``CONSUL_HTTP_TOKEN``: Consul ACL token (default none)
- ``CONSUL_CACERT``: CA file (PEM) that verifies Consul's certificate (default: the
  system's CAs)
- ``CONSUL_CLIENT_CERT`` / ``CONSUL_CLIENT_KEY``: client certificate and key (PEM) for
  a Consul with ``verify_incoming_https``; the two go together
- ``LLMGW_TLS_CERT`` / ``LLMGW_TLS_KEY``: serve HTTPS with this certificate and key
  (``--tls-cert`` / ``--tls-key``)
- ``LLMGW_PLANNER_CACERT``: CA file that verifies an ``https://`` planner's
  certificate (the planner's followers read the same variable); default: the
  system's CAs
- ``LLMGW_ROUTER_HOST`` / ``LLMGW_ROUTER_PORT``: listen address (default ``127.0.0.1:8080``)
- ``LLMGW_ROUTER_UPSTREAM_CONNECT_TIMEOUT``: seconds to open a connection to a replica (5)
- ``LLMGW_ROUTER_UPSTREAM_READ_TIMEOUT``: seconds without a byte from a replica (600)
- ``LLMGW_ROUTER_FIRST_BYTE_TIMEOUT``: seconds a replica may take to its first
  byte (streaming or not) unless it answers ``GET /health`` (10;
  :mod:`router.firstbyte`); then it is ejected and the request goes to another
  replica
- ``LLMGW_ROUTER_STALL_TIMEOUT``: seconds a replica whose requests wait may keep its
  work counters (``GET /metrics``: decode steps, prompt and predicted tokens) still
  before it is ejected as stalled (300; :mod:`router.firstbyte`)
- ``LLMGW_ROUTER_LOADING_HEARTBEAT``: seconds between the SSE comments a streaming
  request gets while its on-demand model loads (5; 0: none; :mod:`router.heartbeat`)
- ``LLMGW_ROUTER_MAX_CONNECTIONS_PER_REPLICA``: upstream connections per replica (64)
- ``LLMGW_ROUTER_MAX_CONNECTIONS``: upstream connections to all replicas together
  (0, the default: no cap beyond each replica's)
- ``LLMGW_ROUTER_MAX_REQUESTS``: requests the router holds at once, in flight
  and waiting for a slot, before it answers 503 ``router_overloaded`` (4096; 0: none;
  with ``LLMGW_ROUTER_WORKERS`` N, 1/N per worker: :func:`router.workers.share`)
- ``LLMGW_ROUTER_MAX_BODY_BYTES``: largest request body (100 MiB, what
  llama-server accepts; larger is 413 ``request_too_large``)
- ``LLMGW_ROUTER_MAX_BODIES_BYTES``: bytes of request bodies the router holds at
  once; past it 503 ``router_overloaded`` (0, the default: a quarter of the
  machine's or cgroup's memory, at most 1 GiB; :mod:`router.intake`; with N
  workers, 1/N per worker)
- ``LLMGW_ROUTER_HEADER_READ_TIMEOUT``: seconds a client has for its request line
  and headers, from its first byte (20; then 408, :mod:`router.serving`)
- ``LLMGW_ROUTER_BODY_READ_TIMEOUT`` / ``LLMGW_ROUTER_BODY_MIN_RATE``: seconds to
  the first bytes of a body, extended by one second per ``MIN_RATE`` bytes
  received (30 / 65536; then 408, :mod:`router.intake`)
- ``LLMGW_ROUTER_CORS_ORIGINS``: comma-separated origins browsers may call the
  router from (``*`` for any; default none: no CORS headers, no preflight)
- ``LLMGW_ROUTER_EJECT_AFTER_FAILURES`` / ``LLMGW_ROUTER_EJECT_AFTER_5XX``:
  consecutive connect errors (2) / 5xx answers (5) that
  eject a replica; ``LLMGW_ROUTER_EJECTION_BASE`` / ``LLMGW_ROUTER_EJECTION_MAX``:
  seconds of the first ejection and the longest (30 / 300; :mod:`router.outliers`)
- ``LLMGW_ROUTER_DRAIN_TIMEOUT``: seconds to let in-flight requests finish on shutdown (30)
- ``LLMGW_ROUTER_WORKERS``: router processes behind the one port (1; more share it
  with ``SO_REUSEPORT``, each with its own state: :mod:`router.workers`)
- ``LLMGW_PLANNER_URL``: a planner's admin API, for on-demand activation and
  usage reports (default ``http://127.0.0.1:4650``): tried after the leader
  Consul names, before the other passing ``llmgw-planner`` instances, which
  are called with its scheme (:mod:`router.planners`). ``none``: no fixed
  planner, only the leader and the instances Consul lists (called over https
  when ``LLMGW_PLANNER_CACERT`` is set, else http): what the router job runs with
- ``LLMGW_PLANNER_TOKEN``: bearer token for it (the planner's ``LLMGW_ADMIN_TOKEN``)
- ``LLMGW_ACTIVATION_WINDOW``: seconds a request for a loading model is held
  before 503 ``model_loading`` (45)
- ``LLMGW_USAGE_INTERVAL``: seconds between usage reports to the planner (10; at most 300)
- ``LLMGW_ACTIVATION``: ``0`` / ``false`` turns activation off: a model with no
  passing endpoint is refused at once, and no usage is reported (default on)
- ``LLMGW_REPLICA_CONCURRENCY``: requests in flight per replica; ``0`` (the
  default) reads each replica's slot count from llama-server's ``/props``
  (:mod:`router.capacity`)
- ``LLMGW_QUEUE_TIMEOUT``: seconds a request waits for a free slot when every
  replica of its model is at its limit, before 503 ``replicas_busy`` (30)
- ``LLMGW_ROUTING``: ``least-outstanding`` (default) or ``prefix``: requests whose
  prompts start alike go to the same replica, within a bounded load
  (:mod:`router.prefix`)
- ``LLMGW_PREFIX_CHARS``: characters of the prompt that make the prefix key (100)
- ``LLMGW_PREFIX_LOAD_FACTOR``: how far above the mean load a replica may go
  before a prefix spills to the next one (1.25)
- ``LLMGW_API_KEYS_FILE``: YAML file of the router's API keys (SHA-256 digests,
  allowed models); unset: no keys asked for (:mod:`router.keys`)
- ``LLMGW_API_KEYS_CONSUL``: ``true`` reads the API keys (the keys file's format)
  from the Consul KV key ``llmgw-router/api-keys`` and follows it (:mod:`router.keys`);
  not with ``LLMGW_API_KEYS_FILE``
- ``LLMGW_FORWARD_AUTHORIZATION``: ``true`` sends the client's ``Authorization``
  header on to the replica (default: dropped, it is the router's key)
- ``LLMGW_ROUTER_ACCOUNTING``: ``false`` turns token accounting off: no usage is
  read or asked for, no per-key series (default on; :mod:`router.accounting`)
- ``LLMGW_ROUTER_SHARED_LIMITS``: ``false`` counts the API keys' requests per
  minute and token budgets in each router alone (a key gets up to R times its
  limits from R routers); default on: counted in Consul KV under
  ``llmgw-router/limits/`` for every router together, which needs ``key_prefix
  "llmgw-router/limits/" write`` (:mod:`router.limits`)
- ``LLMGW_ROUTER_ASK_STREAM_USAGE``: ``true`` adds ``stream_options.include_usage``
  to streams whose client did not ask, and strips that usage event from what the
  client gets: for engines that send no llama-server ``timings`` (default off: on
  llama-server it moves the last event's ``timings`` into the stripped event)

The Consul and TLS variables keep the names the ``consul`` CLI reads. Every
configured certificate file (CAs, the client and the serving certificate; keys
are not certificates) is published as expiry metrics
(:mod:`llmgw_contract.certificates`). :meth:`RouterSettings.validate` loads each
configured file once, so a missing file, one that is not PEM, or a key without
its certificate is a ``ValueError`` naming the variable at start;
:func:`llmgw_contract.tlsfiles.tls_context` is the one place the router builds an
``ssl.SSLContext``.
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llmgw_contract.documents import MAX_USAGE_INTERVAL_S
from llmgw_contract.tlsfiles import tls_context
from router.keys import ApiKeys

DEFAULT_CONSUL_ADDR = "127.0.0.1:8500"
DEFAULT_PLANNER_URL = "http://127.0.0.1:4650"
# LLMGW_PLANNER_URL's word for "no fixed planner URL" (an empty variable is unset).
NO_PLANNER_URL = "none"
# The replica choices: router.balancer's least-outstanding, router.prefix's prefix.
ROUTINGS = ("least-outstanding", "prefix")

CONSUL_TLS_VARS = ("CONSUL_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY")
PLANNER_TLS_VARS = ("LLMGW_PLANNER_CACERT", "", "")
SERVING_TLS_VARS = ("", "--tls-cert (LLMGW_TLS_CERT)", "--tls-key (LLMGW_TLS_KEY)")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything the router can be told. Durations are seconds, sizes bytes."""

    host: str = "127.0.0.1"
    port: int = 8080
    consul_addr: str = DEFAULT_CONSUL_ADDR
    consul_token: str | None = field(default=None, repr=False)
    # TLS to Consul, under the names the `consul` CLI reads.
    consul_ssl: bool = False
    consul_cacert: str | None = None
    consul_client_cert: str | None = None
    consul_client_key: str | None = None
    # The router's own HTTPS, and the CA that verifies an https:// planner.
    tls_cert: str | None = None
    tls_key: str | None = None
    planner_cacert: str | None = None
    # Consul caps a blocking query at 10 minutes; a shorter wait bounds how long
    # a silently dropped connection can hide a change from us.
    watch_wait_s: float = 60.0
    watch_backoff_max_s: float = 10.0
    upstream_connect_timeout_s: float = 5.0
    # A non-streaming completion sends nothing until generation ends, so this is
    # "longest generation we tolerate", not a network timeout.
    upstream_read_timeout_s: float = 600.0
    # Bounds a request until its first byte (a non-streaming one's whole
    # generation) only when the replica also fails its /health probe, started
    # half of it (at most 5 s) before: a wedged replica costs one request at
    # most this long (issue 21 asks for its answer within 15 s).
    first_byte_timeout_s: float = 10.0
    # Longer than any batch step we expect: one 8k-token step on a CPU takes minutes.
    stall_timeout_s: float = 300.0
    # SSE comments to a streaming request waiting for its model to load; 0: none.
    loading_heartbeat_s: float = 5.0
    # Per replica, not one pool for all: one busy model's connections never
    # keep another's requests waiting. Above any replica's slot count, so the
    # per-replica limit (router.admission) binds first.
    max_connections_per_replica: int = 64
    max_connections: int = 0
    max_requests: int = 4096
    # What llama-server accepts: cpp-httplib's CPPHTTPLIB_PAYLOAD_MAX_LENGTH,
    # measured on the bootstrap's build (100 MiB answered, 1 byte more 413).
    max_body_bytes: int = 100 * 1024 * 1024
    # Bytes of bodies held at once; 0: router.intake.default_budget().
    max_bodies_bytes: int = 0
    # Read timeouts (router.serving, router.intake): Apache mod_reqtimeout's
    # shape; its defaults are header=20-40,MinRate=500 body=20,MinRate=500. A
    # rate floor of 64 KiB/s lets a 100 MiB body take up to ~27 min.
    header_read_timeout_s: float = 20.0
    body_read_timeout_s: float = 30.0
    body_min_rate: float = 64 * 1024
    # Browser origins allowed (CORS); "*" for any.
    cors_origins: tuple[str, ...] = ()
    # Passive outlier ejection (router.outliers; Envoy's defaults but the first).
    eject_after_failures: int = 2
    eject_after_5xx: int = 5
    ejection_base_s: float = 30.0
    ejection_max_s: float = 300.0
    # Replicas tried per request when a connection fails before any byte went out.
    max_attempts: int = 3
    drain_timeout_s: float = 30.0
    # How often a busy model's replicas are asked what every router has in flight on
    # them (router.replicaload); 0: balance on this router's own counts only.
    shared_load_interval_s: float = 0.1
    # Processes behind the one port (router.workers); 1: this process serves.
    workers: int = 1
    access_log: bool = False
    log_level: str = "info"
    # On-demand activation (router.activation) and usage reports (router.usage).
    activation: bool = True
    planner_url: str = DEFAULT_PLANNER_URL
    planner_token: str | None = field(default=None, repr=False)
    # A 40 s wait is a slow request; a 15 min wait is a job pretending to be one.
    activation_window_s: float = 45.0
    # The planner waits up to ~2 s for its placement answer; this bounds the
    # rest (a planner that accepts connections but hangs).
    activate_timeout_s: float = 5.0
    usage_interval_s: float = 10.0
    # Per-replica concurrency (router.admission, router.capacity). 0: each
    # replica's llama-server slot count, from GET /props.
    replica_concurrency: int = 0
    # The limit until /props answered, or when it cannot: llama-server's own
    # default slot count ("auto" = 4, tools/server/server.cpp).
    default_replica_concurrency: int = 4
    props_timeout_s: float = 5.0
    # Long enough to ride out a burst (a slot frees whenever one generation
    # ends), short enough that a client hears "busy" rather than hanging.
    queue_timeout_s: float = 30.0
    # Retry-After of a replicas_busy refusal.
    busy_retry_after_s: int = 2
    # How a replica is chosen: ROUTINGS. The prefix defaults are KubeAI's
    # PrefixHash ones (prefixCharLength 100, meanLoadPercentage 125).
    routing: str = "least-outstanding"
    prefix_chars: int = 100
    prefix_load_factor: float = 1.25
    # Router API keys (router.keys); None: none asked for.
    api_keys_file: str | None = None
    api_keys_consul: bool = False
    forward_authorization: bool = False
    # Token accounting (router.accounting).
    accounting: bool = True
    ask_stream_usage: bool = False
    # Per-key limits counted in Consul for every router (router.limits).
    shared_limits: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouterSettings:
        """Build settings from ``env`` (default ``os.environ``).

        Raises ``ValueError`` when a numeric variable does not parse.
        """
        env = os.environ if env is None else env
        base = cls()
        overrides: dict[str, Any] = {}
        if env.get("CONSUL_HTTP_ADDR"):
            overrides["consul_addr"] = env["CONSUL_HTTP_ADDR"]
        if env.get("CONSUL_HTTP_TOKEN"):
            overrides["consul_token"] = env["CONSUL_HTTP_TOKEN"]
        if env.get("CONSUL_HTTP_SSL"):
            overrides["consul_ssl"] = _flag("CONSUL_HTTP_SSL", env["CONSUL_HTTP_SSL"])
        if env.get("LLMGW_PLANNER_TOKEN"):
            overrides["planner_token"] = env["LLMGW_PLANNER_TOKEN"]
        if env.get("LLMGW_FORWARD_AUTHORIZATION"):
            overrides["forward_authorization"] = _flag(
                "LLMGW_FORWARD_AUTHORIZATION", env["LLMGW_FORWARD_AUTHORIZATION"]
            )
        if env.get("LLMGW_ROUTER_ACCOUNTING"):
            overrides["accounting"] = _flag(
                "LLMGW_ROUTER_ACCOUNTING", env["LLMGW_ROUTER_ACCOUNTING"]
            )
        if env.get("LLMGW_ROUTER_ASK_STREAM_USAGE"):
            overrides["ask_stream_usage"] = _flag(
                "LLMGW_ROUTER_ASK_STREAM_USAGE", env["LLMGW_ROUTER_ASK_STREAM_USAGE"]
            )
        if env.get("LLMGW_ROUTER_SHARED_LIMITS"):
            overrides["shared_limits"] = _flag(
                "LLMGW_ROUTER_SHARED_LIMITS", env["LLMGW_ROUTER_SHARED_LIMITS"]
            )
        if env.get("LLMGW_API_KEYS_CONSUL"):
            overrides["api_keys_consul"] = _flag(
                "LLMGW_API_KEYS_CONSUL", env["LLMGW_API_KEYS_CONSUL"]
            )
        if env.get("LLMGW_ROUTER_CORS_ORIGINS"):
            overrides["cors_origins"] = _origins(env["LLMGW_ROUTER_CORS_ORIGINS"])
        if env.get("LLMGW_ACTIVATION"):
            overrides["activation"] = _flag("LLMGW_ACTIVATION", env["LLMGW_ACTIVATION"])
        for var, name, kind in _ENV_FIELDS:
            raw = env.get(var)
            if raw:
                try:
                    overrides[name] = kind(raw)
                except ValueError as exc:
                    raise ValueError(f"{var}={raw!r} is not a valid {kind.__name__}") from exc
        return replace(base, **overrides)

    def with_overrides(self, **changes: Any) -> RouterSettings:
        """Return a copy with every non-``None`` keyword applied (CLI flags)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def validate(self) -> None:
        """Raise ``ValueError`` for settings the router cannot start with; loads every
        configured TLS file once."""
        self.consul_location()
        if self.consul_cacert or self.consul_client_cert or self.consul_client_key:
            self._consul_tls()
        if self.planner_cacert:
            self._planner_tls()
        if self.tls_cert or self.tls_key:
            tls_context(SERVING_TLS_VARS, None, self.tls_cert, self.tls_key, server=True)
        planner = urllib.parse.urlsplit(self.fixed_planner_url or "http://consul")
        if self.activation and (planner.scheme not in ("http", "https") or not planner.hostname):
            raise ValueError(
                f"planner URL {self.planner_url!r} is not an http(s):// URL "
                f"or {NO_PLANNER_URL!r} (LLMGW_PLANNER_URL)"
            )
        if self.activation_window_s < 0:
            raise ValueError("the activation window must be >= 0 s")
        if not 0 < self.usage_interval_s <= MAX_USAGE_INTERVAL_S:
            # The planner refuses a report outside these bounds (llmgw_contract).
            raise ValueError(
                f"the usage interval must be > 0 s and at most {MAX_USAGE_INTERVAL_S:g} s"
            )
        if self.replica_concurrency < 0 or self.default_replica_concurrency < 1:
            raise ValueError(
                "the replica concurrency must be >= 0 (0: from /props) and its default >= 1"
            )
        if self.queue_timeout_s < 0:
            raise ValueError("the queue timeout must be >= 0 s")
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"routing {self.routing!r} is not one of {', '.join(ROUTINGS)} (LLMGW_ROUTING)"
            )
        if self.prefix_chars < 1 or self.prefix_load_factor < 1.0:
            raise ValueError("LLMGW_PREFIX_CHARS must be >= 1 and LLMGW_PREFIX_LOAD_FACTOR >= 1.0")
        if self.api_keys_file and self.api_keys_consul:
            raise ValueError(
                "API keys come from LLMGW_API_KEYS_FILE or LLMGW_API_KEYS_CONSUL, not both"
            )
        if self.api_keys_file:
            ApiKeys.load(self.api_keys_file)
        if self.workers < 1:
            raise ValueError("LLMGW_ROUTER_WORKERS must be >= 1")
        if self.first_byte_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("the first-byte and stall timeouts must be > 0 s")
        if self.loading_heartbeat_s < 0:
            raise ValueError("the loading heartbeat must be >= 0 s (0: none)")
        if self.shared_load_interval_s < 0:
            raise ValueError("LLMGW_ROUTER_SHARED_LOAD_INTERVAL must be >= 0 s (0: off)")
        if self.max_connections_per_replica < 1 or self.max_connections < 0:
            raise ValueError(
                "max connections per replica must be >= 1 and max connections >= 0 (0: no cap)"
            )
        if self.max_requests < 0 or self.max_body_bytes < 1:
            raise ValueError("max requests must be >= 0 (0: no limit) and max body bytes >= 1")
        if self.max_bodies_bytes < 0:
            raise ValueError("max bodies bytes must be >= 0 (0: from the machine's memory)")
        if self.header_read_timeout_s <= 0 or self.body_read_timeout_s <= 0:
            raise ValueError("the header and body read timeouts must be > 0 s")
        if self.body_min_rate <= 0:
            raise ValueError("the body minimum rate must be > 0 bytes/s")
        if self.eject_after_failures < 1 or self.eject_after_5xx < 1:
            raise ValueError("the ejection thresholds must be >= 1")
        if not 0 < self.ejection_base_s <= self.ejection_max_s:
            raise ValueError("ejection times must satisfy 0 < base <= max")
        for origin in self.cors_origins:
            parsed = urllib.parse.urlsplit(origin)
            if origin != "*" and (parsed.scheme not in ("http", "https") or not parsed.netloc):
                raise ValueError(
                    f"CORS origin {origin!r} is not '*' or scheme://host[:port] "
                    f"(e.g. https://app.example.com)"
                )

    @property
    def initial_replica_limit(self) -> int:
        """The limit a replica starts with: the operator's, else the default until
        its ``/props`` answers."""
        limit = self.replica_concurrency or self.default_replica_concurrency
        # More in flight than connections would queue in aiohttp's pool, unbounded.
        return min(limit, self.max_connections_per_replica)

    def consul_location(self) -> tuple[str, str, int]:
        """Split ``consul_addr`` into ``(scheme, host, port)``; the scheme is ``https``
        when the address says so or ``consul_ssl`` is set.

        Raises ``ValueError`` for an address without a host.
        """
        raw = self.consul_addr if "//" in self.consul_addr else "//" + self.consul_addr
        parsed = urllib.parse.urlsplit(raw)
        if not parsed.hostname:
            raise ValueError(f"consul address {self.consul_addr!r} has no host")
        scheme = "https" if self.consul_ssl else parsed.scheme or "http"
        port = parsed.port or (443 if scheme == "https" else 8500)
        return scheme, parsed.hostname, port

    def consul_ssl_context(self) -> ssl.SSLContext | None:
        """The context for an https Consul (``None`` for plain HTTP)."""
        return self._consul_tls() if self.consul_location()[0] == "https" else None

    @property
    def fixed_planner_url(self) -> str | None:
        """The configured planner URL; ``None`` for ``none`` (or empty): no fixed one."""
        url = self.planner_url.strip()
        return None if url.lower() in ("", NO_PLANNER_URL) else url

    @property
    def planner_scheme(self) -> str:
        """The scheme the ``llmgw-planner`` instances Consul lists are called with: the
        fixed URL's; without one https when ``LLMGW_PLANNER_CACERT`` is set, else http."""
        if self.fixed_planner_url:
            return urllib.parse.urlsplit(self.fixed_planner_url).scheme or "http"
        return "https" if self.planner_cacert else "http"

    def planner_ssl_context(self) -> ssl.SSLContext | None:
        """The context for ``https://`` planners: for an https planner URL or a set
        ``LLMGW_PLANNER_CACERT`` (the leader's address comes from Consul and may be
        https while the URL is not); ``None``: the system's CAs, for any https one."""
        https = self.planner_scheme == "https"
        return self._planner_tls() if https or self.planner_cacert else None

    def certificate_files(self) -> list[str]:
        """The certificate files configured, for the certificate expiry metrics."""
        files = (self.consul_cacert, self.consul_client_cert, self.planner_cacert, self.tls_cert)
        return [path for path in files if path]

    def _consul_tls(self) -> ssl.SSLContext:
        return tls_context(
            CONSUL_TLS_VARS, self.consul_cacert, self.consul_client_cert, self.consul_client_key
        )

    def _planner_tls(self) -> ssl.SSLContext:
        return tls_context(PLANNER_TLS_VARS, self.planner_cacert)


_ENV_FIELDS: tuple[tuple[str, str, type], ...] = (
    ("CONSUL_CACERT", "consul_cacert", str),
    ("CONSUL_CLIENT_CERT", "consul_client_cert", str),
    ("CONSUL_CLIENT_KEY", "consul_client_key", str),
    ("LLMGW_TLS_CERT", "tls_cert", str),
    ("LLMGW_TLS_KEY", "tls_key", str),
    ("LLMGW_PLANNER_CACERT", "planner_cacert", str),
    ("LLMGW_ROUTER_HOST", "host", str),
    ("LLMGW_ROUTER_PORT", "port", int),
    ("LLMGW_ROUTER_UPSTREAM_CONNECT_TIMEOUT", "upstream_connect_timeout_s", float),
    ("LLMGW_ROUTER_UPSTREAM_READ_TIMEOUT", "upstream_read_timeout_s", float),
    ("LLMGW_ROUTER_MAX_CONNECTIONS", "max_connections", int),
    ("LLMGW_ROUTER_MAX_CONNECTIONS_PER_REPLICA", "max_connections_per_replica", int),
    ("LLMGW_ROUTER_FIRST_BYTE_TIMEOUT", "first_byte_timeout_s", float),
    ("LLMGW_ROUTER_STALL_TIMEOUT", "stall_timeout_s", float),
    ("LLMGW_ROUTER_LOADING_HEARTBEAT", "loading_heartbeat_s", float),
    ("LLMGW_ROUTER_MAX_REQUESTS", "max_requests", int),
    ("LLMGW_ROUTER_MAX_BODY_BYTES", "max_body_bytes", int),
    ("LLMGW_ROUTER_MAX_BODIES_BYTES", "max_bodies_bytes", int),
    ("LLMGW_ROUTER_HEADER_READ_TIMEOUT", "header_read_timeout_s", float),
    ("LLMGW_ROUTER_BODY_READ_TIMEOUT", "body_read_timeout_s", float),
    ("LLMGW_ROUTER_BODY_MIN_RATE", "body_min_rate", float),
    ("LLMGW_ROUTER_EJECT_AFTER_FAILURES", "eject_after_failures", int),
    ("LLMGW_ROUTER_EJECT_AFTER_5XX", "eject_after_5xx", int),
    ("LLMGW_ROUTER_EJECTION_BASE", "ejection_base_s", float),
    ("LLMGW_ROUTER_EJECTION_MAX", "ejection_max_s", float),
    ("LLMGW_ROUTER_DRAIN_TIMEOUT", "drain_timeout_s", float),
    ("LLMGW_ROUTER_SHARED_LOAD_INTERVAL", "shared_load_interval_s", float),
    ("LLMGW_ROUTER_WORKERS", "workers", int),
    ("LLMGW_PLANNER_URL", "planner_url", str),
    ("LLMGW_ACTIVATION_WINDOW", "activation_window_s", float),
    ("LLMGW_USAGE_INTERVAL", "usage_interval_s", float),
    ("LLMGW_REPLICA_CONCURRENCY", "replica_concurrency", int),
    ("LLMGW_QUEUE_TIMEOUT", "queue_timeout_s", float),
    ("LLMGW_ROUTING", "routing", str),
    ("LLMGW_PREFIX_CHARS", "prefix_chars", int),
    ("LLMGW_PREFIX_LOAD_FACTOR", "prefix_load_factor", float),
    ("LLMGW_API_KEYS_FILE", "api_keys_file", str),
)

# Ours, and Go's strconv.ParseBool spellings (t/f), which the `consul` CLI applies.
_TRUE = frozenset({"1", "true", "yes", "on", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "f"})


def _origins(raw: str) -> tuple[str, ...]:
    return tuple(o.strip().rstrip("/") for o in raw.split(",") if o.strip())


def _flag(var: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r} is not a boolean (1/0, true/false)")
