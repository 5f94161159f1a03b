"""Optional router API keys: who may call the router, and for which models.

Off unless ``LLMGW_API_KEYS_FILE`` (``--api-keys-file``) names a YAML file::

    keys:
      - name: team-a                 # shown in logs and errors, never the key
        sha256: 9f86d081884c7d65...  # printf %s "$KEY" | sha256sum
        models: ["gemma-3-270m", "team-a-*"]   # optional: shell patterns; default every model
      - name: ops
        sha256: ...

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

Read at start (:meth:`ApiKeys.load`, called by the app and by
:meth:`router.settings.RouterSettings.validate`, so a bad file exits 2 naming
the file, the entry's field and what was expected), then followed by
:class:`KeysFile`: a changed file (its modification time or size) is read
again within :data:`RELOAD_INTERVAL_S`; one that no longer loads is logged
and the keys read before stay in force, so a typo never locks every client
out or lets everyone in.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from router import errors

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# How often the keys file is looked at for a change (a stat call).
RELOAD_INTERVAL_S = 5.0
BEARER = b"bearer "


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    sha256: str
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)

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
    """One key's name and the model patterns it may use."""

    name: str
    models: tuple[str, ...]

    def allows(self, model: str) -> bool:
        """Whether this key may use ``model`` (shell-style patterns, ``*`` for every one)."""
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


def digest(key: str) -> str:
    """The hex SHA-256 of ``key``, as the keys file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The keys of one file, by digest."""

    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self._by_digest = keys

    def __len__(self) -> int:
        return len(self._by_digest)

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        """Read and check the keys file at ``path``.

        Raises ``ValueError`` naming the file, the field (``keys.2.sha256``)
        and what was expected, for a file that cannot be read, is not YAML,
        does not match the format, or gives one key (digest) or name twice.
        """
        where = f"LLMGW_API_KEYS_FILE={path}"
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"{where}: cannot be read ({exc.strerror})") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{where}: not YAML ({exc})") from None
        try:
            parsed = _KeysFile.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}"
                for e in exc.errors()
            )
            raise ValueError(f"{where}: {problems}") from None
        keys: dict[str, ApiKey] = {}
        names: set[str] = set()
        for i, entry in enumerate(parsed.keys):
            if entry.sha256 in keys:
                raise ValueError(f"{where}: keys.{i}.sha256: the same key is listed twice")
            if entry.name in names:
                raise ValueError(f"{where}: keys.{i}.name: {entry.name!r} is used twice")
            names.add(entry.name)
            keys[entry.sha256] = ApiKey(entry.name, tuple(entry.models))
        return cls(keys)

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
    """The keys of ``path``, read again whenever the file changes (:meth:`follow`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()
        self.keys = ApiKeys.load(path)

    def authenticate(self, authorization: bytes | None) -> ApiKey:
        """As :meth:`ApiKeys.authenticate`, with the keys read last."""
        return self.keys.authenticate(authorization)

    def reload_if_changed(self) -> bool:
        """Read the file again if it changed; ``True`` when new keys took effect."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            keys = ApiKeys.load(self.path)
        except ValueError as exc:
            log.error("API keys not reloaded, the %d read before stay in force: %s",
                      len(self.keys), exc)
            return False
        self.keys = keys
        log.info("API keys reloaded from %s: %d keys", self.path, len(keys))
        return True

    async def follow(self, interval_s: float = RELOAD_INTERVAL_S) -> None:
        """Look for a change every ``interval_s`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.reload_if_changed()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size


def _redact(key: str) -> str:
    """What OpenAI shows of a wrong key: its start and end, never all of it."""
    return f"{key[:3]}...{key[-4:]}" if len(key) > 10 else "***"
