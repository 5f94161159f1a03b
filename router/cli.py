"""``router`` command line: ``router serve`` runs the router under uvicorn;
``router keys`` (:mod:`router.keyscli`) edits its API keys.

The console script ``router = "router.cli:main"`` and ``python -m router``
land here. Settings come from the environment (see :mod:`router.settings`)
and flags override them. Logs go to stderr; the command prints nothing to
stdout.

Exit codes: 0 after a clean shutdown (SIGINT/SIGTERM), 1 if the router could
not start (port in use, a failed startup), 2 for invalid settings (named on
stderr: a bad number, a TLS file that does not exist, a key without its
certificate) or a usage error, 3 when Consul denies its ACL token
(``CONSUL_HTTP_TOKEN``) a rule of acl/consul/router.hcl: the message names the
rule. The router asks Consul before it starts (:meth:`ConsulCatalog.denied`);
a Consul it cannot reach then is no reason not to start (the watches retry, and
a 403 they meet later is logged naming the rule).

TLS: ``--tls-cert``/``--tls-key`` (``LLMGW_TLS_CERT``/``LLMGW_TLS_KEY``) serve
HTTPS (uvicorn's ``ssl_certfile``/``ssl_keyfile``); the Consul and planner
clients' TLS comes from the environment (:mod:`router.settings`).

Shutdown runs in named steps: stop accepting connections, drain the open
ones (up to ``--drain-timeout`` seconds; a second signal forces exit), then
the app's lifespan cancels the Consul watches, stops the usage reports and
activate calls, and closes the upstream pool.

Activation (``--planner-url``, ``--planner-token``, ``--activation-window``,
``--usage-interval``, ``--no-activation``) is described in
:mod:`router.activation`; prefer ``LLMGW_PLANNER_TOKEN`` to the flag, which
shows in the process list. The per-replica limit and the wait for a free slot
(``--replica-concurrency``, ``--queue-timeout``) are described in
:mod:`router.admission` and :mod:`router.capacity`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType
from typing import Annotated

import typer
import uvicorn

from llmgw_contract.acl import (
    ROUTER_CONSUL_KEYS_NEEDS,
    ROUTER_CONSUL_LIMITS_NEEDS,
    ROUTER_CONSUL_NEEDS,
)
from router import collector, heap
from router import workers as router_workers
from router.app import create_app
from router.catalog import ConsulCatalog
from router.errors import CatalogUnavailable
from router.keyscli import keys_app
from router.serving import protocol_class
from router.settings import RouterSettings

log = logging.getLogger("router")

EXIT_CODES = (
    "Exit codes: 0 clean shutdown; 1 could not start; 2 invalid settings or usage; "
    "3 Consul denied the ACL token (CONSUL_HTTP_TOKEN) a rule the router needs "
    "(acl/consul/router.hcl; the message names it)."
)

cli = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="llmgw router: OpenAI-compatible proxy to llama-server replicas found in Consul."
    f"\n\n`router serve`: {EXIT_CODES}\n\n`router keys`: adds, rotates, removes and lists "
    "API keys and shows their usage (its exit codes: router keys --help).",
)
cli.add_typer(keys_app, name="keys")


class _Server(uvicorn.Server):
    """uvicorn's server, naming the shutdown steps in the log."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info(
            "shutdown: stop accepting; draining %d open connection(s) for up to %ss",
            len(self.server_state.connections),
            self.config.timeout_graceful_shutdown,
        )
        await super().shutdown(sockets)


def configure_logging(level: str) -> None:
    """Send every logger, uvicorn's included, to stderr in one format."""
    worker = router_workers.worker_index()
    where = "" if worker is None else f"worker {worker} "
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s",
        force=True,
    )


