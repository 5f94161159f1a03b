"""Where per-key limits are counted: in Consul KV for every router together
(:class:`ConsulCounters`), or in this router's memory (:class:`LocalCounters`).

Called by :mod:`router.limits` when a router's lease of a key's allowance is used
up, never per request otherwise. One call is one :func:`router.windows.take`
on the tally of one (key, kind), written with a compare-and-set:

- the document is ``llmgw-router/limits/<key name, URL-quoted>/<kind>``
  (:data:`llmgw_contract.ROUTER_LIMITS_PREFIX`), JSON ``{"window", "used"}``;
- the write is a one-operation transaction (``PUT /v1/txn``, verb ``cas``) at
  the ``ModifyIndex`` this router last read or wrote: Consul answers the new
  ``ModifyIndex`` (a plain ``PUT /v1/kv?cas=`` answers only ``true``), so a router
  that wrote last writes again in **one round trip**; when another router
  wrote meanwhile (409), it reads the document (``GET /v1/kv/<key>``) and tries
  again: **two round trips**. A window's limit already spent, as last seen,
  is answered without a write (used only grows within a window: a stale copy
  that says spent is right);
- Consul's own cost: each write is a Raft commit of a ~40-byte value;
- at shutdown, :meth:`ConsulCounters.give_back` takes what a lease did not use off
  the tally, by the same compare-and-set (:func:`router.windows.returned`).

Every failure (connection, timeout of :data:`TIMEOUT_S`, an HTTP status other
than 200/404/409, a 403 for a token without ``key_prefix
"llmgw-router/limits/" write``, :data:`MAX_ATTEMPTS` conflicts in a row) is
:class:`router.errors.CatalogUnavailable`: :mod:`router.limits` then fails open.
The client is a small aiohttp session, as :mod:`router.catalog`'s (same reasons:
per-call timeouts, an integer index).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ssl
import urllib.parse
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from llmgw_contract import ROUTER_LIMITS_PREFIX
from router.errors import CatalogUnavailable
from router.windows import Tally, decode_tally, returned, take

# Seconds one Consul call may take before the limits fail open: a request that
# needs a new lease waits at most this long (twice on a conflict).
TIMEOUT_S = 1.0
# Compare-and-set attempts before giving up on one take (each a read and a write).
MAX_ATTEMPTS = 8

# Outcomes of the Consul calls, the label of llmgw_router_limits_consul_calls_total.
WRITTEN, CONFLICT, READ, ERROR = "written", "conflict", "read", "error"
CALL_OUTCOMES = (WRITTEN, CONFLICT, READ, ERROR)


class CounterStore(Protocol):
    """A tally per (key name, kind) that :func:`router.windows.take` updates."""

    async def take(
        self, name: str, kind: str, window: str, limit: int, want: int, owed: int
    ) -> tuple[int, int]:
        """``(units granted, units used in the window after it)``."""
        ...

    async def give_back(self, name: str, kind: str, window: str, units: int) -> None:
        """Take ``units`` a lease did not use off ``window``'s tally (a stopping router)."""
        ...


def limits_key(name: str, kind: str) -> str:
    """The KV key of one API key's tally of ``kind``."""
    return f"{ROUTER_LIMITS_PREFIX}{urllib.parse.quote(name, safe='')}/{kind}"


class LocalCounters:
    """Tallies in this router's memory (``LLMGW_ROUTER_SHARED_LIMITS=false``)."""

    def __init__(self) -> None:
        self._tallies: dict[tuple[str, str], Tally] = {}

    async def take(
        self, name: str, kind: str, window: str, limit: int, want: int, owed: int
    ) -> tuple[int, int]:
        tally, granted = take(self._tallies.get((name, kind)), window, limit, want, owed)
        self._tallies[(name, kind)] = tally
        return granted, tally.used

    async def give_back(self, name: str, kind: str, window: str, units: int) -> None:
        tally = returned(self._tallies.get((name, kind)), window, units)
        if tally is not None:
            self._tallies[(name, kind)] = tally


