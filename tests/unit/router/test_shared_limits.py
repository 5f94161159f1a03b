"""Limits shared by routers, the pure parts: window arithmetic (router.windows), lease
accounting, and KeyLimits (router.limits) over an in-memory store on fixed clocks.
Two KeyLimits over one store stand for two routers over one Consul; the store that
fails stands for an unreachable Consul (the real one: tests/integration/test_shared_limits.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import pytest

from router import errors
from router.keys import ApiKey
from router.limits import FAIL_OPEN_RETRY_S, Admission, KeyLimits
from router.sharedlimits import LocalCounters, limits_key
from router.windows import Lease, Period, Tally, decode_tally, later, lease_size, take, window_of

# 2026-12-02 10:00:00 UTC, a minute's start.
T0 = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC).timestamp()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingStore(LocalCounters):
    """The in-memory store, counting its calls; ``down`` makes it fail as an
    unreachable Consul does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.down = False

    async def take(
        self, name: str, kind: str, window: str, limit: int, want: int, owed: int
    ) -> tuple[int, int]:
        self.calls += 1
        await asyncio.sleep(0)  # a round trip: others run meanwhile
        if self.down:
            raise errors.CatalogUnavailable("connection refused")
        return await super().take(name, kind, window, limit, want, owed)


def router(store: CountingStore, wall: Clock, **kwargs: object) -> KeyLimits:
    limits = KeyLimits(Clock(0.0), wall=wall, shared=True, **kwargs)  # type: ignore[arg-type]
    limits.attach(store)
    return limits


def admit(limits: KeyLimits, key: ApiKey) -> Admission:
    return asyncio.run(limits.admit(key))


def served(limits: KeyLimits, key: ApiKey, count: int) -> int:
    """Requests of ``count`` admitted (each released at once)."""
    ok = 0
    for _ in range(count):
        try:
            limits.release(admit(limits, key))
            ok += 1
        except errors.RateLimited:
            pass
    return ok


