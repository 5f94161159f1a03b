"""Optional router API keys: who may call the router, and for which models.

Off unless ``LLMGW_API_KEYS_FILE`` (``--api-keys-file``) names a YAML file::

    keys:
      - name: team-a                 # in logs and errors, never the key; 1-128 chars, one line
        sha256: 9f86d081884c7d65...  # printf %s "$KEY" | sha256sum
        models: ["gemma-3-270m", "team-a-*"]   # optional: shell patterns; default every model
      - name: ops
        sha256: ...
        limits:                      # optional (router.limits)
          requests_per_minute: 600   # every router together (per router: see router.limits)
          concurrent_requests: 8     # per router
          tokens_per_minute: 40000   # every router together: prompt + completion
          tokens_per_day: 2000000    # a budget (or tokens_per_month): prompt + completion

Only SHA-256 digests are stored, never a key: a file that leaks gives nobody
a key. A plain hash (no salt, no stretching) is enough because the keys are
random tokens an operator generates (``openssl rand -hex 32``), not
passwords a person picks: nothing guessable to look up. A request then needs
``Authorization: Bearer <key>`` (what the OpenAI SDKs send for ``api_key``):
without one, or with a key whose digest is not in the file, it gets 401
``invalid_api_key`` in OpenAI's error shape
(:class:`router.errors.InvalidApiKey`); a model the key may not use is
answered like one that does not exist, 404 ``model_not_found``, as OpenAI
does (:class:`router.errors.ModelNotAllowed`), and ``GET /v1/models`` lists
only the key's models. ``/health`` and ``/metrics`` stay open (probes and
Prometheus).

The client's ``Authorization`` header is not forwarded to replicas (it is the
router's key, not the replica's) unless ``LLMGW_FORWARD_AUTHORIZATION`` is
on (:mod:`router.settings`), keys or not.

Two sources, one format:

- a file (``LLMGW_API_KEYS_FILE``), read at start (:meth:`ApiKeys.load`, called
  by the app and by :meth:`router.settings.RouterSettings.validate`, so a bad
  file exits 2 naming the file, the entry's field and what was expected), then
  followed by :class:`KeysFile`: read every :data:`RELOAD_INTERVAL_S` and taken
  again when its content's SHA-256 changed (not its modification time and size:
  a same-size rewrite within the file system's timestamp granularity looked
  unchanged, issue 18);
- Consul KV (``LLMGW_API_KEYS_CONSUL``): the YAML document at
  :data:`llmgw_contract.ROUTER_API_KEYS_KEY` (``llmgw-router/api-keys``), written
  by an operator (``consul kv put llmgw-router/api-keys @keys.yaml``) and
  followed with a blocking query by :mod:`router.watch` into :class:`ConsulKeys`.
  It lies outside ``llmgw/``, so the planner's token (``key_prefix "llmgw/"
  write``) cannot give itself a key; the router needs ``key
  "llmgw-router/api-keys" read`` (acl/consul/router.hcl). Until the first read,
  requests get 503 ``router_starting``; with the key absent, no key is valid
  (401): the router never falls open.

Either way, a document that no longer loads is logged and the keys read before
stay in force, so a typo never locks every client out or lets everyone in.

``router keys`` (:mod:`router.keyscli`) adds, rotates, removes and lists keys in
either source, through :meth:`ApiKeys.parse`: what it writes is what the router
reads.

YAML 1.1, which PyYAML reads, takes ``on``, ``off``, ``yes``, ``no`` (any case)
for booleans, so a key named ``on`` was refused as "not a string". Keys
documents are read with :class:`_KeysLoader`, which takes only ``true`` and
``false`` for booleans (YAML 1.2's rule): ``name: on`` is the name ``on``. A name
YAML still reads as something else (``true``, ``42``, ``1.5``: the spelling
is lost) is refused with a message saying to quote it.

Model patterns are shell patterns (``fnmatch``) over model names, which are
``[a-z0-9-]`` (the planner's definitions refuse any other): a pattern with
another character (an upper-case letter, a space, a dot) can never match, so it
is refused as the mistake it is.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import fnmatch
import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Protocol

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmgw_contract import ROUTER_API_KEYS_KEY
from router import errors

log = logging.getLogger(__name__)


class _KeysLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only ``true`` and ``false``
    (not ``on``/``off``/``yes``/``no``), so such a key name stays a string."""


_KeysLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_KeysLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)

# The limits a key may carry, as the keys document spells them (router.limits).
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "concurrent_requests",
    "tokens_per_day",
    "tokens_per_month",
)
# What a model pattern may hold: a model name's characters (planner/spec/definitions.py
# NAME_PATTERN: [a-z0-9-]) and fnmatch's * ?, and whole classes [...] / [!...] of them.
# Anything else (a lone "[" or "!", fnmatch reads them as themselves) matches no model.
_PATTERN = re.compile(r"^(?:[a-z0-9*?-]|\[!?[a-z0-9-]+\])+$")

# The longest key name, in characters.
MAX_NAME_CHARS = 128
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# How often the keys file is read for a change.
RELOAD_INTERVAL_S = 5.0
# A keys file or KV document larger than this is refused (Consul's own KV limit is 512 KiB).
MAX_KEYS_BYTES = 4 * 1024 * 1024
BEARER = b"bearer "


class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(default=None, ge=1)
    concurrent_requests: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_day: int | None = Field(default=None, ge=1)
    tokens_per_month: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_budget(self) -> _Limits:
        if self.tokens_per_day is not None and self.tokens_per_month is not None:
            raise ValueError("a key has one budget: tokens_per_day or tokens_per_month, not both")
        return self


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A name is shown in logs, errors and metric labels: bounded, one printable line
    # (issue 23's QA: a name holding a newline was accepted, and would forge log lines).
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    sha256: str
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    limits: _Limits = Field(default_factory=_Limits)

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: object) -> object:
        if isinstance(value, bool | int | float | dt.date) or value is None:
            # The operator's spelling is lost (True or true? 1.50 or 1.5?): ask for quotes.
            raise ValueError(f"YAML reads this name as {value!r}, not as text: quote it")
        return value

    @field_validator("name")
    @classmethod
    def _printable(cls, value: str) -> str:
        # str.isprintable: no control (C0, C1), format (U+200B, U+202E), line or paragraph
        # separator (U+2028), nor a space but ' ': each would break a log line or hide
        # what a name says (issue 23's QA found U+2028 and U+200B accepted).
        if not value.isprintable():
            odd = next(c for c in value if not c.isprintable())
            raise ValueError(
                f"expected printable characters on one line; U+{ord(odd):04X} is not one"
            )
        if value != value.strip():
            # ' ops' and 'ops' would list alike and be told apart by no one (issue 22's
            # fourth QA found a leading space accepted).
            raise ValueError("expected no space at its start or end")
        return value

    @field_validator("models")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not _PATTERN.match(pattern):
                raise ValueError(
                    f"{pattern!r} can never match a model: a pattern holds a model name's "
                    "characters (a-z, 0-9, -), the shell wildcards * and ?, and classes "
                    "such as [a-c] or [!x]"
                )
        return value

    @field_validator("sha256")
    @classmethod
    def _digest(cls, value: str) -> str:
        value = value.strip().lower()
        if not _SHA256.match(value):
            raise ValueError(
                "expected the key's SHA-256 as 64 hex digits "
                '(printf %s "$KEY" | sha256sum), not the key itself'
            )
        return value


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[_KeyEntry]


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key's name, the model patterns it may use, and its limits (``None``: none).

    ``budget_tokens``: prompt and completion tokens the key may use per
    ``budget_period`` (``"day"`` or ``"month"``, UTC: :class:`router.windows.Period`).
    """

    name: str
    models: tuple[str, ...]
    requests_per_minute: int | None = None
    concurrent_requests: int | None = None
    budget_tokens: int | None = None
    budget_period: str | None = None
    tokens_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        """Whether the key has any limit (:mod:`router.limits`)."""
        return (
            self.requests_per_minute is not None
            or self.concurrent_requests is not None
            or self.budget_tokens is not None
            or self.tokens_per_minute is not None
        )

    def allows(self, model: str) -> bool:
        """Whether this key may use ``model`` (shell-style patterns, ``*`` for every one)."""
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


class KeySource(Protocol):
    """Where the proxy and the app ask who a request's key is: :class:`KeysFile` or
    :class:`ConsulKeys`."""

    def authenticate(self, authorization: bytes | None) -> ApiKey: ...


def digest(key: str) -> str:
    """The hex SHA-256 of ``key``, as the keys file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The keys of one file, by digest."""

    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self._by_digest = keys

    def __len__(self) -> int:
        return len(self._by_digest)

    def by_name(self) -> dict[str, ApiKey]:
        """The keys by name, in the document's order."""
        return {key.name: key for key in self._by_digest.values()}

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        """Read and check the keys file at ``path``.

        Raises ``ValueError`` naming the file, the field (``keys.2.sha256``)
        and what was expected, for a file that cannot be read, is not YAML,
        does not match the format, or gives one key (digest) or name twice.
        """
        return cls.parse(read_keys_file(path), f"LLMGW_API_KEYS_FILE={path}")

    @classmethod
    def parse(cls, document: bytes, where: str) -> ApiKeys:
        """Check a keys document (the file's format); raises as :meth:`load`, each
        message starting with ``where`` (the file, or the Consul KV key)."""
        raw = load_yaml(document, where)
        try:
            parsed = _KeysFile.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(f"{where}: {_problems(exc)}") from None
        keys: dict[str, ApiKey] = {}
        names: set[str] = set()
        for i, entry in enumerate(parsed.keys):
            if entry.sha256 in keys:
                raise ValueError(f"{where}: keys.{i}.sha256: the same key is listed twice")
            if entry.name in names:
                raise ValueError(f"{where}: keys.{i}.name: {entry.name!r} is used twice")
            names.add(entry.name)
            limits = entry.limits
            keys[entry.sha256] = ApiKey(
                entry.name,
                tuple(entry.models),
                limits.requests_per_minute,
                limits.concurrent_requests,
                limits.tokens_per_day or limits.tokens_per_month,
                "day" if limits.tokens_per_day else "month" if limits.tokens_per_month else None,
                limits.tokens_per_minute,
            )
        return cls(keys)

    @staticmethod
    def check_entry(entry: dict[str, object], where: str) -> None:
        """Check one key's entry of a keys document (``{"name", "sha256", "models",
        "limits"}``) as :meth:`parse` does; raises ``ValueError`` starting with ``where``
        and naming the field (``limits.requests_per_minute``)."""
        try:
            _KeyEntry.model_validate(entry)
        except ValidationError as exc:
            raise ValueError(f"{where}: {_problems(exc)}") from None

    def authenticate(self, authorization: bytes | None) -> ApiKey:
        """The key an ``Authorization: Bearer <key>`` header value carries.

        Raises :class:`router.errors.InvalidApiKey` for no header, another
        scheme, or a key not in the file.
        """
        if authorization is None or not authorization[:7].lower() == BEARER:
            raise errors.InvalidApiKey(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
            )
        key = authorization[7:].strip().decode("latin-1")
        found = self._by_digest.get(digest(key))
        if found is None:
            raise errors.InvalidApiKey(f"Incorrect API key provided: {_redact(key)}.")
        return found


