"""router.intake: the body budget, the body-read deadline and the default budget.

In-process with a scripted ASGI ``receive``; the same over real HTTP through
``router serve`` is in tests/integration/test_router_security.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router import errors
from router.intake import (
    BodyBudget,
    ClientGone,
    Reservation,
    default_budget,
    memory_limit_bytes,
    read_body,
)


def scripted(*chunks: bytes, then_wait: bool = False):
    """A ``receive`` that yields ``chunks`` (the last without more_body unless
    ``then_wait``), then waits forever."""
    queue = list(chunks)

    async def receive() -> dict:
        if queue:
            chunk = queue.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(queue) or then_wait}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


def read(receive, announced, reservation, **kw):
    options = {"max_bytes": 1000, "timeout_s": 5.0, "min_rate": 1000.0, **kw}
    return asyncio.run(read_body(receive, announced, reservation, **options))


def test_a_body_reserves_only_the_bytes_received() -> None:
    """Issue 18, D6: a Content-Length was reserved whole before a byte arrived, so
    connections that announced bodies and sent nothing held the whole budget."""
    budget = BodyBudget(100)
    reservation = Reservation(budget)

    async def scenario() -> None:
        stalled = Reservation(budget)
        task = asyncio.ensure_future(
            read_body(
                scripted(b"a" * 10, then_wait=True),
                90,
                stalled,
                max_bytes=1000,
                timeout_s=5.0,
                min_rate=1000.0,
            )
        )
        while stalled.size == 0:
            await asyncio.sleep(0)
        assert budget.held == 10  # 90 announced, 10 received
        # The rest of the budget is free for others.
        body = await read_body(
            scripted(b"b" * 50, b"c" * 40),
            90,
            reservation,
            max_bytes=1000,
            timeout_s=5.0,
            min_rate=1000.0,
        )
        assert body == b"b" * 50 + b"c" * 40 and budget.held == 100
        task.cancel()
        stalled.release()

    asyncio.run(scenario())
    assert budget.held == 90
    reservation.release()
    reservation.release()  # once only
    assert budget.held == 0


def test_past_the_budget_is_router_overloaded_and_nothing_is_kept() -> None:
    budget = BodyBudget(100, retry_after_s=3)
    other = Reservation(budget)
    other.grow(70)
    for announced in (40, None):  # announced or chunked: refused at the chunk that does not fit
        reservation = Reservation(budget)
        with pytest.raises(errors.RouterOverloaded) as refused:
            read(scripted(b"x" * 20, b"x" * 20), announced, reservation)
        assert refused.value.headers() == [(b"retry-after", b"3")]
        assert reservation.size == 20 and budget.held == 90
        reservation.release()
        assert budget.held == 70


def test_larger_than_the_limit_or_the_whole_budget_is_413() -> None:
    for budget_bytes, announced in ((10_000, 1001), (500, 501), (500, None)):
        reservation = Reservation(BodyBudget(budget_bytes))
        with pytest.raises(errors.BodyTooLarge):
            read(scripted(b"x" * 600), announced, reservation)
        assert reservation.size == 0


def test_a_stalled_body_times_out_and_bytes_extend_the_deadline() -> None:
    with pytest.raises(errors.RequestTimeout):
        read(scripted(b"x", then_wait=True), 10, Reservation(BodyBudget(100)), timeout_s=0.05)

    async def steady() -> bytes:
        # The first chunk at once, 3 more 0.1 s apart: 0.3 s in all, well past the
        # 0.05 s timeout, but each 100 bytes at 10 bytes/s buys 10 s more. The sleep
        # is the scripted client, not a wait for the router: it cannot return before
        # 0.1 s, so each chunk comes past the bare timeout (no false pass), and only
        # a stall of over 10 s between chunks could time it out (no false fail).
        chunks = [b"x" * 100] * 4

        async def receive() -> dict:
            if len(chunks) < 4:
                await asyncio.sleep(0.1)
            chunks.pop()
            return {"type": "http.request", "body": b"x" * 100, "more_body": bool(chunks)}

        return bytes(
            await read_body(
                receive,
                400,
                Reservation(BodyBudget(1000)),
                max_bytes=1000,
                timeout_s=0.05,
                min_rate=10.0,
            )
        )

    assert asyncio.run(steady()) == b"x" * 400


def test_a_client_that_leaves_is_client_gone() -> None:
    async def gone() -> dict:
        return {"type": "http.disconnect"}

    with pytest.raises(ClientGone):
        read(gone, 10, Reservation(BodyBudget(100)))


def test_the_default_budget_is_a_quarter_of_memory_at_most_1_gib(tmp_path: Path) -> None:
    assert default_budget(2 * 1024**3) == 512 * 1024**2
    assert default_budget(64 * 1024**3) == 1024**3
    meminfo, root, own = tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "self-cgroup"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    assert memory_limit_bytes(meminfo, root, own) == 16384000 * 1024
    (root / "nomad.slice" / "task.scope").mkdir(parents=True)
    own.write_text("0::/nomad.slice/task.scope\n")
    (root / "nomad.slice" / "task.scope" / "memory.max").write_text("536870912\n")
    assert memory_limit_bytes(meminfo, root, own) == 536870912
    (root / "nomad.slice" / "task.scope" / "memory.max").write_text("max\n")
    assert memory_limit_bytes(meminfo, root, own) == 16384000 * 1024
    (root / "memory.max").write_text("1073741824\n")  # a container's own root
    assert memory_limit_bytes(meminfo, root, own) == 1073741824
    assert memory_limit_bytes(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None
    # cgroup v1: the memory controller's own hierarchy.
    (root / "memory" / "job").mkdir(parents=True)
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text("268435456\n")
    own.write_text("5:cpu,cpuacct:/job\n4:memory:/job\n0::/\n")
    assert memory_limit_bytes(meminfo, root, own) == 268435456


def test_a_body_in_many_small_chunks_comes_back_whole() -> None:
    """Kept in blocks of BLOCK_BYTES joined from the chunks (router.heap's reason)."""
    chunk = bytes(range(256)) * 4096  # 1 MiB
    pieces = [chunk[i : i + 70_001] for i in range(0, len(chunk), 70_001)] * 3
    body = read(
        scripted(*pieces), None, Reservation(BodyBudget(4 << 20)), max_bytes=4 << 20, min_rate=1e9
    )
    assert body == chunk * 3


def test_the_heap_is_trimmed_only_once_tuned() -> None:
    from router import heap

    heap.released(1 << 30)  # not tuned (tests): nothing happens
    assert heap._libc is None and not heap._scheduled


def test_a_body_the_server_holds_whole_is_read_with_no_clock_and_still_bounded() -> None:
    """``whole``: no deadline is armed (a 0 s one would fire at the first await);
    the size and budget bounds hold as on the clock, and a body that was not whole
    after all is read on to its end."""
    budget = BodyBudget(100)
    reservation = Reservation(budget)
    assert read(scripted(b"a" * 10), 10, reservation, timeout_s=0.0, whole=True) == b"a" * 10
    assert budget.held == 10
    with pytest.raises(errors.BodyTooLarge):
        read(scripted(b"a" * 11), None, Reservation(budget), max_bytes=10, whole=True)
    with pytest.raises(errors.RouterOverloaded):
        read(scripted(b"a" * 95), None, Reservation(budget), whole=True)
    assert read(scripted(b"ab", b"cd"), 4, Reservation(BodyBudget(100)), whole=True) == b"abcd"
    with pytest.raises(ClientGone):
        read(_gone, 10, Reservation(BodyBudget(100)), whole=True)


async def _gone() -> dict:
    return {"type": "http.disconnect"}