def test_windows_are_utc_minutes_days_and_months() -> None:
    minute, left = window_of(Period.MINUTE, T0 + 15.5)
    assert (minute, left) == (str(int(T0 // 60)), 44.5)
    assert window_of(Period.DAY, T0) == ("2026-12-02", 14 * 3600.0)
    new_year = dt.datetime(2026, 12, 31, 23, 59, 30, tzinfo=dt.UTC).timestamp()
    assert window_of(Period.MONTH, new_year) == ("2026-12", 30.0)
    assert window_of(Period.DAY, new_year + 30) == ("2027-01-01", 86400.0)
    assert later("100000000", "99999999") and later("2027-01", "2026-12")
    assert not later("2026-12-02", "2026-12-02")


def test_take_grants_within_the_limit_and_resets_each_window() -> None:
    tally, granted = take(None, "5", limit=10, want=4)
    assert (tally, granted) == (Tally("5", 4), 4)
    tally, granted = take(tally, "5", limit=10, want=8)
    assert (tally, granted) == (Tally("5", 10), 6)
    assert take(tally, "5", limit=10, want=1) == (Tally("5", 10), 0)
    # A new window starts at 0 in the same document (nothing accumulates).
    assert take(tally, "6", limit=10, want=3) == (Tally("6", 3), 3)
    # A router still on an older window gets nothing and writes nothing over the new one.
    assert take(Tally("7", 2), "6", limit=10, want=3) == (Tally("7", 2), 0)
    # What is owed counts whatever the limit; nothing is granted past it.
    assert take(Tally("5", 8), "5", limit=10, want=5, owed=30) == (Tally("5", 38), 0)
    assert lease_size(600, 0.05) == 30 and lease_size(10, 0.05) == 1


def test_a_tally_that_does_not_decode_starts_afresh() -> None:
    assert decode_tally(Tally("5", 3).encode()) == Tally("5", 3)
    for raw in (
        None,
        b"",
        b"{",
        b"[]",
        b'{"window": 5, "used": 1}',
        b'{"window": "5", "used": true}',
        b"[" * 5000,
    ):
        assert decode_tally(raw) is None
    assert limits_key("team a/b", "requests") == "llmgw-router/limits/team%20a%2Fb/requests"


def test_lease_accounting() -> None:
    lease = Lease("5", 100)
    assert not lease.use()
    lease.granted(3, owed_sent=0, wanted=3)
    assert lease.use() and lease.use() and not lease.spent
    lease.give_back()
    assert lease.left == 2
    lease.charge(5)  # tokens beyond the lease are owed
    assert (lease.left, lease.owed) == (0, 3)
    lease.charge(4)  # charged while the ask below was under way: stays owed
    lease.granted(0, owed_sent=3, wanted=0)  # only what was owed written: not spent
    assert (lease.left, lease.owed, lease.spent) == (0, 4, False)
    lease.granted(0, owed_sent=4, wanted=1)
    assert (lease.left, lease.owed, lease.spent) == (0, 0, True)
    assert lease.current("5", 100) and not lease.current("6", 100)
    lease.charge(3)
    lease.adjust(-5)  # an estimate of 5 that used 0: back to what is owed first
    assert (lease.left, lease.owed) == (2, 0)
    lease.adjust(4)
    assert (lease.left, lease.owed) == (0, 2)
    assert not lease.current("5", 200)


def test_two_routers_together_serve_the_limit_and_ask_once_per_lease() -> None:
    store, wall = CountingStore(), Clock(T0 + 10)
    a, b = router(store, wall), router(store, wall)
    key = ApiKey("team", ("*",), requests_per_minute=600)
    # Alternating 10 x 600 requests: exactly 600 pass, in leases of 30.
    ok = sum(served(r, key, 1) for _ in range(3000) for r in (a, b))
    assert ok == 600
    assert store.calls == 600 // 30 + 2  # + the ask of each that found the minute spent
    with pytest.raises(errors.RateLimited) as raised:
        admit(a, key)
    refused = raised.value
    assert refused.type == "requests"
    headers = dict(refused.headers())
    assert headers[b"retry-after"] == b"50" and headers[b"x-ratelimit-reset-requests"] == b"50s"
    assert headers[b"x-ratelimit-limit-requests"] == b"600"
    calls = store.calls
    assert served(a, key, 100) == 0 and store.calls == calls  # spent: refused without asking
    wall.now += 50  # the next minute
    assert served(a, key, 1) == 1


def test_a_lease_left_on_one_router_is_the_slack() -> None:
    store, wall = CountingStore(), Clock(T0)
    a, b = router(store, wall), router(store, wall)
    key = ApiKey("team", ("*",), requests_per_minute=100)  # leases of 5
    assert served(a, key, 1) == 1  # a holds 4 more
    assert served(b, key, 200) == 95  # at most one lease less than the limit
    assert served(a, key, 10) == 4


def test_a_stopping_router_gives_its_unused_leases_back() -> None:
    store, wall = CountingStore(), Clock(T0)
    a, b = router(store, wall), router(store, wall)
    key = ApiKey("team", ("*",), requests_per_minute=100, budget_tokens=1000, budget_period="day")
    first = admit(a, key)  # a lease of 5 requests and one of 10 tokens
    a.release(first)
    a.charge(first, 3)
    assert store._tallies[("team", "requests")] == Tally("29936760", 5)
    assert store._tallies[("team", "tokens-day")] == Tally("2026-12-02", 10)
    asyncio.run(a.close())
    asyncio.run(a.give_back())
    # What a used stays counted; what it held and did not use is the others' again.
    assert store._tallies[("team", "requests")] == Tally("29936760", 1)
    assert store._tallies[("team", "tokens-day")] == Tally("2026-12-02", 3)
    assert served(b, key, 200) == 99  # the whole minute but a's one request
    # A lease of a window that is over is not given back (the tally counts another).
    wall.now += 60
    asyncio.run(b.give_back())
    assert store._tallies[("team", "requests")] == Tally("29936760", 100)
    # Per router (not shared): nothing to give back.
    local = KeyLimits(Clock(0.0), wall=wall)
    local.release(admit(local, key))
    asyncio.run(local.give_back())


def test_x_ratelimit_headers_say_what_this_router_knows_is_left() -> None:
    store, wall = CountingStore(), Clock(T0 + 15)
    a, b = router(store, wall), router(store, wall)
    key = ApiKey("team", ("*",), requests_per_minute=100, tokens_per_minute=1000)
    held = admit(a, key)  # a: 5 requests leased, 1 used; 50 tokens leased
    assert dict(a.headers(held)) == {
        b"x-ratelimit-limit-requests": b"100",
        b"x-ratelimit-remaining-requests": b"99",  # 95 nobody holds + a's 4
        b"x-ratelimit-reset-requests": b"45s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"1000",
        b"x-ratelimit-reset-tokens": b"45s",
    }
    other = admit(b, key)
    # b counts a's unused 4 as used: 90 nobody holds + its own 4.
    assert dict(b.headers(other))[b"x-ratelimit-remaining-requests"] == b"94"
    a.estimate(held, 400)  # 100 tokens estimated: 50 of the lease, 50 owed
    assert dict(a.headers(held))[b"x-ratelimit-remaining-tokens"] == b"900"
    # A key with only a budget or concurrency gets none (OpenAI has no such header).
    assert a.headers(admit(a, ApiKey("b", ("*",), concurrent_requests=1))) == []
    # Per router: the bucket's standing.
    local = KeyLimits(Clock(0.0), wall=wall)
    taken = admit(local, ApiKey("team", ("*",), requests_per_minute=60))
    assert dict(local.headers(taken))[b"x-ratelimit-remaining-requests"] == b"59"
    assert dict(local.headers(taken))[b"x-ratelimit-reset-requests"] == b"1s"


def test_a_request_the_router_refuses_itself_is_given_back() -> None:
    store, wall = CountingStore(), Clock(T0)
    limits = router(store, wall)
    key = ApiKey("team", ("*",), requests_per_minute=20)  # leases of 1
    for _ in range(50):
        admission = admit(limits, key)
        limits.refund(admission)
        limits.release(admission)
    assert store.calls == 1  # one lease, given back 50 times
    assert served(limits, key, 30) == 20
    # Per router (a bucket) too.
    local = KeyLimits(Clock(0.0))
    key = ApiKey("team", ("*",), requests_per_minute=2)
    for _ in range(5):
        admission = admit(local, key)
        local.refund(admission)
        local.release(admission)
    assert served(local, key, 5) == 2


def test_concurrent_requests_wait_for_one_ask() -> None:
    store, wall = CountingStore(), Clock(T0)
    limits = router(store, wall)
    key = ApiKey("team", ("*",), requests_per_minute=200)  # leases of 10

    async def burst() -> list[object]:
        return await asyncio.gather(*(limits.admit(key) for _ in range(10)), return_exceptions=True)

    results = asyncio.run(burst())
    assert all(isinstance(r, Admission) for r in results)
    assert store.calls == 1


@pytest.mark.timeout(20, method="thread")  # a spin never yields: only a thread ends it
def test_more_requests_at_once_than_a_lease_holds_ask_again_and_end() -> None:
    """bench/limits.py found a router spinning for ever when the requests waiting on
    one ask outnumbered the units it brought: the rest awaited the finished ask again."""
    store, wall = CountingStore(), Clock(T0)
    limits = router(store, wall)

    async def burst(key: ApiKey, count: int) -> list[object]:
        return await asyncio.gather(
            *(limits.admit(key) for _ in range(count)), return_exceptions=True
        )

    async def scenario() -> None:
        plenty = ApiKey("plenty", ("*",), requests_per_minute=200)  # leases of 10
        results = await asyncio.wait_for(burst(plenty, 35), 5)
        assert all(isinstance(r, Admission) for r in results)
        assert store.calls == 4
        scarce = ApiKey("scarce", ("*",), requests_per_minute=20)  # leases of 1
        results = await asyncio.wait_for(burst(scarce, 30), 5)
        assert sum(isinstance(r, Admission) for r in results) == 20
        assert sum(isinstance(r, errors.RateLimited) for r in results) == 10

    asyncio.run(scenario())


def test_a_spent_budget_is_insufficient_quota_on_every_router_until_the_day_ends() -> None:
    store, wall = CountingStore(), Clock(T0)
    a, b = router(store, wall), router(store, wall)
    key = ApiKey("team", ("*",), budget_tokens=1000, budget_period="day")  # leases of 10

    async def answer(limits: KeyLimits, tokens: int) -> None:
        admission = await limits.admit(key)
        limits.release(admission)
        limits.charge(admission, tokens)
        await limits.close()  # the owed tokens written

    asyncio.run(answer(a, 600))
    asyncio.run(answer(b, 500))  # admitted on what was left; overruns it by 100
    for limits in (a, b):
        with pytest.raises(errors.QuotaExceeded) as raised:
            admit(limits, key)
        refused = raised.value
        assert (refused.status, refused.type, refused.code) == (
            429, "insufficient_quota", "insufficient_quota",
        )  # fmt: skip
        headers = dict(refused.headers())
        assert headers[b"x-should-retry"] == b"false"
        assert headers[b"retry-after"] == str(14 * 3600).encode()
    wall.now += 14 * 3600  # the next UTC day
    asyncio.run(answer(a, 10))


def test_consul_unreachable_fails_open_on_each_routers_own_limit() -> None:
    store, wall = CountingStore(), Clock(T0)
    opened: list[int] = []
    limits = router(store, wall, fail_open=lambda: opened.append(1))
    clock = limits._clock = Clock(0.0)  # type: ignore[method-assign]
    key = ApiKey("team", ("*",), requests_per_minute=20)
    budgeted = ApiKey("paid", ("*",), budget_tokens=100, budget_period="month")
    store.down = True
    # The per-router bucket is the floor: the limit at once, then 429.
    assert served(limits, key, 30) == 20
    assert len(opened) == 20 and limits.failing_open
    assert store.calls == 1  # asked once; not again until FAIL_OPEN_RETRY_S
    admit(limits, budgeted)  # a budget is not checked while failing open
    assert store.calls == 1 and len(opened) == 21
    store.down = False
    clock.now += FAIL_OPEN_RETRY_S
    assert not limits.failing_open
    assert served(limits, key, 1) == 1 and store.calls == 2  # shared again


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 23's QA: a stopped Consul logged "failing open" at every ask, 5 s apart."""
    store, wall = CountingStore(), Clock(T0)
    limits = router(store, wall)
    clock = limits._clock = Clock(0.0)  # type: ignore[method-assign]
    key = ApiKey("team", ("*",), requests_per_minute=600)
    store.down = True
    with caplog.at_level(logging.WARNING, logger="router.limits"):
        for _ in range(4):
            served(limits, key, 40)
            clock.now += FAIL_OPEN_RETRY_S
        assert store.calls == 4
        store.down = False
        served(limits, key, 1)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "failing open" in said[0] and "Consul answers again" in said[1]


def test_tokens_per_minute_are_estimated_at_admission_and_corrected_by_usage() -> None:
    store, wall = CountingStore(), Clock(T0)
    a, b = router(store, wall), router(store, wall)
    key = ApiKey("team", ("*",), tokens_per_minute=1000)  # leases of 50

    async def scenario() -> None:
        first = await a.admit(key)
        a.estimate(first, 400)  # a 400-byte body: 100 tokens estimated
        assert first.minute_tokens is not None and first.estimated == 100
        refused = await a.admit(key)
        a.estimate(refused, 40)
        a.refund(refused)  # refused by the router: its estimate given back
        a.release(refused)
        a.release(first)
        a.charge(first, 30)  # used 30: 70 of the estimate given back
        await a.close()
        used = await b.admit(key)
        b.release(used)
        b.charge(used, 940)  # 50 leased + 890 owed: the minute's 1,000 spent
        await b.close()
        # a still holds 120 (its lease, the estimate's excess given back): the slack.
        held = await a.admit(key)
        a.release(held)
        a.charge(held, 200)  # 80 owed
        await a.close()
        with pytest.raises(errors.RateLimited) as raised:
            await a.admit(key)
        headers = dict(raised.value.headers())
        # OpenAI's type for a TPM refusal is "tokens", for an RPM one "requests".
        assert (raised.value.code, raised.value.type) == ("rate_limit_exceeded", "tokens")
        assert headers[b"x-ratelimit-limit-tokens"] == b"1000"
        assert headers[b"x-ratelimit-remaining-tokens"] == b"0"
        assert headers[b"retry-after"] == b"60"

    asyncio.run(scenario())
    # a: 50 leased, 50 owed (the estimate of 100), 50 leased, 80 owed; b: 50 leased, 890 owed.
    assert store._tallies[("team", "tokens-minute")].used == 50 + 50 + 50 + 80 + 50 + 890


def test_windows_are_computed_once_per_window_and_again_when_the_clock_goes_back() -> None:
    wall = Clock(T0 + 10)
    limits = router(CountingStore(), wall)
    minute = int(T0 // 60)
    assert limits._window(Period.MINUTE) == (str(minute), 50.0)
    wall.now += 49.5
    assert limits._window(Period.MINUTE) == (str(minute), 0.5)
    wall.now += 0.5
    assert limits._window(Period.MINUTE) == (str(minute + 1), 60.0)
    wall.now = T0 - 10  # set back
    assert limits._window(Period.MINUTE) == (str(minute - 1), 10.0)
    assert limits._window(Period.DAY) == ("2026-12-02", 14 * 3600 + 10.0)
