"""The planner's routing documents as the router keeps them: a read of
``llmgw/routing/`` costs what changed, not what is there.

Called by :meth:`router.catalog.ConsulCatalog.states` on every answer of the
state watch (:mod:`router.watch`). Consul's KV has no "changes since" query: a
blocking read of the prefix answers every key, with its value, whenever any of
them changed. Measured (issue 21): when the router read the whole state
documents (``llmgw/state/``), 1,000 of them made a 15.7 MiB answer, about 100 ms
of parsing on the event loop for every write, so every request in flight waited
behind each one. Two defences since:

- **The planner writes what the router acts on apart**
  (:class:`llmgw_contract.RoutingDocument`, a few hundred bytes, rewritten in the
  state's transaction only when the model becomes parked, unplaceable or neither):
  a failure counted anywhere wakes no router.

- **Only changed keys are decoded.** Each key's ``ModifyIndex`` is kept with what
  its document said; a key whose index did not move keeps its object (no base64,
  no pydantic), and one whose new document says the same keeps the old object
  too, so :meth:`router.endpoints.EndpointTable.set_states` touches the entries
  whose state did change (it compares by identity). A key gone from the answer is
  gone from the result.
- **Never one long stall.** The answer is scanned entry by entry as its bytes
  arrive (:class:`EntryScanner`, ``json``'s own decoder on one entry at a time),
  and the scan yields to the event loop after each :data:`SLICE_S` of work, so a
  request waits at most about that long behind it. Slices on the loop rather than
  a thread: ``json``, ``base64`` and pydantic hold the GIL for a whole call, so a
  thread would stall the loop as long (measured in bench/state_churn.py on whole
  state documents: one read of 16 MiB, 121-155 ms of work when every document
  changed, the loop waiting at most 1.4-3.4 ms at a time on the loaded 2-core
  machine).
- **An index that went back** (a Consul that lost its state) decodes everything
  again: in another timeline the same ``ModifyIndex`` may hold another document.
- **Bounded documents.** KV is writable by whoever holds a token for it: a value
  larger than :data:`MAX_DOCUMENT_BYTES` is skipped with a warning (once per
  write), as is one that does not decode.
- **A bounded share of the loop.** :attr:`StateView.cost_s` (seconds of work the
  last read took) lets the watch space its reads (:func:`router.watch.state_interval`).

Pure but for the clock and the yields: unit tests feed it Consul's JSON in pieces.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import codecs
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from llmgw_contract import KVPrefix, RoutingDocument, decode, model_from_key

log = logging.getLogger(__name__)

Known = tuple[int, RoutingDocument | None]
"""A key's ``ModifyIndex`` and what the router keeps of its document."""

# The largest routing document read, decoded: a parked record's last error (a start
# error's stderr tail, llmgw_contract.lasterror) is most of one; far below this.
MAX_DOCUMENT_BYTES = 256 * 1024
# Work done on the event loop between two yields while an answer is scanned. A
# request meets a slice at each of its steps (body, upstream, answer), so a slice
# lands on its latency several times. Measured (bench/state_churn.py, 1,000 models,
# 16 connections): the router's added p99 while churning was 8.2-13.6 ms (median
# 12.1, 6 rounds in 3 runs) with 1 ms slices, 7.9-12.1 ms (median 9.2, 8 rounds in 2
# runs) with 0.2 ms, and its CPU with no request 3.8-4.4 % and 3.9-4.1 %: the extra
# yields cost nothing seen.
SLICE_S = 0.0002


def routed(doc: RoutingDocument) -> RoutingDocument | None:
    """What the router keeps of a routing document: ``None`` unless it is parked or
    unplaceable (all the router acts on)."""
    return doc if doc.refuses else None


class EntryScanner:
    """Consul's KV list answer (a JSON array of flat objects) parsed one entry at a
    time, from pieces of bytes cut anywhere.

    :meth:`feed` returns the entries its piece completed; :meth:`end` checks that the
    array was closed. Raises ``ValueError`` for anything that is not such an array.
    """

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._decoder = json.JSONDecoder()
        self._buffer = ""
        self._opened = self._closed = False
        self._need_comma = False

    def feed(self, data: bytes) -> list[Any]:
        """The entries completed by ``data``, in order."""
        self._buffer += self._text.decode(data)
        return self._scan()

    def end(self) -> list[Any]:
        """The last entries; raises ``ValueError`` when the array is incomplete."""
        self._buffer += self._text.decode(b"", final=True)
        found = self._scan()
        if not self._closed or self._buffer.strip():
            raise ValueError("Consul's KV answer ended before its JSON array did")
        return found

    def _scan(self) -> list[Any]:
        text = self._buffer
        pos, n = 0, len(text)
        found: list[Any] = []
        while True:
            while pos < n and text[pos] in " \t\r\n":
                pos += 1
            if pos == n or self._closed:
                break
            char = text[pos]
            if not self._opened:
                if char != "[":
                    raise ValueError("Consul's KV answer is not a JSON array")
                self._opened = True
                pos += 1
            elif char == "]":
                self._closed = True
                pos += 1
            elif self._need_comma:
                if char != ",":
                    raise ValueError(f"unexpected {char!r} between Consul's KV entries")
                self._need_comma = False
                pos += 1
            else:
                try:
                    entry, end = self._decoder.raw_decode(text, pos)
                except json.JSONDecodeError:
                    # Most likely cut by the piece: wait for more (end() says if not).
                    break
                found.append(entry)
                self._need_comma = True
                pos = end
        self._buffer = text[pos:]
        return found


