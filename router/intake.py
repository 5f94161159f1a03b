"""Reading a request body within bounds: how many bytes all bodies hold at once, and
how long one may take to arrive.

Why: the proxy holds a request's whole body until its answer (it may be retried
on another replica), so ``max_requests`` (4,096) bodies of up to
``max_body_bytes`` (100 MiB) each could have held 400 GiB, and a slow client held
its share for as long as it liked (issue 18). Here:

- :class:`BodyBudget`: the bytes of request bodies the router holds at once, a
  setting (``LLMGW_ROUTER_MAX_BODIES_BYTES``; default :func:`default_budget`, a
  quarter of the machine's memory, at most 1 GiB). Only bytes received count: a
  body, announced (``Content-Length``) or chunked, reserves each chunk as it
  arrives. (It once reserved its ``Content-Length`` up front, so eleven
  connections announcing 100 MiB and sending nothing held the whole budget, and
  every other request got 503 for as long as they kept it up: issue 18, D6.) Past
  the budget: 503 ``router_overloaded`` with Retry-After, and the bytes read so
  far are let go at once. A body larger than the whole budget could never fit:
  413 at once, as one over ``max_body_bytes``. No per-client share: behind a
  load balancer or NAT every client has one address, and holding the budget now
  takes sending it, at least ``min_rate`` bytes/s per body (below).
- :func:`read_body`: the body-read deadline, Apache mod_reqtimeout's
  ``body=<timeout>,MinRate=<rate>`` rule: the first bytes within
  ``timeout_s``, and each ``min_rate`` bytes received extend the deadline by one
  second, so a large body on a fair link finishes and a trickle is cut. Past it:
  408 ``request_timeout``. (uvicorn has no body-read timeout; its
  ``timeout_keep_alive`` runs only between requests. The header-read timeout is
  :mod:`router.serving`'s.)

The body is kept as the list of chunks the server hands over (each a ``bytes`` of
its exact size) and joined once at the end: no buffer of the announced size is
allocated before the bytes arrive (memory a silent client would hold), and none
grows by reallocation (``bytearray +=`` over-allocates, and its freed buffers
fragment the heap; a QA run of 60 chunked 20 MiB uploads peaked at 1.5 GiB RSS
under a 1 GiB budget and stayed there; see :mod:`router.heap`). The join holds
one body twice for a moment; the event loop runs one join at a time, so that is
at most one body over the budget. Used by
:class:`router.proxy.Proxy`, which releases the reservation when the request ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from router import errors, heap

Receive = Callable[[], Awaitable[dict[str, Any]]]

# A body is kept in blocks of this size, each joined from the chunks the server
# hands over (of any size from 1 byte up): few large allocations, which
# router.heap has malloc map and unmap on their own, instead of many small ones
# that fragment the heap (see the module docstring).
BLOCK_BYTES = 1024 * 1024

# The default budget's ceiling and its share of the machine's memory.
DEFAULT_BUDGET_CEILING = 1024**3
DEFAULT_BUDGET_SHARE = 4


class ClientGone(Exception):
    """The client disconnected before its response started (while its body was read,
    or while it waited for its answer: :mod:`router.proxy`)."""


def memory_limit_bytes(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    own_cgroup: Path = Path("/proc/self/cgroup"),
) -> int | None:
    """The memory this process may use: ``MemTotal``, or its own cgroup's limit (a
    Nomad ``exec`` task's ``memory``, a container's) when lower: cgroup v2's
    ``memory.max``, v1's ``memory/memory.limit_in_bytes``; ``None`` when none can be
    read."""
    limits = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    # The roots too: inside a container its own cgroup is mounted at the root.
    candidates = [cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"]
    try:
        # v2: "0::/path/of/the/cgroup"; v1: "4:memory:/path/of/the/cgroup".
        for line in own_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if not controllers:
                candidates.insert(0, cgroup_root / path.lstrip("/") / "memory.max")
            elif "memory" in controllers.split(","):
                candidates.insert(
                    0, cgroup_root / "memory" / path.lstrip("/") / "memory.limit_in_bytes"
                )
    except (OSError, ValueError):
        pass
    for candidate in candidates:
        try:
            raw = candidate.read_text().strip()
        except OSError:
            continue
        if raw.isdigit():
            limits.append(int(raw))
    return min(limits) if limits else None


def default_budget(memory: int | None = None) -> int:
    """``min(1 GiB, memory / 4)`` bytes (``memory``: :func:`memory_limit_bytes`); 1 GiB
    when the memory is unknown."""
    memory = memory_limit_bytes() if memory is None else memory
    if memory is None:
        return DEFAULT_BUDGET_CEILING
    return max(1, min(DEFAULT_BUDGET_CEILING, memory // DEFAULT_BUDGET_SHARE))


class BodyBudget:
    """Bytes of request bodies held at once, at most ``limit``; ``retry_after_s`` is
    the Retry-After of a refusal. One event loop: no lock needed."""

    def __init__(self, limit: int, retry_after_s: int = 2) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.held = 0

    def reserve(self, held: int, more: int) -> None:
        """Grow a body's reservation from ``held`` by ``more`` bytes; raises
        :class:`router.errors.RouterOverloaded` (nothing reserved) past the limit."""
        if self.held + more > self.limit:
            raise errors.RouterOverloaded(
                f"The router holds request bodies up to {self.limit} bytes at once "
                f"({self.held} held now), and this request's body ({held + more} bytes so "
                f"far) does not fit. Retry in {self.retry_after_s} s.",
                self.retry_after_s,
            )
        self.held += more

    def release(self, size: int) -> None:
        """Give back ``size`` bytes a finished (or refused) body held."""
        self.held -= size
        heap.released(size, idle=self.held == 0)


class Reservation:
    """What one request's body holds of a :class:`BodyBudget`; :meth:`release` once."""

    __slots__ = ("budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.size = 0

    def grow(self, more: int) -> None:
        self.budget.reserve(self.size, more)
        self.size += more

    def release(self) -> None:
        if self.size:
            self.budget.release(self.size)
            self.size = 0


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's ``Content-Length`` (the HTTP parser already refused a bad one),
    or ``None`` (chunked, or none)."""
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return None


async def read_body(
    receive: Receive,
    announced: int | None,
    reservation: Reservation,
    *,
    max_bytes: int,
    timeout_s: float,
    min_rate: float,
    whole: bool = False,
) -> bytes:
    """Read the whole body of a request announced as ``announced`` bytes (``None``:
    chunked), reserving its bytes in ``reservation`` as they arrive (above).
    ``whole``: the server received the whole body before the app ran
    (:func:`router.serving.body_whole`), so it is read with no deadline.

    Raises :class:`router.errors.BodyTooLarge` (over ``max_bytes`` or the whole
    budget), :class:`router.errors.RouterOverloaded` (the budget is held by other
    bodies), :class:`router.errors.RequestTimeout` (past the deadline) and
    :class:`ClientGone`.
    """
    limit = min(max_bytes, reservation.budget.limit)
    if announced is not None and announced > limit:
        raise _too_large(limit, max_bytes)
    first: dict[str, Any] | None = None
    if whole:
        # The server holds the whole body already (router.serving): receive() hands
        # it over without waiting, so no clock is armed. asyncio.timeout_at's timer
        # was about 8 us of the router's 48 us of its own CPU per request
        # (bench/proxy_cpu.py).
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        if not message.get("more_body", False):
            chunk = message.get("body", b"")
            if len(chunk) > limit:
                raise _too_large(limit, max_bytes)
            reservation.grow(len(chunk))
            return chunk
        first = message  # not whole after all: read on, on the clock, from here
    blocks: list[bytes] = []  # of BLOCK_BYTES or a little more
    pending: list[bytes] = []  # the chunks of the next block
    pending_bytes = size = 0
    # From time.monotonic(), not loop.time(): uvloop's loop clock is the same monotonic
    # clock read coarsely (up to ~1 ms behind), and a deadline taken from it fired before
    # timeout_s had passed. The loop's timer fires once its clock reaches the deadline,
    # so never early.
    deadline = time.monotonic() + timeout_s
    try:
        async with asyncio.timeout_at(deadline) as timer:
            while True:
                if first is None:
                    message = await receive()
                else:
                    message, first = first, None
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:  # chunked (the parser never passes Content-Length)
                        raise _too_large(limit, max_bytes)
                    reservation.grow(len(chunk))
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    if pending_bytes >= BLOCK_BYTES:
                        blocks.append(b"".join(pending))
                        pending.clear()
                        pending_bytes = 0
                    deadline += len(chunk) / min_rate
                if not message.get("more_body", False):
                    blocks += pending
                    return blocks[0] if len(blocks) == 1 else b"".join(blocks)
                if chunk:
                    # Moved only when more is awaited: a body whole in its first
                    # message (the common case) costs one timer, not two.
                    timer.reschedule(deadline)
    except TimeoutError:
        raise errors.RequestTimeout(
            f"The request body was not received in time: {size} bytes of "
            f"{announced if announced is not None else 'a chunked body'} in the router's "
            f"limit of {timeout_s:g} s plus 1 s per {min_rate:g} bytes received."
        ) from None


def _too_large(limit: int, max_bytes: int) -> errors.BodyTooLarge:
    what = (
        "the router's body limit"
        if limit == max_bytes
        else "what the router may hold of all request bodies at once"
    )
    return errors.BodyTooLarge(f"The request body is larger than {limit} bytes ({what}).")