@cli.callback()
def _root() -> None:
    """llmgw router."""


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Listen host (env LLMGW_ROUTER_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (env LLMGW_ROUTER_PORT).")] = None,
    consul_addr: Annotated[
        str | None, typer.Option(help="Consul HTTP address host:port (env CONSUL_HTTP_ADDR).")
    ] = None,
    upstream_connect_timeout: Annotated[
        float | None, typer.Option(help="Seconds to connect to a replica.")
    ] = None,
    upstream_read_timeout: Annotated[
        float | None, typer.Option(help="Seconds a replica may stay silent.")
    ] = None,
    drain_timeout: Annotated[
        float | None, typer.Option(help="Seconds to let requests finish on shutdown.")
    ] = None,
    planner_url: Annotated[
        str | None,
        typer.Option(
            help="Planner admin API for activation, tried after the leader Consul names "
            "and before the other planners; 'none': no fixed one (env LLMGW_PLANNER_URL)."
        ),
    ] = None,
    planner_token: Annotated[
        str | None,
        typer.Option(help="Bearer token for the planner (env LLMGW_PLANNER_TOKEN)."),
    ] = None,
    activation_window: Annotated[
        float | None,
        typer.Option(
            help="Seconds to hold a request for a loading model (env "
            "LLMGW_ACTIVATION_WINDOW, default 45)."
        ),
    ] = None,
    usage_interval: Annotated[
        float | None,
        typer.Option(
            help="Seconds between usage reports to the planner (env "
            "LLMGW_USAGE_INTERVAL, default 10)."
        ),
    ] = None,
    activation: Annotated[
        bool | None,
        typer.Option(
            "--activation/--no-activation",
            help="Ask the planner to start a model with no endpoint (env LLMGW_ACTIVATION; "
            "default on). Off: refuse at once, report no usage.",
        ),
    ] = None,
    replica_concurrency: Annotated[
        int | None,
        typer.Option(
            help="Requests in flight per replica (env LLMGW_REPLICA_CONCURRENCY); 0, the "
            "default: each replica's slot count from llama-server's /props (4 until known)."
        ),
    ] = None,
    queue_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds a request waits for a free slot when every replica is at its "
            "limit, then 503 replicas_busy (env LLMGW_QUEUE_TIMEOUT, default 30)."
        ),
    ] = None,
    routing: Annotated[
        str | None,
        typer.Option(
            help="How a replica is chosen (env LLMGW_ROUTING): least-outstanding (the "
            "default), or prefix: requests sharing a prompt prefix go to the same replica, "
            "within a bounded load (llama-server reuses its prompt cache)."
        ),
    ] = None,
    api_keys_file: Annotated[
        str | None,
        typer.Option(
            help="YAML file of the router's API keys (SHA-256 digests and allowed models; "
            "env LLMGW_API_KEYS_FILE). Unset: no key asked for."
        ),
    ] = None,
    api_keys_consul: Annotated[
        bool | None,
        typer.Option(
            "--api-keys-consul/--no-api-keys-consul",
            help="Read the API keys (the keys file's format) from Consul KV "
            "llmgw-router/api-keys and follow it (env LLMGW_API_KEYS_CONSUL; the token "
            'needs key "llmgw-router/api-keys" read).',
        ),
    ] = None,
    first_byte_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds to a replica's first byte before, failing GET /health, it is "
            "ejected and the request goes to another replica "
            "(env LLMGW_ROUTER_FIRST_BYTE_TIMEOUT, 10)."
        ),
    ] = None,
    stall_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds a replica with requests waiting may keep its work counters "
            "(GET /metrics) still before it is ejected as stalled "
            "(env LLMGW_ROUTER_STALL_TIMEOUT, 300)."
        ),
    ] = None,
    loading_heartbeat: Annotated[
        float | None,
        typer.Option(
            help="Seconds between SSE comments to a stream waiting for its model to load; "
            "0: none (env LLMGW_ROUTER_LOADING_HEARTBEAT, 5)."
        ),
    ] = None,
    shared_load_interval: Annotated[
        float | None,
        typer.Option(
            help="Seconds between reads of a busy model's replicas' /metrics, for what the "
            "other routers have in flight there; 0: balance on this router's own counts "
            "(env LLMGW_ROUTER_SHARED_LOAD_INTERVAL, 0.1)."
        ),
    ] = None,
    max_connections_per_replica: Annotated[
        int | None,
        typer.Option(
            help="Upstream connections per replica "
            "(env LLMGW_ROUTER_MAX_CONNECTIONS_PER_REPLICA, 64)."
        ),
    ] = None,
    max_requests: Annotated[
        int | None,
        typer.Option(
            help="Requests held at once before 503 router_overloaded "
            "(env LLMGW_ROUTER_MAX_REQUESTS, 4096; 0: no limit; with --workers N, 1/N each)."
        ),
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option(help="Largest request body (env LLMGW_ROUTER_MAX_BODY_BYTES, 100 MiB)."),
    ] = None,
    max_bodies_bytes: Annotated[
        int | None,
        typer.Option(
            help="Bytes of request bodies held at once before 503 router_overloaded (env "
            "LLMGW_ROUTER_MAX_BODIES_BYTES; 0, the default: a quarter of the memory, at "
            "most 1 GiB; with --workers N, 1/N each)."
        ),
    ] = None,
    header_read_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds for a request line and headers, then 408 (env "
            "LLMGW_ROUTER_HEADER_READ_TIMEOUT, 20)."
        ),
    ] = None,
    body_read_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds to a body's first bytes, plus 1 s per LLMGW_ROUTER_BODY_MIN_RATE "
            "bytes received (64 KiB), then 408 (env LLMGW_ROUTER_BODY_READ_TIMEOUT, 30)."
        ),
    ] = None,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="A browser origin allowed to call the router, e.g. https://app.example.com "
            "or '*'; repeat for more (env LLMGW_ROUTER_CORS_ORIGINS, comma-separated)."
        ),
    ] = None,
    tls_cert: Annotated[
        str | None,
        typer.Option(help="Serve HTTPS with this PEM certificate (env LLMGW_TLS_CERT)."),
    ] = None,
    tls_key: Annotated[
        str | None, typer.Option(help="Its PEM private key (env LLMGW_TLS_KEY).")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Router processes sharing the port with SO_REUSEPORT, each with its own "
            "state and /metrics (env LLMGW_ROUTER_WORKERS, 1; docs/router.md#workers)."
        ),
    ] = None,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve the OpenAI-compatible API until SIGINT/SIGTERM.

    Exit codes: 0 clean shutdown, 1 could not start, 2 invalid settings or usage,
    3 Consul denied the ACL token (CONSUL_HTTP_TOKEN) a rule the router needs
    (acl/consul/router.hcl; the message names it).
    """
    configure_logging(log_level)
    try:
        settings = RouterSettings.from_env().with_overrides(
            host=host,
            port=port,
            consul_addr=consul_addr,
            upstream_connect_timeout_s=upstream_connect_timeout,
            upstream_read_timeout_s=upstream_read_timeout,
            drain_timeout_s=drain_timeout,
            planner_url=planner_url,
            planner_token=planner_token,
            activation_window_s=activation_window,
            usage_interval_s=usage_interval,
            activation=activation,
            replica_concurrency=replica_concurrency,
            queue_timeout_s=queue_timeout,
            routing=routing,
            api_keys_file=api_keys_file,
            api_keys_consul=api_keys_consul,
            first_byte_timeout_s=first_byte_timeout,
            stall_timeout_s=stall_timeout,
            loading_heartbeat_s=loading_heartbeat,
            shared_load_interval_s=shared_load_interval,
            max_connections_per_replica=max_connections_per_replica,
            max_requests=max_requests,
            max_body_bytes=max_body_bytes,
            max_bodies_bytes=max_bodies_bytes,
            header_read_timeout_s=header_read_timeout,
            body_read_timeout_s=body_read_timeout,
            cors_origins=tuple(o.rstrip("/") for o in cors_origin) if cors_origin else None,
            tls_cert=tls_cert,
            tls_key=tls_key,
            workers=workers,
            access_log=access_log,
            log_level=log_level,
        )
        settings.validate()
    except ValueError as exc:
        log.error("invalid settings: %s", exc)
        raise typer.Exit(2) from None
    try:
        denied = asyncio.run(_denied(settings))
    except CatalogUnavailable as exc:
        log.warning("could not check the Consul ACL token yet: %s; starting anyway", exc)
        denied = None
    if denied is not None:
        log.error("%s", denied)
        raise typer.Exit(3)
    worker = router_workers.worker_index()
    if settings.workers > 1 and worker is None:
        api_keys = bool(settings.api_keys_file or settings.api_keys_consul)
        for warning in router_workers.shared_state_warnings(
            settings.workers, api_keys, settings.shared_limits
        ):
            log.warning("%s", warning)
        raise typer.Exit(router_workers.supervise(settings.workers))
    # Large bodies mapped on their own, freed heap memory handed back (router.heap).
    heap.tune()
    app = create_app(settings)
    # Startup objects out of the cycle collector's full walks (router.collector).
    collector.freeze()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        # httptools, with a header-read timeout and a header size bound.
        http=protocol_class(settings.header_read_timeout_s),
        lifespan="on",
        access_log=settings.access_log,
        log_config=None,
        log_level=settings.log_level,
        server_header=False,
        # Nothing reads the client address, and the header rewrite costs on
        # every request.
        proxy_headers=False,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        backlog=2048,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
    )
    server = _Server(config)
    # uvicorn restores these after its graceful shutdown and re-raises the
    # signal it caught; ending with status 0 tells a supervisor (Nomad) that
    # the stop was clean rather than "killed by SIGTERM".
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    if worker is None:
        server.run()
    else:
        # One of --workers: the port is shared with the others (router.workers).
        try:
            sock = router_workers.listen_socket(settings.host, settings.port)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
            raise typer.Exit(1) from None
        server.run(sockets=[sock])
    # uvicorn reports a failed startup (port in use, lifespan error) by
    # returning with started still False.
    if not server.started:
        raise typer.Exit(1)


async def _denied(settings: RouterSettings) -> str | None:
    """What Consul denies the router's token of acl/consul/router.hcl (None: nothing)."""
    scheme, host, port = settings.consul_location()
    catalog = ConsulCatalog(
        f"{scheme}://{host}:{port}", settings.consul_token, settings.consul_ssl_context()
    )
    try:
        needs = ROUTER_CONSUL_NEEDS + (ROUTER_CONSUL_KEYS_NEEDS if settings.api_keys_consul else ())
        if settings.shared_limits and (settings.api_keys_file or settings.api_keys_consul):
            needs += ROUTER_CONSUL_LIMITS_NEEDS
        return await catalog.denied(needs)
    finally:
        await catalog.close()


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
