"""Per-key limits: requests and tokens per minute and a token budget shared by every
router, concurrent requests per router.

:class:`KeyLimits` is asked by :class:`router.proxy.Proxy` right after a
request's key is authenticated (before its body is read, so a refused request
costs no body), for keys with ``limits`` in the keys file (:mod:`router.keys`)::

    limits:
      requests_per_minute: 600     # every router together, per UTC minute
      tokens_per_minute: 40000     # every router together, per UTC minute
      concurrent_requests: 8       # requests of the key in this router at once
      tokens_per_day: 2000000      # a budget (or tokens_per_month), UTC

**Shared** (``LLMGW_ROUTER_SHARED_LIMITS``, the default): the requests of a
minute and the tokens of a day or month are counted in Consul KV
(:mod:`router.sharedlimits`, one document per key and kind). A router takes a
*lease* of the allowance by compare-and-set (:data:`REQUEST_LEASE_FRACTION` of
the per-minute limit, :data:`BUDGET_LEASE_FRACTION` of a budget, at least 1)
and serves from it in memory: a request costs a Consul round trip only when
its router's lease is used up (one when this router wrote the document last,
two when another did), and one request at a time per key and router asks
(the others wait for its answer). The arithmetic and what a lease costs in
precision are in :mod:`router.windows`: routers together never grant more
requests than the limit in a minute; unused leases are lost at the minute's
end. The window is a fixed UTC minute, not a sliding one: a key may send its
limit at the end of one minute and again at the start of the next.

Tokens are charged from the answer's ``usage`` (:mod:`router.accounting`; with
``LLMGW_ROUTER_ACCOUNTING=false`` nothing is charged but the estimate below): a
request is admitted while its router holds some of the budget (or of the
minute's tokens), and what it used is taken from that lease after it ends. For
tokens per minute the prompt is estimated once the body is read
(:data:`BYTES_PER_TOKEN`) and charged at once, so a burst of large prompts is
held back before any answer; the answer's usage then corrects it (an
overestimate is given back to the lease; an answer without usage keeps the
estimate); beyond the lease it is owed and written to the
shared tally at once (one compare-and-set, off the request path), so the
other routers see a budget spent within a round trip of the answer that spent
it. A budget can thus be overrun by what the requests in flight when it ran out
use.

**Per router** (``LLMGW_ROUTER_SHARED_LIMITS=false``, and as the floor while
Consul does not answer): requests per minute are a token bucket (the limit at
once, refilled at limit/60 per second); tokens per minute and budgets are
counted in memory, by the same windows as shared: with R
routers a key gets up to R times its limits.

**Consul unreachable**: a lease that cannot be taken (no answer in
:data:`router.sharedlimits.TIMEOUT_S`, an error, a 403) fails open for
:data:`FAIL_OPEN_RETRY_S`: requests are admitted on this router's own bucket
(the per-router limit above), tokens per minute and budgets are not checked
(tokens used meanwhile
are owed, and written when Consul answers again, in the same window),
``llmgw_router_limits_fail_open_total`` counts the requests so admitted, and
``llmgw_router_limits_shared`` reads 0; one warning is logged when it starts
and one line when Consul answers again. Failing open keeps a Consul outage from
becoming an outage of every limited key.

Over a limit the answer is OpenAI's: 429, type ``requests``, code
``rate_limit_exceeded``, with ``Retry-After`` (whole seconds, at least 1) and,
for the per-minute limit, ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests`` and ``x-ratelimit-reset-requests`` (until
the minute ends, or the bucket is full, in OpenAI's ``1m30s`` / ``250ms``
spelling). The concurrency limit has no OpenAI header of its own:
``Retry-After: 1``. Tokens per minute: ``x-ratelimit-limit-tokens``,
``x-ratelimit-remaining-tokens: 0``, ``x-ratelimit-reset-tokens``. A spent
budget is 429 ``insufficient_quota`` (type and code, as OpenAI answers a spent
quota), ``Retry-After`` until the period ends, and
``x-should-retry: false`` (the OpenAI SDKs would otherwise retry a 429).
Every other answer to an admitted request carries the key's standing, as OpenAI
sends on every response (:meth:`KeyLimits.headers`):
``x-ratelimit-{limit,remaining,reset}-requests`` and ``-tokens`` for the
per-minute limits the key has.

At shutdown a router gives back what its leases of the current windows hold and
did not use (:meth:`KeyLimits.give_back`), so a stopped router keeps none of a
key's minute or budget.

A request the router then refuses itself (an unknown or forbidden model, a
parked one, no replica, a bad body...) is given back (:meth:`KeyLimits.refund`),
its prompt's estimate too: only requests that reached a replica use the
per-minute allowances.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from router import errors
from router.keys import ApiKey
from router.sharedlimits import CounterStore, LocalCounters
from router.windows import Lease, Period, lease_size, window_of

log = logging.getLogger(__name__)

# Retry-After of a concurrency refusal: a slot frees when one of the key's
# requests ends, which the router cannot predict.
CONCURRENCY_RETRY_AFTER_S = 1
# A lease is this share of the limit (at least 1): 5% of the requests of a minute
# is a Consul round trip per 20 requests at most, and at most 5% of the limit lost
# per router and minute when the load moves between routers.
REQUEST_LEASE_FRACTION = 0.05
# 1% of a budget: a budget is large (millions of tokens) and one answer takes many.
BUDGET_LEASE_FRACTION = 0.01
# Seconds the limits fail open after Consul did not answer, before asking again
# (a hung Consul costs one request every FAIL_OPEN_RETRY_S a timeout, not each one).
FAIL_OPEN_RETRY_S = 5.0
# The tally kinds: requests and tokens of a minute; tokens of a budget's period.
REQUESTS = "requests"
MINUTE_TOKENS = "tokens-minute"
# A prompt's tokens estimated from its body at admission (OpenAI's rule of thumb: a
# token is ~4 characters of English); the answer's usage corrects it.
BYTES_PER_TOKEN = 4


def budget_kind(period: str) -> str:
    """The tally kind of a budget per ``period`` (``tokens-day``, ``tokens-month``)."""
    return f"tokens-{period}"


# The period each tally kind counts over.
_PERIODS = {
    REQUESTS: Period.MINUTE,
    MINUTE_TOKENS: Period.MINUTE,
    budget_kind(Period.DAY): Period.DAY,
    budget_kind(Period.MONTH): Period.MONTH,
}


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI's ``x-ratelimit-reset-*`` values spell it: ``250ms``,
    ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


class _Bucket:
    __slots__ = ("per_minute", "tokens", "updated")

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.tokens = float(per_minute)
        self.updated = now

    def take(self, now: float) -> float:
        """Take one request; 0 when taken, else the seconds until one is there."""
        rate = self.per_minute / 60.0
        self.tokens = min(float(self.per_minute), self.tokens + (now - self.updated) * rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate

    def give_back(self) -> None:
        self.tokens = min(float(self.per_minute), self.tokens + 1.0)

    def full_in(self) -> float:
        return (self.per_minute - self.tokens) / (self.per_minute / 60.0)


@dataclass(slots=True)
class Admission:
    """One admitted request of ``key``: where its request was taken from (a shared
    lease, this router's bucket, or nothing: no per-minute limit) and the budget and
    tokens-per-minute leases its tokens are charged to."""

    key: ApiKey
    requests: Lease | _Bucket | None = None
    budget: Lease | None = None
    # Tokens per minute: the lease, and the prompt's estimate charged to it at
    # admission (corrected by the answer's usage).
    minute_tokens: Lease | None = None
    estimated: int = 0
    # The prompt's estimate from the body, kept for any key whose tokens are charged:
    # an answer without usage is charged it plus what the client got (`unread`).
    prompt_estimate: int = 0

    @property
    def counts_tokens(self) -> bool:
        """Whether the answer's tokens are charged (a budget or tokens per minute)."""
        return self.budget is not None or self.minute_tokens is not None


class KeyLimits:
    """The limits state of one router, for every limited key.

    ``clock``: monotonic seconds (buckets, fail-open timing); ``wall``: seconds since
    the epoch (the windows). ``shared``: the allowances are counted in ``store``
    (:meth:`attach`, a :class:`router.sharedlimits.ConsulCounters`), else in memory.
    ``fail_open()`` is called once per request admitted without the shared limits.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall: Callable[[], float] = time.time,
        shared: bool = False,
        fail_open: Callable[[], None] = lambda: None,
    ) -> None:
        self._clock = clock
        self._wall = wall
        self.shared = shared
        self._store: CounterStore = LocalCounters()
        self._count_open = fail_open
        self._buckets: dict[str, _Bucket] = {}
        self._inflight: dict[str, int] = {}
        self._leases: dict[tuple[str, str], Lease] = {}
        # One compare-and-set under way per (key, kind); the others wait on it.
        self._refills: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._settling: set[asyncio.Future[None]] = set()
        # Until when (clock) the limits fail open; None: they hold.
        self._open_until: float | None = None
        # The current window of each period and when it ends (wall): a day's or a
        # month's costs ~9 us to compute (datetime), a lookup ~0.1 us.
        self._windows: dict[Period, tuple[str, float, float]] = {}

    def attach(self, store: CounterStore) -> None:
        """Count the shared allowances in ``store`` (set by the app's lifespan)."""
        self._store = store

    @property
    def failing_open(self) -> bool:
        """Whether Consul did not answer within the last :data:`FAIL_OPEN_RETRY_S`."""
        return self._open_until is not None and self._clock() < self._open_until

    async def admit(self, key: ApiKey) -> Admission:
        """Count one request of ``key`` in; pair with :meth:`release`.

        Raises :class:`router.errors.RateLimited` (and counts nothing) when the key
        is at its concurrent requests or out of requests or tokens this minute, and
        :class:`router.errors.QuotaExceeded` when its budget is spent.
        """
        name = key.name
        inflight = self._inflight.get(name, 0)
        concurrent = key.concurrent_requests
        if concurrent is not None and inflight >= concurrent:
            raise errors.RateLimited(
                f"Rate limit reached for key `{name}` on concurrent requests: limit "
                f"{concurrent}, in flight {inflight}. Retry when one of them has ended.",
                [(b"retry-after", str(CONCURRENCY_RETRY_AFTER_S).encode())],
            )
        # Counted in before any wait, so that requests waiting for a lease together
        # cannot pass the concurrency limit together.
        self._inflight[name] = inflight + 1
        admission = Admission(key)
        try:
            if key.budget_tokens is not None:
                admission.budget = await self._budget(key)
            if key.tokens_per_minute is not None:
                admission.minute_tokens = await self._minute_tokens(key, key.tokens_per_minute)
            if key.requests_per_minute is not None:
                admission.requests = await self._request(key, key.requests_per_minute)
        except BaseException:
            self._release(name)
            raise
        return admission

    def release(self, admission: Admission) -> None:
        """The request of an :meth:`admit` ended."""
        self._release(admission.key.name)

    def refund(self, admission: Admission) -> None:
        """The request was refused by the router itself: its request is given back to
        where it was taken from (served again by this router)."""
        taken, admission.requests = admission.requests, None
        if taken is not None:
            taken.give_back()
        if admission.minute_tokens is not None:
            admission.minute_tokens.adjust(-admission.estimated)
            admission.estimated = 0
        admission.prompt_estimate = 0  # no replica read the prompt

    def estimate(self, admission: Admission, body_bytes: int) -> None:
        """Charge the prompt's estimate (:data:`BYTES_PER_TOKEN`) to the key's tokens per
        minute once the body is read; :meth:`charge` corrects it by the answer's usage."""
        admission.prompt_estimate = max(1, body_bytes // BYTES_PER_TOKEN)
        if admission.minute_tokens is None:
            return
        admission.estimated = admission.prompt_estimate
        admission.minute_tokens.charge(admission.estimated)

    def unread(self, admission: Admission, delivered: int) -> None:
        """The answer carried no usage the router read (the client left a stream before
        its last event, which holds the usage, or left before any answer): charge the
        prompt's estimate and the ``delivered`` completion tokens the client got (one
        per event), so leaving early is never a way around a budget (issue 23's QA: 312
        tokens through a 100-token budget; then 10 prompts of ~525 tokens each, left
        before the first event, charged nothing). A request the router refused itself
        has no estimate left (:meth:`refund`)."""
        self.charge(admission, admission.prompt_estimate + delivered)

    def charge(self, admission: Admission, tokens: int) -> None:
        """The request used ``tokens`` (prompt and completion): taken from its budget
        lease; what the lease did not hold is written to the shared tally now, in
        the background."""
        key = admission.key
        if admission.budget is not None and tokens > 0:
            assert key.budget_period is not None
            admission.budget.charge(tokens)
            self._owe(key.name, budget_kind(key.budget_period), admission.budget)
        if admission.minute_tokens is not None:
            admission.minute_tokens.adjust(tokens - admission.estimated)
            admission.estimated = tokens
            self._owe(key.name, MINUTE_TOKENS, admission.minute_tokens)

    def _owe(self, name: str, kind: str, lease: Lease) -> None:
        if lease.owed > 0:
            # Only what is owed (nothing asked): the next request asks for a lease,
            # and so learns at once when the others have spent the allowance meanwhile.
            settle = asyncio.ensure_future(self._settle(name, kind, lease))
            self._settling.add(settle)
            settle.add_done_callback(self._settling.discard)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Wait (at most ``timeout_s``) for the tokens being written to be written."""
        if self._settling:
            await asyncio.wait(list(self._settling), timeout=timeout_s)

    async def give_back(self, timeout_s: float = 2.0) -> None:
        """At shutdown, once no request is left and :meth:`close` waited: give back to
        the shared tallies what this router's leases of the current windows hold and
        did not use (one compare-and-set per lease, all at once, at most ``timeout_s``),
        so that a stopped router does not keep up to a lease of each key's minute or
        budget. Routers that found a window spent do not ask again within it, so what is
        given back serves the others' next asks. A failure is logged; those units are
        then lost until their window ends, as without it."""
        if not self.shared:
            return
        returns = [
            asyncio.ensure_future(self._store.give_back(name, kind, lease.window, lease.left))
            for (name, kind), lease in self._leases.items()
            if lease.left > 0 and lease.window == self._window(_PERIODS[kind])[0]
        ]
        if not returns:
            return
        done, pending = await asyncio.wait(returns, timeout=timeout_s)
        for task in pending:
            task.cancel()
        raised = [t.exception() for t in done if t.exception() is not None]
        lost = len(raised) + len(pending)
        if lost:
            log.warning(
                "per-key limits: %d of %d unused leases not given back to Consul (%s); "
                "they are lost until their window ends",
                lost,
                len(returns),
                raised[0] if raised else f"no answer within {timeout_s:g} s",
            )
        else:
            log.info("per-key limits: %d unused leases given back to Consul", len(returns))

    def headers(self, admission: Admission) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for the answer to an admitted request, as
        this router knows its key's standing when the answer starts: for requests per
        minute ``x-ratelimit-{limit,remaining,reset}-requests``, for tokens per minute
        ``x-ratelimit-{limit,remaining,reset}-tokens`` (OpenAI sends them on every
        answer). Shared, ``remaining`` counts what the other routers leased as used
        (:meth:`router.windows.Lease.remaining`); per router, the bucket's."""
        key = admission.key
        found: list[tuple[bytes, bytes]] = []
        if key.requests_per_minute is not None:
            taken = admission.requests or (
                self._leases.get((key.name, REQUESTS))
                if self.shared
                else self._buckets.get(key.name)
            )
            remaining, reset = self._standing(taken, key.requests_per_minute)
            found += _standing_headers(b"requests", key.requests_per_minute, remaining, reset)
        if key.tokens_per_minute is not None:
            remaining, reset = self._standing(admission.minute_tokens, key.tokens_per_minute)
            found += _standing_headers(b"tokens", key.tokens_per_minute, remaining, reset)
        return found

    def _standing(self, taken: Lease | _Bucket | None, limit: int) -> tuple[int, float]:
        """``(remaining, seconds until the window resets)`` of a per-minute limit."""
        if isinstance(taken, _Bucket):
            return int(taken.tokens), taken.full_in()
        window, ends_in = self._window(Period.MINUTE)
        if taken is None or taken.window != window:
            return limit, ends_in
        return min(limit, taken.remaining()), ends_in

    async def _settle(self, name: str, kind: str, lease: Lease) -> None:
        """Write what ``lease`` owes (an ask already under way may carry only part of
        it); while failing open it stays owed until the next ask."""
        while lease.owed > 0 and not self.failing_open:
            await self._refill(name, kind, lease, 0)

    def _release(self, name: str) -> None:
        left = self._inflight.get(name, 0) - 1
        if left > 0:
            self._inflight[name] = left
        else:
            self._inflight.pop(name, None)

    async def _request(self, key: ApiKey, per_minute: int) -> Lease | _Bucket:
        if not self.shared:
            return self._bucket(key, per_minute)
        window, ends_in = self._window(Period.MINUTE)
        lease = self._lease(key.name, REQUESTS, window, per_minute)
        while True:
            if lease.use():
                return lease
            if lease.spent:
                raise _requests_refusal(key.name, per_minute, ends_in, ends_in)
            if self.failing_open:
                taken = self._bucket(key, per_minute)
                self._count_open()
                return taken
            await self._refill(
                key.name, REQUESTS, lease, lease_size(per_minute, REQUEST_LEASE_FRACTION)
            )

    async def _budget(self, key: ApiKey) -> Lease:
        assert key.budget_tokens is not None and key.budget_period is not None
        budget, period = key.budget_tokens, key.budget_period

        def refusal(ends_in: float) -> errors.RateLimited:
            return errors.QuotaExceeded(
                f"You exceeded your current quota: key `{key.name}` used its budget of "
                f"{budget} tokens this {period} (UTC). It renews in {duration(ends_in)}.",
                [
                    (b"retry-after", str(max(1, math.ceil(ends_in))).encode()),
                    (b"x-should-retry", b"false"),
                ],
            )

        return await self._tokens(
            key.name, budget_kind(period), Period(period), budget, BUDGET_LEASE_FRACTION, refusal
        )

    async def _minute_tokens(self, key: ApiKey, per_minute: int) -> Lease:
        def refusal(ends_in: float) -> errors.RateLimited:
            return errors.RateLimited(
                f"Rate limit reached for key `{key.name}` on tokens per minute (TPM): limit "
                f"{per_minute}. Please try again in {duration(ends_in)}.",
                [
                    (b"retry-after", str(max(1, math.ceil(ends_in))).encode()),
                    (b"x-ratelimit-limit-tokens", str(per_minute).encode()),
                    (b"x-ratelimit-remaining-tokens", b"0"),
                    (b"x-ratelimit-reset-tokens", duration(ends_in).encode()),
                ],
                kind="tokens",
            )

        return await self._tokens(
            key.name, MINUTE_TOKENS, Period.MINUTE, per_minute, REQUEST_LEASE_FRACTION, refusal
        )

    async def _tokens(
        self,
        name: str,
        kind: str,
        period: Period,
        limit: int,
        fraction: float,
        refusal: Callable[[float], errors.RateLimited],
    ) -> Lease:
        """The lease a request of tokens is admitted on: some of it left (what the
        request uses is charged later); raises ``refusal(seconds to the window's end)``
        when the window's tokens are spent."""
        window, ends_in = self._window(period)
        lease = self._lease(name, kind, window, limit)
        while True:
            if lease.left > 0:
                return lease
            if lease.spent:
                raise refusal(ends_in)
            if self.failing_open and self.shared:
                self._count_open()
                return lease
            await self._refill(name, kind, lease, lease_size(limit, fraction))

    def _window(self, period: Period) -> tuple[str, float]:
        """:func:`router.windows.window_of` now, computed once per window."""
        now = self._wall()
        known = self._windows.get(period)
        # Valid from when it was computed to its end (a clock set back asks again).
        if known is not None and known[1] <= now < known[2]:
            return known[0], known[2] - now
        window, ends_in = window_of(period, now)
        self._windows[period] = (window, now, now + ends_in)
        return window, ends_in

    def _lease(self, name: str, kind: str, window: str, limit: int) -> Lease:
        lease = self._leases.get((name, kind))
        if lease is None or not lease.current(window, limit):
            lease = self._leases[(name, kind)] = Lease(window, limit)
        return lease

    def _bucket(self, key: ApiKey, per_minute: int) -> _Bucket:
        """One request from this router's bucket of ``key``; raises RateLimited."""
        now = self._clock()
        bucket = self._buckets.get(key.name)
        if bucket is None or bucket.per_minute != per_minute:
            bucket = self._buckets[key.name] = _Bucket(per_minute, now)
        wait = bucket.take(now)
        if wait > 0:
            raise _requests_refusal(key.name, per_minute, wait, bucket.full_in())
        return bucket

    async def _refill(self, name: str, kind: str, lease: Lease, want: int) -> None:
        """Ask the store for ``want`` more units of ``lease`` (one ask per key and kind
        at a time: a second caller waits for the first's answer). A store that fails
        makes the limits fail open (nothing raised)."""
        pending = self._refills.get((name, kind))
        if pending is None or pending.done():
            # A done ask is never awaited again: awaiting a done future does not
            # yield, so a caller that found its lease emptied by the others would
            # spin on it without ever letting the loop run (found by bench/limits.py:
            # 16 requests at once for a lease of 5 held a router at 100% CPU).
            pending = asyncio.ensure_future(self._take(name, kind, lease, want))
            self._refills[(name, kind)] = pending
        # Shielded: a client that leaves must not cancel the ask the others wait on.
        await asyncio.shield(pending)

    async def _take(self, name: str, kind: str, lease: Lease, want: int) -> None:
        owed = lease.owed
        try:
            granted, seen = await self._store.take(
                name, kind, lease.window, lease.limit, want, owed
            )
        except errors.CatalogUnavailable as exc:
            # Said once per outage, not at every ask FAIL_OPEN_RETRY_S apart (issue 23's
            # QA: a stopped Consul logged this every 5 s); its end is said below.
            if self._open_until is None:
                log.warning(
                    "per-key limits: Consul did not answer (%s); failing open: each router "
                    "holds requests per minute alone, tokens per minute and budgets are not "
                    "checked, until "
                    "Consul answers (asked again every %g s)",
                    exc,
                    FAIL_OPEN_RETRY_S,
                )
            self._open_until = self._clock() + FAIL_OPEN_RETRY_S
            return
        lease.granted(granted, owed, want, seen)
        if self._open_until is not None:
            self._open_until = None
            log.warning("per-key limits: Consul answers again; the limits are shared again")


def _standing_headers(
    unit: bytes, limit: int, remaining: int, reset: float
) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-ratelimit-limit-" + unit, str(limit).encode()),
        (b"x-ratelimit-remaining-" + unit, str(remaining).encode()),
        (b"x-ratelimit-reset-" + unit, duration(reset).encode()),
    ]


def _requests_refusal(name: str, per_minute: int, wait: float, reset: float) -> errors.RateLimited:
    return errors.RateLimited(
        f"Rate limit reached for key `{name}` on requests per minute (RPM): "
        f"limit {per_minute}. Please try again in {duration(wait)}.",
        [
            (b"retry-after", str(max(1, math.ceil(wait))).encode()),
            (b"x-ratelimit-limit-requests", str(per_minute).encode()),
            (b"x-ratelimit-remaining-requests", b"0"),
            (b"x-ratelimit-reset-requests", duration(reset).encode()),
        ],
    )