class KeysFile:
    """The keys of ``path``, read again whenever its content changes (:meth:`follow`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        document = read_keys_file(path)
        self.keys = ApiKeys.parse(document, f"LLMGW_API_KEYS_FILE={path}")
        self._seen = hashlib.sha256(document).hexdigest()

    def authenticate(self, authorization: bytes | None) -> ApiKey:
        """As :meth:`ApiKeys.authenticate`, with the keys read last."""
        return self.keys.authenticate(authorization)

    def reload_if_changed(self) -> bool:
        """Read the file; take its keys if its content changed since the last read
        (a read error counts as content, so one is logged once, not every round).
        ``True`` when new keys took effect."""
        try:
            document = read_keys_file(self.path)
        except ValueError as exc:
            seen, problem = f"error: {exc}", exc
        else:
            seen, problem = hashlib.sha256(document).hexdigest(), None
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            if problem is not None:
                raise problem
            keys = ApiKeys.parse(document, f"LLMGW_API_KEYS_FILE={self.path}")
        except ValueError as exc:
            log.error(
                "API keys not reloaded, the %d read before stay in force: %s", len(self.keys), exc
            )
            return False
        self.keys = keys
        log.info("API keys reloaded from %s: %d keys", self.path, len(keys))
        return True

    async def follow(self, interval_s: float = RELOAD_INTERVAL_S) -> None:
        """Look for a change every ``interval_s`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.reload_if_changed()


class ConsulKeys:
    """The keys of the Consul KV document :data:`ROUTER_API_KEYS_KEY`, as
    :mod:`router.watch` reads it (:meth:`set_document` on every change)."""

    def __init__(self) -> None:
        self.keys: ApiKeys | None = None

    def authenticate(self, authorization: bytes | None) -> ApiKey:
        """As :meth:`ApiKeys.authenticate`; raises :class:`router.errors.RouterStarting`
        until the key was read once."""
        if self.keys is None:
            raise errors.RouterStarting(
                f"The router has not read its API keys from Consul KV {ROUTER_API_KEYS_KEY} "
                "yet. Retry in 1 s.",
                1,
            )
        return self.keys.authenticate(authorization)

    def set_document(self, document: bytes | None) -> None:
        """Take the keys of ``document`` (``None``: the key is absent, so no key is
        valid); one that does not load is logged and the keys before stay."""
        where = f"Consul KV {ROUTER_API_KEYS_KEY}"
        if document is None:
            log.warning("%s is absent: no API key is valid until it is written", where)
            self.keys = ApiKeys({})
            return
        try:
            keys = ApiKeys.parse(document, where)
        except ValueError as exc:
            before = "no keys" if self.keys is None else f"the {len(self.keys)} read before"
            log.error("API keys not reloaded, %s stay in force: %s", before, exc)
            if self.keys is None:
                self.keys = ApiKeys({})
            return
        self.keys = keys
        log.info("API keys read from %s: %d keys", where, len(keys))


def load_yaml(document: bytes, where: str) -> object:
    """The YAML ``document`` as keys documents are read (:class:`_KeysLoader`); raises
    ``ValueError`` starting with ``where`` when it is not YAML."""
    try:
        return yaml.load(document, Loader=_KeysLoader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not YAML ({exc})") from None


def read_keys_file(path: str) -> bytes:
    """The bytes of the keys file at ``path``, at most :data:`MAX_KEYS_BYTES`; raises
    ``ValueError`` naming the file."""
    where = f"LLMGW_API_KEYS_FILE={path}"
    try:
        with open(path, "rb") as file:
            document = file.read(MAX_KEYS_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{where}: cannot be read ({exc.strerror})") from None
    if len(document) > MAX_KEYS_BYTES:
        raise ValueError(f"{where}: larger than {MAX_KEYS_BYTES} bytes")
    return document


def _problems(exc: ValidationError) -> str:
    """pydantic's errors as ``field.path: message; ...``."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
    )


def _redact(key: str) -> str:
    """What OpenAI shows of a wrong key: its start and end, never all of it."""
    return f"{key[:3]}...{key[-4:]}" if len(key) > 10 else "***"