class StateView:
    """Every ``llmgw/routing/`` key as last read: its ``ModifyIndex`` and what the
    router keeps of its document (:func:`routed`)."""

    def __init__(self, max_bytes: int = MAX_DOCUMENT_BYTES, slice_s: float = SLICE_S) -> None:
        self.max_bytes = max_bytes
        self.slice_s = slice_s
        self._known: dict[str, Known] = {}
        self._index = 0
        self.present: frozenset[str] = frozenset()
        """The models with a state key in the last read, whatever its document says:
        what is back after a Consul reset (:meth:`router.endpoints.EndpointTable.set_states`)."""
        self.cost_s = 0.0
        """Seconds of work (not waiting for bytes) the last read took."""
        self.decoded = 0
        """Documents decoded by the last read (keys whose index moved)."""

    async def read(
        self, pieces: AsyncIterable[bytes] | None, index: int = 0
    ) -> dict[str, RoutingDocument]:
        """``{model: document}`` of the parked and unplaceable models in one KV answer
        (``pieces`` of its body; ``None``: a 404, no key; ``index``: its
        ``X-Consul-Index``). Unchanged documents are the objects of the previous
        read. :attr:`present` names every model with a key in the answer. Raises
        ``ValueError`` for a body that is not Consul's list; the view (its index, its
        documents and :attr:`present`) is then left as it was."""
        # An index that went back is another timeline (a Consul that lost its state):
        # a ModifyIndex there says nothing about the documents read before. The index
        # and the documents change together, after a whole read: a read that fails
        # partway (a reset mid-answer) must not pair the new index with old documents.
        known = self._known if index >= self._index else {}
        fresh: dict[str, Known] = {}
        states: dict[str, RoutingDocument] = {}
        self.decoded = 0
        self.cost_s = 0.0
        if pieces is not None:
            scanner = EntryScanner()
            # A slice runs from the last yield: pieces already buffered arrive
            # without one, so a slice may span several.
            last_yield = time.perf_counter()
            async for piece in pieces:
                began = time.perf_counter()  # waiting for bytes costs the loop nothing
                for entry in scanner.feed(piece):
                    self._take(entry, known, fresh, states)
                    if (now := time.perf_counter()) - last_yield >= self.slice_s:
                        self.cost_s += now - began
                        await asyncio.sleep(0)
                        began = last_yield = time.perf_counter()
                self.cost_s += time.perf_counter() - began
            for entry in scanner.end():
                self._take(entry, known, fresh, states)
        self._index = index
        self._known = fresh
        self.present = frozenset(
            name for key in fresh if (name := model_from_key(KVPrefix.ROUTING, key)) is not None
        )
        return states

    def _take(
        self,
        entry: Any,
        known: dict[str, Known],
        fresh: dict[str, Known],
        states: dict[str, RoutingDocument],
    ) -> None:
        if not isinstance(entry, dict):
            raise ValueError("an entry of Consul's KV answer is not an object")
        key = entry.get("Key")
        index = entry.get("ModifyIndex")
        if not isinstance(key, str) or not isinstance(index, int):
            raise ValueError("an entry of Consul's KV answer has no Key or ModifyIndex")
        name = model_from_key(KVPrefix.ROUTING, key)
        if name is None:
            return
        before = known.get(key)
        if before is not None and before[0] == index:
            state = before[1]
        else:
            state = self._decode(key, name, entry.get("Value"))
            if before is not None and state is not None and state == before[1]:
                state = before[1]  # rewritten, same content: keep the object
        fresh[key] = (index, state)
        if state is not None:
            states[name] = state

    def _decode(self, key: str, name: str, value: object) -> RoutingDocument | None:
        self.decoded += 1
        if value is None:
            return None
        if not isinstance(value, str):
            log.warning("skipping Consul KV key %s: its Value is not a string", key)
            return None
        # base64: 4 characters for every 3 bytes.
        if len(value) // 4 * 3 > self.max_bytes:
            log.warning(
                "skipping Consul KV key %s: about %d bytes, more than a routing document may "
                "hold (%d)",
                key,
                len(value) // 4 * 3,
                self.max_bytes,
            )
            return None
        try:
            doc = decode(RoutingDocument, base64.b64decode(value))
        except (binascii.Error, ValueError) as exc:
            log.warning("skipping Consul KV key %s: %s", key, exc)
            return None
        return routed(doc)


async def pieces_of(data: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    """``data`` in pieces of ``size`` bytes (tests, and a body already read)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]