class ConsulCounters:
    """Tallies in Consul KV, written by compare-and-set. Create and close inside the
    running event loop; ``counted(outcome)`` is called once per Consul call."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = TIMEOUT_S,
        counted: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self._session = aiohttp.ClientSession(
            base_url=base_url,
            headers={"X-Consul-Token": token} if token else {},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(ssl=ssl_context or True, limit=16),
        )
        self._timeout_s = timeout_s
        self._counted = counted
        # (ModifyIndex, tally) as this router last read or wrote it, per KV key.
        self._known: dict[str, tuple[int, Tally | None]] = {}

    async def close(self) -> None:
        await self._session.close()

    async def take(
        self, name: str, kind: str, window: str, limit: int, want: int, owed: int
    ) -> tuple[int, int]:
        """Take up to ``want`` of ``limit`` in ``window``, adding ``owed``; the units
        granted and the window's units used after. Raises :class:`CatalogUnavailable`."""
        key = limits_key(name, kind)
        known = self._known.get(key)
        for _ in range(MAX_ATTEMPTS):
            if known is None:
                known = await self._read(key)
            index, tally = known
            new, granted = take(tally, window, limit, want, owed)
            if new == tally:
                return granted, new.used  # spent, as last seen, nothing owed: no write
            written = await self._cas(key, index, new)
            if written is not None:
                self._known[key] = (written, new)
                return granted, new.used
            known = None
        self._known.pop(key, None)
        raise CatalogUnavailable(f"Consul KV {key}: {MAX_ATTEMPTS} conflicting writes in a row")

    async def give_back(self, name: str, kind: str, window: str, units: int) -> None:
        """Take ``units`` off ``window``'s tally (:func:`router.windows.returned`), by
        compare-and-set, read first when another router wrote since. Raises
        :class:`CatalogUnavailable`."""
        key = limits_key(name, kind)
        known = self._known.get(key)
        for _ in range(MAX_ATTEMPTS):
            if known is None:
                known = await self._read(key)
            index, tally = known
            new = returned(tally, window, units)
            if new is None:
                return
            written = await self._cas(key, index, new)
            if written is not None:
                self._known[key] = (written, new)
                return
            known = None
        self._known.pop(key, None)
        raise CatalogUnavailable(f"Consul KV {key}: {MAX_ATTEMPTS} conflicting writes in a row")

    async def _read(self, key: str) -> tuple[int, Tally | None]:
        # The key as the transaction writes it, byte for byte: its own %-escapes
        # (a key name's spaces or slashes) escaped again for the URL.
        answer = await self._call("GET", "/v1/kv/" + urllib.parse.quote(key, safe="/"), None)
        self._counted(READ)
        if answer is None:
            return 0, None
        try:
            entry = answer[0]
            index = int(entry["ModifyIndex"])
            raw = base64.b64decode(entry.get("Value") or "")
        except (binascii.Error, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            self._counted(ERROR)
            raise CatalogUnavailable(f"GET /v1/kv/{key}: unexpected answer ({exc!r})") from exc
        return index, decode_tally(raw)

    async def _cas(self, key: str, index: int, tally: Tally) -> int | None:
        """Write ``tally`` if the key is still at ``index`` (0: absent); its new
        ``ModifyIndex``, or ``None`` when another writer came first."""
        op = {
            "KV": {
                "Verb": "cas",
                "Key": key,
                "Value": base64.b64encode(tally.encode()).decode(),
                "Index": index,
            }
        }
        answer = await self._call("PUT", "/v1/txn", [op])
        if answer is None:
            self._counted(CONFLICT)
            return None
        try:
            written = int(answer["Results"][0]["KV"]["ModifyIndex"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self._counted(ERROR)
            raise CatalogUnavailable(f"PUT /v1/txn: unexpected answer ({exc!r})") from exc
        self._counted(WRITTEN)
        return written

    async def _call(self, method: str, path: str, body: Any) -> Any:
        """Consul's JSON answer; ``None`` for a 404 (a read) or a 409 (a rolled back
        transaction: the compare-and-set failed)."""
        try:
            async with (
                asyncio.timeout(self._timeout_s),
                self._session.request(method, path, json=body) as resp,
            ):
                if resp.status in (404, 409):
                    await resp.read()
                    return None
                if resp.status != 200:
                    text = await resp.text()
                    raise CatalogUnavailable(f"{method} {path}: HTTP {resp.status}: {text[:200]}")
                return await resp.json(content_type=None)
        except CatalogUnavailable:
            self._counted(ERROR)
            raise
        except TimeoutError as exc:
            self._counted(ERROR)
            raise CatalogUnavailable(
                f"{method} {path}: no answer within {self._timeout_s:g} s"
            ) from exc
        except (aiohttp.ClientError, ValueError) as exc:
            self._counted(ERROR)
            raise CatalogUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
