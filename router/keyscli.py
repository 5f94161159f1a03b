"""``router keys``: add, rotate, remove and list the router's API keys, and show what
each has used of its limits.

Registered beside ``router serve`` by :mod:`router.cli`. The keys live where the
router reads them (:mod:`router.keys`): the keys file (``--file PATH``, env
``LLMGW_API_KEYS_FILE``) or Consul KV ``llmgw-router/api-keys`` (``--consul``, env
``LLMGW_API_KEYS_CONSUL``; Consul's address, token and TLS from the router's
variables, ``CONSUL_HTTP_ADDR``, ``CONSUL_HTTP_TOKEN``, ``CONSUL_CACERT``...,
and ``--consul-addr``). Edits go through :func:`router.keystore.edit`: checked by
the router's own loader before anything is written, and never over another
operator's write. A running router takes the change on its next read (a file:
within 5 s; Consul: within a blocking query's round trip).

A new key is 256 random bits (:func:`secrets.token_urlsafe`), ``sk-`` first as
OpenAI's keys; it is printed once, on stdout, and only its SHA-256 is stored.
``usage`` reads the per-key tallies every router shares in Consul
(:mod:`router.sharedlimits`), whichever store holds the keys.

Data goes to stdout (a table, or JSON with ``--output json``), messages to stderr.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
import time
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from router.keys import LIMIT_FIELDS, ApiKey, ApiKeys, digest
from router.keystore import (
    AlreadyExists,
    ConsulStore,
    Entry,
    FileStore,
    InvalidInput,
    KeysCliError,
    KeyStore,
    NotFound,
    Stored,
    consul_client,
    edit,
    entries_of,
)
from router.limits import MINUTE_TOKENS, REQUESTS, budget_kind
from router.settings import RouterSettings
from router.windows import Period, Tally, window_of

EXIT_CODES = "\n".join(
    (
        "Exit codes:",
        "0  ok",
        "1  the key named, or the keys document (list, usage), is not there, or a key "
        "already is (add), or "
        "other writers changed the keys 5 times in a row while this edit was applied",
        "2  invalid input, named: a flag, a limit, a model pattern, a keys document the "
        "router would refuse, comments a rewrite would lose (--force), or usage",
        "3  Consul unreachable, or it denied CONSUL_HTTP_TOKEN a rule (named)",
    )
)

keys_app = typer.Typer(
    help="Add, rotate, remove and list the router's API keys (the keys file or Consul KV "
    "llmgw-router/api-keys), and show their usage of their limits. A new key's secret is "
    f"printed once; only its SHA-256 is stored.\n\n{EXIT_CODES}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Not a terminal: no colour, and rows never wrap.
_out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 100_000)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


class Output(StrEnum):
    table = "table"
    json = "json"


FileOption = Annotated[
    str | None,
    typer.Option("--file", help="The keys file (env LLMGW_API_KEYS_FILE)."),
]
ConsulOption = Annotated[
    bool,
    typer.Option(
        "--consul",
        help="Consul KV llmgw-router/api-keys (env LLMGW_API_KEYS_CONSUL; editing needs a "
        'token with key "llmgw-router/api-keys" write).',
    ),
]
ConsulAddrOption = Annotated[
    str | None,
    typer.Option(help="Consul HTTP address host:port (env CONSUL_HTTP_ADDR)."),
]
OutputOption = Annotated[Output, typer.Option("--output", "-o", help="table or json")]
ForceOption = Annotated[
    bool,
    typer.Option("--force", help="Rewrite a keys document that has comments (they are lost)."),
]
NameArgument = Annotated[str, typer.Argument(help="The key's name (logs, metrics, errors).")]


@keys_app.command()
def add(
    name: NameArgument,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--models",
            help="A model pattern the key may use (shell-style); repeat. Default: every model.",
        ),
    ] = None,
    requests_per_minute: Annotated[
        int | None, typer.Option(help="Requests per UTC minute, every router together.")
    ] = None,
    tokens_per_minute: Annotated[
        int | None, typer.Option(help="Prompt + completion tokens per UTC minute, together.")
    ] = None,
    concurrent_requests: Annotated[
        int | None, typer.Option(help="Requests in flight at once, per router.")
    ] = None,
    tokens_per_day: Annotated[
        int | None, typer.Option(help="A budget of tokens per UTC day, together.")
    ] = None,
    tokens_per_month: Annotated[
        int | None, typer.Option(help="A budget of tokens per UTC month (or per day).")
    ] = None,
    file: FileOption = None,
    consul: ConsulOption = False,
    consul_addr: ConsulAddrOption = None,
    force: ForceOption = False,
    output: OutputOption = Output.table,
) -> None:
    """Add a key: its secret is printed once (stdout), only its SHA-256 is stored."""
    limits = {
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
        "concurrent_requests": concurrent_requests,
        "tokens_per_day": tokens_per_day,
        "tokens_per_month": tokens_per_month,
    }
    secret = new_secret()
    entry: Entry = {"name": name, "sha256": digest(secret)}
    if models:
        entry["models"] = list(models)
    if any(value is not None for value in limits.values()):
        entry["limits"] = {k: v for k, v in limits.items() if v is not None}

    def change(entries: list[Entry]) -> list[Entry]:
        if any(e["name"] == name for e in entries):
            raise AlreadyExists(f"a key named {name!r} exists already: rotate or remove it")
        return [*entries, entry]

    with _reported(output):
        ApiKeys.check_entry(entry, "router keys add")
        store = _store(file, consul, consul_addr)
        edit(store, change, force)
        _told_once(output, "added", entry, secret, store)


@keys_app.command()
def rotate(
    name: NameArgument,
    file: FileOption = None,
    consul: ConsulOption = False,
    consul_addr: ConsulAddrOption = None,
    force: ForceOption = False,
    output: OutputOption = Output.table,
) -> None:
    """Give a key a new secret, printed once; the old one stops working."""
    secret = new_secret()
    rotated: Entry = {}

    def change(entries: list[Entry]) -> list[Entry]:
        found = _named(entries, name)
        rotated.clear()
        rotated.update(found, sha256=digest(secret))
        return [rotated if e is found else e for e in entries]

    with _reported(output):
        store = _store(file, consul, consul_addr)
        _existing(store)  # a missing file is named as such, not as a missing key
        edit(store, change, force)
        _told_once(output, "rotated", rotated, secret, store)


@keys_app.command()
def remove(
    name: NameArgument,
    file: FileOption = None,
    consul: ConsulOption = False,
    consul_addr: ConsulAddrOption = None,
    force: ForceOption = False,
    output: OutputOption = Output.table,
) -> None:
    """Remove a key: requests with its secret get 401 once the router read the change."""

    def change(entries: list[Entry]) -> list[Entry]:
        found = _named(entries, name)
        return [e for e in entries if e is not found]

    with _reported(output):
        store = _store(file, consul, consul_addr)
        _existing(store)  # a missing file is named as such, not as a missing key
        edit(store, change, force)
        if output is Output.json:
            print(json.dumps({"name": name, "removed": True, "store": store.where}, indent=2))
        _err.print(f"key {name!r} removed from {store.where}", markup=False)


@keys_app.command("list")
def list_keys(
    file: FileOption = None,
    consul: ConsulOption = False,
    consul_addr: ConsulAddrOption = None,
    output: OutputOption = Output.table,
) -> None:
    """The keys: names, models and limits (never a secret nor a digest)."""
    with _reported(output):
        store = _store(file, consul, consul_addr)
        shown = [_shown(e) for e in entries_of(_existing(store), store.where, force=True)]
        if output is Output.json:
            print(json.dumps(shown, indent=2))
            return
        table = Table("name", "models", "limits", box=None)
        for key in shown:
            limits = ", ".join(f"{k} {v}" for k, v in key["limits"].items()) or "none"
            table.add_row(key["name"], " ".join(key["models"]), limits)
        _out.print(table)


@keys_app.command()
def usage(
    name: Annotated[str | None, typer.Argument(help="One key (default: every key).")] = None,
    file: FileOption = None,
    consul: ConsulOption = False,
    consul_addr: ConsulAddrOption = None,
    output: OutputOption = Output.table,
) -> None:
    """What each key used of its limits in the current UTC windows, from Consul.

    As every router together counted it in Consul (llmgw-router/limits/). A window's
    `used` includes what routers leased and have not used yet (up to 5% of a per-minute
    limit, 1% of a budget, per router). Concurrent requests are per router: not counted
    there.
    """
    with _reported(output):
        settings = _settings(consul_addr)
        store = _store(file, consul, consul_addr, settings)
        stored = _existing(store)
        entries_of(stored, store.where, force=True)  # named errors for a bad document
        keys = ApiKeys.parse(stored.document or b"keys: []", store.where).by_name()
        if name is not None and name not in keys:
            raise NotFound(f"no key named {name!r} in {store.where}")
        counters = store if isinstance(store, ConsulStore) else _consul(settings)
        wall = time.time()
        report = [
            {
                "name": key.name,
                "limits": usage_of(key, counters.tallies(key.name) if key.limited else {}, wall),
            }
            for key in keys.values()
            if name is None or key.name == name
        ]
        if output is Output.json:
            print(json.dumps(report, indent=2))
            return
        _print_usage(report)


def _existing(store: KeyStore) -> Stored:
    """The document `list`, `usage`, `rotate` and `remove` read; NotFound when there is
    none, so that a mistyped --file is not shown as an empty set of keys, nor as a
    missing key (issue 23's QA)."""
    stored = store.read()
    if stored.document is None:
        raise NotFound(f"{store.where}: there is none (`router keys add` writes the first key)")
    return stored


def usage_of(key: ApiKey, tallies: dict[str, Tally], wall: float) -> list[dict[str, Any]]:
    """One row per limit of ``key``: ``{"limit", "value", "window", "used", "remaining",
    "resets_in_s", "shared"}`` from the key's ``tallies`` (by kind) at ``wall`` (seconds
    since the epoch). ``shared`` is false where no document exists: nothing counted yet
    in Consul (no request since the limit was set), or routers that count alone
    (LLMGW_ROUTER_SHARED_LIMITS=false). Concurrent requests: per router, ``used``
    ``None``."""
    rows: list[dict[str, Any]] = []
    counted: list[tuple[str, int | None, str, Period]] = [
        ("requests_per_minute", key.requests_per_minute, REQUESTS, Period.MINUTE),
        ("tokens_per_minute", key.tokens_per_minute, MINUTE_TOKENS, Period.MINUTE),
    ]
    if key.budget_tokens is not None and key.budget_period is not None:
        counted.append(
            (
                f"tokens_per_{key.budget_period}",
                key.budget_tokens,
                budget_kind(key.budget_period),
                Period(key.budget_period),
            )
        )
    for limit, value, kind, period in counted:
        if value is None:
            continue
        window, ends_in = window_of(period, wall)
        tally = tallies.get(kind)
        used = tally.used_in(window) if tally is not None else 0
        rows.append(
            {
                "limit": limit,
                "value": value,
                "window": window,
                "used": used,
                "remaining": max(0, value - used),
                "resets_in_s": round(ends_in, 1),
                "shared": tally is not None,
            }
        )
    if key.concurrent_requests is not None:
        rows.append(
            {
                "limit": "concurrent_requests",
                "value": key.concurrent_requests,
                "window": "per router",
                "used": None,
                "remaining": None,
                "resets_in_s": None,
                "shared": False,
            }
        )
    return rows


def new_secret() -> str:
    """A new key: ``sk-`` and 256 random bits, URL-safe base64 (43 characters)."""
    return "sk-" + secrets.token_urlsafe(32)


def _print_usage(report: list[dict[str, Any]]) -> None:
    table = Table("name", "limit", "window", "used", "of", "left", "resets in", box=None)
    notes: set[str] = set()
    for key in report:
        if not key["limits"]:
            table.add_row(key["name"], "none", "", "", "", "", "")
        for row in key["limits"]:
            if row["used"] is None:
                used = "per router"
                notes.add("concurrent requests are counted by each router, not in Consul")
            elif row["shared"]:
                used = str(row["used"])
            else:
                used = "0 (no document)"
                notes.add(
                    "no document: nothing counted in Consul yet for that limit (no request "
                    "since it was set), or routers running with "
                    "LLMGW_ROUTER_SHARED_LIMITS=false count alone, in memory"
                )
            resets = "" if row["resets_in_s"] is None else _span(row["resets_in_s"])
            left = "" if row["remaining"] is None else str(row["remaining"])
            table.add_row(
                key["name"], row["limit"], row["window"], used, str(row["value"]), left, resets
            )
    _out.print(table)
    for note in sorted(notes):
        _err.print(note, markup=False)


def _span(seconds: float) -> str:
    """``seconds`` for a person: ``36s``, ``12m5s``, ``3h20m``, ``29d11h``."""
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _named(entries: list[Entry], name: str) -> Entry:
    for entry in entries:
        if entry["name"] == name:
            return entry
    raise NotFound(f"no key named {name!r}")


def _shown(entry: Entry) -> dict[str, Any]:
    limits = entry.get("limits") or {}
    return {
        "name": entry["name"],
        "models": list(entry.get("models") or ["*"]),
        "limits": {k: limits[k] for k in LIMIT_FIELDS if limits.get(k) is not None},
    }


def _told_once(output: Output, done: str, entry: Entry, secret: str, store: KeyStore) -> None:
    """The secret, on stdout, once; what was done, on stderr."""
    if output is Output.json:
        print(json.dumps({**_shown(entry), "key": secret, "store": store.where}, indent=2))
    else:
        print(secret)
    _err.print(
        f"key {entry['name']!r} {done} in {store.where}. Its secret, above, is shown only "
        "this once: give it to its client now (only its SHA-256 is stored).",
        markup=False,
    )


def _settings(consul_addr: str | None) -> RouterSettings:
    try:
        settings = RouterSettings.from_env().with_overrides(consul_addr=consul_addr)
        settings.consul_location()
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    return settings


def _consul(settings: RouterSettings) -> ConsulStore:
    scheme, host, port = settings.consul_location()
    return ConsulStore(
        consul_client(
            host,
            port,
            scheme,
            settings.consul_token,
            settings.consul_cacert,
            settings.consul_client_cert,
            settings.consul_client_key,
        )
    )


def _store(
    file: str | None,
    consul: bool,
    consul_addr: str | None,
    settings: RouterSettings | None = None,
) -> FileStore | ConsulStore:
    """The store named by the flags, else by the router's environment."""
    settings = settings or _settings(consul_addr)
    if file and consul:
        raise InvalidInput("--file and --consul: name one store")
    if not file and not consul:
        file, consul = settings.api_keys_file, settings.api_keys_consul
        if file and consul:
            raise InvalidInput("LLMGW_API_KEYS_FILE and LLMGW_API_KEYS_CONSUL: name one store")
    if file:
        return FileStore(file)
    if consul:
        return _consul(settings)
    raise InvalidInput(
        "no keys store: pass --file PATH or --consul (or set LLMGW_API_KEYS_FILE or "
        "LLMGW_API_KEYS_CONSUL=true, as for the router)"
    )


@contextlib.contextmanager
def _reported(output: Output) -> Iterator[None]:
    """Turns a :class:`KeysCliError` (or a ``ValueError`` of the loader: invalid input)
    into its message on stderr, the JSON error on stdout with --output json (``{"error":
    {"kind", "message", "exit_code"}}``, as ``planner``'s), and the exit code."""
    try:
        yield
    except (KeysCliError, ValueError) as exc:
        failed = exc if isinstance(exc, KeysCliError) else InvalidInput(str(exc))
        _err.print(f"error: {failed}", markup=False)
        if output is Output.json:
            error = {
                "kind": type(failed).__name__,
                "message": str(failed),
                "exit_code": failed.exit_code,
            }
            print(json.dumps({"error": error}, indent=2))
        raise typer.Exit(failed.exit_code) from None
