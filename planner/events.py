"""Read Nomad's event stream (/v1/event/stream): newline-delimited JSON frames.

Called by the watcher. A small reader of our own, because python-nomad's
`event.stream` drops topic filter keys, replays from the first index on
reconnect, and runs in a thread that dies silently on a mid-stream error.
This one yields (index, event) pairs and raises on any failure, so the
caller's loop decides what to do (reconcile, then resume from index + 1).

Frame shapes (Nomad 1.6 API docs, "Event Stream"): `{"Index": N, "Events":
[{"Topic", "Type", "Key", "Index", "Payload": {...}}]}`, and `{}` as a
heartbeat every 30 s (nomad/event_endpoint.go, `NewJsonStream(ctx, 30*time.Second)`).
A read that waits longer than `read_timeout` (default 65 s: two heartbeats
missed, not one late) means the stream is dead.

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
from typing import Any

import aiohttp

from llmgw_contract.acl import Agent, TokenStatus
from planner.access import NOMAD_READ_JOB, denied_error
from planner.errors import NomadUnavailable
from planner.settings import NOMAD_TLS_VARS, tls_reason

# Node: engines are installed on nodes that join or turn eligible (planner.engines.follow).
TOPICS = ("Allocation", "Deployment", "Evaluation", "Job", "Node")


async def stream_events(session: aiohttp.ClientSession, nomad_addr: str, index: int,
                        token: str | None = None, topics: tuple[str, ...] = TOPICS,
                        read_timeout: float = 65.0,
                        on_message: Callable[[], None] | None = None,
                        ssl: ssl_.SSLContext | None = None,
                        ) -> AsyncIterator[dict[str, Any]]:
    """Yield each event with Index >= `index`, forever; raise NomadUnavailable when the
    stream fails or goes silent for `read_timeout` seconds. `on_message` is called for
    every frame, heartbeats included (the stream's own sign of life, for metrics).
    `ssl`: the context for an https:// `nomad_addr` (None: aiohttp's default, the
    system's CAs)."""
    params = [("topic", f"{topic}:*") for topic in topics] + [("index", str(index))]
    headers = {"X-Nomad-Token": token} if token else {}
    url = f"{nomad_addr.rstrip('/')}/v1/event/stream"
    try:
        async with session.get(url, params=params, headers=headers, ssl=ssl or True,
                               timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as resp:
            if resp.status == 403:
                # The topics need read-job (nomad/stream/event_broker.go,
                # aclAllowsSubscription); an unknown token is told apart by the client.
                raise denied_error(Agent.NOMAD, [NOMAD_READ_JOB.rule],
                                   TokenStatus.VALID if token else TokenStatus.EMPTY,
                                   "event stream", await resp.text())
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
                    if event.get("Index", 0) >= index:
                        yield event
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        if reason := tls_reason(exc):
            raise NomadUnavailable(f"event stream: TLS with Nomad at {nomad_addr} failed "
                                   f"({reason}); check {', '.join(NOMAD_TLS_VARS)}") from exc
        raise NomadUnavailable(f"event stream: {type(exc).__name__}: {exc}") from exc
