"""Where ``router keys`` (:mod:`router.keyscli`) reads and writes the router's API keys:
the keys file (:class:`FileStore`) or the Consul KV document ``llmgw-router/api-keys``
(:class:`ConsulStore`), and the edit that goes through either (:func:`edit`).

An edit reads the document, checks it with the router's own loader
(:meth:`router.keys.ApiKeys.parse`: a document the router would refuse is not
edited), applies one change to its entries, renders them, checks the result with
the same loader, and writes it only if nobody wrote in between: in Consul with a
check-and-set on the ``ModifyIndex`` read (``PUT /v1/kv/...?cas=``), in a file by
comparing its content's SHA-256 just before an atomic rename (a temporary file
in the same folder, then ``os.replace``: the router never reads half a file; two
``router keys`` take turns under a lock on the folder, :func:`_folder_lock`). A
lost race reads again and applies the change again
(:data:`MAX_ATTEMPTS`), so two operators never overwrite each other.

Comments: PyYAML, the project's YAML library, drops comments when it rewrites a
document (ruamel.yaml, which keeps them, is not a dependency, and adding a second
YAML library for a header is not worth it). So a document written by ``router
keys`` starts with :data:`HEADER`, which says so, and a document with other
comments (written by hand) is rewritten only with ``--force``: losing an
operator's notes silently would be worse than asking.

Errors are :class:`KeysCliError` subclasses carrying the exit code the command
ends with (listed in ``router keys --help``).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import consul
import requests
import yaml

from llmgw_contract import ROUTER_API_KEYS_KEY
from router.keys import MAX_KEYS_BYTES, ApiKeys, load_yaml
from router.sharedlimits import limits_key
from router.windows import Tally, decode_tally

# Writes that lose a race in a row before the edit gives up.
MAX_ATTEMPTS = 5
# Seconds one Consul call may take.
CONSUL_TIMEOUT_S = 10.0

HEADER = (
    "# API keys of the llmgw router (format: router/keys.py), written by `router keys`.\n"
    "# Comments are not kept: `router keys` rewrites this document.\n"
)

# One entry of a keys document, as YAML reads it: name, sha256, models, limits.
Entry = dict[str, Any]

# Exit codes (router keys --help lists them).
EXIT_OK, EXIT_NOT_FOUND, EXIT_INVALID, EXIT_UNAVAILABLE = 0, 1, 2, 3


class KeysCliError(Exception):
    """What ``router keys`` reports and exits with; ``exit_code`` as listed in --help.

    - :class:`InvalidInput` (2): a flag, a limit, a pattern, a document that does
      not load, comments that would be lost;
    - :class:`NotFound` / :class:`AlreadyExists` / :class:`Conflict` (1): the
      store is not as the command needs it;
    - :class:`StoreUnavailable` (3): Consul did not answer or denied the token.
    """

    exit_code = EXIT_NOT_FOUND


class InvalidInput(KeysCliError):
    exit_code = EXIT_INVALID


class NotFound(KeysCliError):
    exit_code = EXIT_NOT_FOUND


class AlreadyExists(KeysCliError):
    exit_code = EXIT_NOT_FOUND


class Conflict(KeysCliError):
    exit_code = EXIT_NOT_FOUND


class StoreUnavailable(KeysCliError):
    exit_code = EXIT_UNAVAILABLE


@dataclass(frozen=True, slots=True)
class Stored:
    """A keys document as read: its bytes (``None``: absent) and the version a write
    must still find (a file's content SHA-256, ``""`` absent; a KV ``ModifyIndex``, 0
    absent)."""

    document: bytes | None
    version: str | int


class KeyStore(Protocol):
    """A place that holds one keys document."""

    where: str

    def read(self) -> Stored: ...

    def write(self, document: bytes, version: str | int) -> bool:
        """Write ``document`` if the store is still at ``version``; ``False`` when
        another writer came first (nothing written)."""
        ...


class FileStore:
    """The keys file at ``path`` (``LLMGW_API_KEYS_FILE``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.where = f"keys file {path}"

    def read(self) -> Stored:
        try:
            with open(self.path, "rb") as file:
                document = file.read(MAX_KEYS_BYTES + 1)
        except FileNotFoundError:
            return Stored(None, "")
        except OSError as exc:
            raise InvalidInput(f"{self.where}: cannot be read ({exc.strerror})") from None
        if len(document) > MAX_KEYS_BYTES:
            raise InvalidInput(f"{self.where}: larger than {MAX_KEYS_BYTES} bytes")
        return Stored(document, hashlib.sha256(document).hexdigest())

    def write(self, document: bytes, version: str | int) -> bool:
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            mode = os.stat(self.path).st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644  # digests only: the router, maybe another user, reads it
        try:
            fd, temporary = tempfile.mkstemp(prefix=".keys-", dir=folder)
        except OSError as exc:
            raise InvalidInput(f"{self.where}: cannot write in {folder} ({exc.strerror})") from None
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(document)
                file.flush()
                os.fsync(file.fileno())
            os.chmod(temporary, mode)
            with _folder_lock(folder):
                if self.read().version != version:
                    return False
                os.replace(temporary, self.path)
        except OSError as exc:
            raise InvalidInput(f"{self.where}: cannot be written ({exc.strerror})") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        return True


@contextlib.contextmanager
def _folder_lock(folder: str) -> Iterator[None]:
    """An exclusive advisory lock (flock) on the keys file's folder while its content is
    compared and replaced: two `router keys` writing at once take turns, so the second
    sees the first's file and applies its change again (issue 23's QA: two `add` of one
    name in the same instant both printed a secret, one of which was lost). The folder,
    not the file: the rename replaces the file's inode. Hand edits take no lock."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class ConsulStore:
    """The Consul KV document :data:`ROUTER_API_KEYS_KEY`, through py-consul; also
    reads the per-key limit tallies (:meth:`tallies`).

    The token needs ``key "llmgw-router/api-keys" write`` to edit (an operator's
    token: the router's has read only), ``key_prefix "llmgw-router/limits/" read``
    for ``usage``."""

    def __init__(self, client: consul.Consul) -> None:
        self._client = client
        self.where = f"Consul KV {ROUTER_API_KEYS_KEY}"

    def read(self) -> Stored:
        _, entry = self._call(
            lambda: self._client.kv.get(ROUTER_API_KEYS_KEY),
            f'key "{ROUTER_API_KEYS_KEY}" read',
        )
        if entry is None:
            return Stored(None, 0)
        return Stored(entry.get("Value") or b"", int(entry["ModifyIndex"]))

    def write(self, document: bytes, version: str | int) -> bool:
        return bool(
            self._call(
                lambda: self._client.kv.put(ROUTER_API_KEYS_KEY, document, cas=version),
                f'key "{ROUTER_API_KEYS_KEY}" write',
            )
        )

    def tallies(self, name: str) -> dict[str, Tally]:
        """The shared limit tallies of the key ``name``, by kind (``requests``,
        ``tokens-minute``, ``tokens-day``...; :mod:`router.sharedlimits`); a kind
        without a document is missing."""
        prefix = limits_key(name, "")
        _, entries = self._call(
            lambda: self._client.kv.get(prefix, recurse=True),
            f'key_prefix "{prefix}" read',
        )
        found: dict[str, Tally] = {}
        for entry in entries or []:
            tally = decode_tally(entry.get("Value"))
            if tally is not None:
                found[entry["Key"].removeprefix(prefix)] = tally
        return found

    def _call(self, call: Callable[[], Any], rule: str) -> Any:
        """``call()``, with py-consul's and requests' errors as :class:`StoreUnavailable`
        (a 403 names the ACL ``rule`` the token lacks)."""
        try:
            return call()
        except consul.ACLPermissionDenied as exc:
            raise StoreUnavailable(
                f"Consul denied CONSUL_HTTP_TOKEN `{rule}` ({str(exc).strip() or '403'}); "
                "give the operator's token that rule (the router's own token, "
                "acl/consul/router.hcl, may only read the keys)"
            ) from None
        except (consul.ConsulException, requests.RequestException) as exc:
            raise StoreUnavailable(
                f"Consul at {self._client.http.base_uri} did not answer: "
                f"{type(exc).__name__}: {exc}"
            ) from None


def consul_client(
    host: str,
    port: int,
    scheme: str,
    token: str | None,
    cacert: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
) -> consul.Consul:
    """A py-consul client for the router's Consul settings (:mod:`router.settings`)."""
    cert = (client_cert, client_key) if client_cert and client_key else None
    client = consul.Consul(
        host=host, port=port, token=token, scheme=scheme, verify=cacert or True, cert=cert
    )
    client.http.connections_timeout = CONSUL_TIMEOUT_S
    return client


def entries_of(stored: Stored, where: str, force: bool = False) -> list[Entry]:
    """The entries of a stored document (none when absent), once the router's loader
    accepted it; raises :class:`InvalidInput` naming ``where`` and the field, or
    saying comments would be lost (unless ``force``)."""
    if stored.document is None:
        return []
    try:
        ApiKeys.parse(stored.document, where)
    except ValueError as exc:
        raise InvalidInput(f"{exc} (fix it by hand; nothing was changed)") from None
    if not force and has_comments(stored.document):
        raise InvalidInput(
            f"{where} has comments, which rewriting it would lose (PyYAML keeps none); "
            "move them elsewhere, or pass --force to rewrite it without them"
        )
    raw = load_yaml(stored.document, where)
    assert isinstance(raw, dict)  # parse accepted it
    return [dict(entry) for entry in raw["keys"]]


def has_comments(document: bytes) -> bool:
    """Whether ``document`` has a comment that is not :data:`HEADER`'s: a ``#`` that
    YAML's own scanner does not read as part of a value (a key named ``a #b`` is
    written quoted and is no comment: issue 23's QA, where such a name made every
    later edit ask for --force). A document YAML cannot scan is left to the loader."""
    text = document.decode("utf-8", "replace").removeprefix(HEADER)
    try:
        spans = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(text)]
    except yaml.YAMLError:
        return False
    spans.sort()
    starts = [start for start, _ in spans]
    at = text.find("#")
    while at >= 0:
        # The last token starting at or before the `#`: inside it, or a comment.
        i = bisect.bisect_right(starts, at) - 1
        if i < 0 or at >= spans[i][1]:
            return True
        at = text.find("#", at + 1)
    return False


def render(entries: list[Entry]) -> bytes:
    """The keys document of ``entries``: :data:`HEADER`, then YAML whose leaf lists and
    maps are on one line (``models: [a, b-*]``). PyYAML quotes any string YAML 1.1
    would read as something else (``'on'``, ``'42'``)."""
    body = yaml.safe_dump(
        {"keys": entries},
        sort_keys=False,
        default_flow_style=None,
        allow_unicode=True,
        width=100,
    )
    return (HEADER + body).encode()


def edit(
    store: KeyStore, change: Callable[[list[Entry]], list[Entry]], force: bool = False
) -> list[Entry]:
    """Apply ``change`` to the store's entries and write the result, again on a fresh
    read when another writer came first (at most :data:`MAX_ATTEMPTS` times). The
    entries written. ``change`` raises :class:`KeysCliError` (nothing written); a
    result the router's loader refuses is :class:`InvalidInput` (nothing written);
    :class:`Conflict` after :data:`MAX_ATTEMPTS` lost races."""
    for _ in range(MAX_ATTEMPTS):
        stored = store.read()
        entries = entries_of(stored, store.where, force)
        try:
            entries = change(entries)
        except KeysCliError as exc:
            raise type(exc)(f"{store.where}: {exc}") from None
        document = render(entries)
        try:
            ApiKeys.parse(document, store.where)
        except ValueError as exc:
            raise InvalidInput(f"{exc} (nothing was changed)") from None
        if store.write(document, stored.version):
            return entries
    raise Conflict(
        f"{store.where}: changed by another writer {MAX_ATTEMPTS} times in a row while "
        "this edit was applied; nothing was written, try again"
    )
