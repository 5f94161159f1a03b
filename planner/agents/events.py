"""Read Nomad's event stream (/v1/event/stream): newline-delimited JSON frames.

Called by the watcher, through `NomadClient.events` (which passes its address,
token, TLS and namespace). A small reader of our own, because python-nomad's
`event.stream` drops topic filter keys, replays from the first index on
reconnect, and runs in a thread that dies silently on a mid-stream error.
This one yields every event it is sent and raises on any failure, so the
caller's loop decides what to do (reconcile, then resume from index + 1).

Nomad's event broker never refuses an index (nomad/stream/event_broker.go,
`Subscribe`; the HTTP API has no StartExactlyAtIndex): it starts at the
closest item still in its bounded buffer (`event_buffer_size`,
`eventBuffer.StartAtClosest`): the oldest one it kept when the index asked
for was trimmed (a gap: events lost without a word), or the newest one it has
when the index asked for is beyond it (an event already seen, or, when
Nomad's state was rebuilt, an index lower than any seen: a reset).
`Cursor` tells these apart for the watcher, from the indexes alone.

Frame shapes (Nomad 1.6 API docs, "Event Stream"): `{"Index": N, "Events":
[{"Topic", "Type", "Key", "Index", "Payload": {...}}]}`, and `{}` as a
heartbeat every 30 s (nomad/event_endpoint.go, `NewJsonStream(ctx, 30*time.Second)`).
A read that waits longer than `read_timeout` (default 65 s: two heartbeats
missed, not one late) means the stream is dead.

Namespace: the stream carries `?namespace=<NOMAD_NAMESPACE>` (the Events HTTP API's
`namespace` parameter, "*" for all). Without it Nomad streams the `default`
namespace's jobs, allocations, evaluations and deployments only (nomad/stream
`filter`: an event whose Namespace is set and is not the one asked for is dropped;
Node events have none and always come).

TLS: for an https:// Nomad the caller passes `ssl`, the Nomad client's
`NomadClient.ssl_context` (NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY), per
request, so the shared aiohttp session needs no TLS of its own; a failed handshake
is NomadUnavailable naming the files to check.
"""

from __future__ import annotations

import asyncio
import json
import ssl as ssl_
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp

from llmgw_contract.acl import Agent, TokenStatus
from planner.agents.access import DEFAULT_NAMESPACE, NOMAD_READ_JOB, denied_error, in_namespace
from planner.errors import NomadUnavailable
from planner.spec.settings import NOMAD_TLS_VARS, tls_reason

# Node: engines are installed on nodes that join or turn eligible (planner.daemon.engine_follow).
TOPICS = ("Allocation", "Deployment", "Evaluation", "Job", "Node")


async def stream_events(
    session: aiohttp.ClientSession,
    nomad_addr: str,
    index: int,
    token: str | None = None,
    topics: tuple[str, ...] = TOPICS,
    read_timeout: float = 65.0,
    on_message: Callable[[], None] | None = None,
    ssl: ssl_.SSLContext | None = None,
    namespace: str = DEFAULT_NAMESPACE,
) -> AsyncIterator[dict[str, Any]]:
    """Yield each event from `index` on (as Nomad starts it: `Cursor` judges the first
    one), forever; raise NomadUnavailable when the
    stream fails or goes silent for `read_timeout` seconds. `on_message` is called for
    every frame, heartbeats included (the stream's own sign of life, for metrics).
    `ssl`: the context for an https:// `nomad_addr` (None: aiohttp's default, the
    system's CAs). `namespace`: the namespace whose events come (Node events always do)."""
    params = [("topic", f"{topic}:*") for topic in topics] + [
        ("index", str(index)),
        ("namespace", namespace),
    ]
    headers = {"X-Nomad-Token": token} if token else {}
    url = f"{nomad_addr.rstrip('/')}/v1/event/stream"
    try:
        async with session.get(
            url,
            params=params,
            headers=headers,
            ssl=ssl or True,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        ) as resp:
            if resp.status == 403:
                # The topics need read-job (nomad/stream/event_broker.go,
                # aclAllowsSubscription); an unknown token is told apart by the client.
                raise denied_error(
                    Agent.NOMAD,
                    [in_namespace(NOMAD_READ_JOB, namespace).rule],
                    TokenStatus.VALID if token else TokenStatus.EMPTY,
                    "event stream",
                    await resp.text(),
                )
            if resp.status != 200:
                raise NomadUnavailable(f"event stream: HTTP {resp.status}: {await resp.text()}")
            while True:
                line = await asyncio.wait_for(resp.content.readline(), read_timeout)
                if not line:
                    raise NomadUnavailable("event stream: Nomad closed the connection")
                frame = json.loads(line) if line.strip() else {}
                if on_message is not None:
                    on_message()
                for event in frame.get("Events") or []:
                    yield event
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        if reason := tls_reason(exc):
            raise NomadUnavailable(
                f"event stream: TLS with Nomad at {nomad_addr} failed "
                f"({reason}); check {', '.join(NOMAD_TLS_VARS)}"
            ) from exc
        raise NomadUnavailable(f"event stream: {type(exc).__name__}: {exc}") from exc


class Verdict(StrEnum):
    NEW = "new"  # handle it
    SEEN = "seen"  # covered already (the broker's newest item, delivered again)
    GAP = "gap"  # handle it, and reconcile: events before it may have been lost
    CHECK = "check"  # lower than expected: ask Nomad's index whether it was reset


@dataclass
class Cursor:
    """Judges the indexes one stream delivers, for a stream asked to start at `asked`
    (the index after everything the reconcile before it covered).

    - the first event later than `asked`: the broker may have started at the oldest
      item it still had (`StartAtClosest`): a GAP, to be covered by a reconcile (an
      index with no event of ours in between reads the same: a reconcile too many,
      never one too few);
    - an event earlier than `asked`: the newest item delivered again (SEEN) unless
      Nomad was reset; the caller tells which from Nomad's own index (CHECK, once);
    - an index lower than one this stream delivered before: CHECK (a broker never
      goes back on one connection)."""

    asked: int
    first: int | None = None  # the first index delivered
    last: int = 0  # the highest index delivered

    def judge(self, index: int) -> Verdict:
        first = self.first is None
        if first:
            self.first = index
        if index < self.last:
            return Verdict.CHECK
        self.last = max(self.last, index)
        if first and index > self.asked:
            return Verdict.GAP
        if index < self.asked:
            return Verdict.CHECK if first else Verdict.SEEN
        return Verdict.NEW
