"""Per-key request limits: requests per minute and concurrent requests, per router.

:class:`KeyLimits` is asked by :class:`router.proxy.Proxy` right after a
request's key is authenticated (before its body is read, so a refused request
costs no body), for keys with ``limits`` in the keys file (:mod:`router.keys`)::

    limits:
      requests_per_minute: 600     # a token bucket: 600 at once, refilled at 10/s
      concurrent_requests: 8       # requests of the key in the router at once

Over a limit the answer is OpenAI's: 429, type ``requests``, code
``rate_limit_exceeded``, with ``Retry-After`` (whole seconds, at least 1) and,
for the per-minute limit, ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests`` and ``x-ratelimit-reset-requests`` (the time
until the bucket is full again, in OpenAI's ``1m30s`` / ``250ms`` spelling).
The concurrency limit has no OpenAI header of its own: ``Retry-After: 1``.

The state is this router's, in memory: with R routers a key gets up to R times
its limits (docs/router.md says what sharing it through Consul would take).
Buckets are kept per key name and made anew when a reload changes the key's
rate; the memory is one small object per limited key.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from router import errors
from router.keys import ApiKey

# Retry-After of a concurrency refusal: a slot frees when one of the key's
# requests ends, which the router cannot predict.
CONCURRENCY_RETRY_AFTER_S = 1


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

    def full_in(self) -> float:
        return (self.per_minute - self.tokens) / (self.per_minute / 60.0)


class KeyLimits:
    """The limits state of one router, for every limited key; ``clock`` in seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._inflight: dict[str, int] = {}

    def admit(self, key: ApiKey) -> None:
        """Count one request of ``key`` in; pair with :meth:`release`.

        Raises :class:`router.errors.RateLimited` (and counts nothing) when the key
        is at its concurrent requests or out of requests this minute.
        """
        concurrent = key.concurrent_requests
        inflight = self._inflight.get(key.name, 0)
        if concurrent is not None and inflight >= concurrent:
            raise errors.RateLimited(
                f"Rate limit reached for key `{key.name}` on concurrent requests: limit "
                f"{concurrent}, in flight {inflight}. Retry when one of them has ended.",
                [(b"retry-after", str(CONCURRENCY_RETRY_AFTER_S).encode())],
            )
        per_minute = key.requests_per_minute
        if per_minute is not None:
            now = self._clock()
            bucket = self._buckets.get(key.name)
            if bucket is None or bucket.per_minute != per_minute:
                bucket = self._buckets[key.name] = _Bucket(per_minute, now)
            wait = bucket.take(now)
            if wait > 0:
                raise errors.RateLimited(
                    f"Rate limit reached for key `{key.name}` on requests per minute (RPM): "
                    f"limit {per_minute}. Please try again in {duration(wait)}.",
                    [
                        (b"retry-after", str(max(1, math.ceil(wait))).encode()),
                        (b"x-ratelimit-limit-requests", str(per_minute).encode()),
                        (b"x-ratelimit-remaining-requests", b"0"),
                        (b"x-ratelimit-reset-requests", duration(bucket.full_in()).encode()),
                    ],
                )
        self._inflight[key.name] = inflight + 1

    def release(self, key: ApiKey) -> None:
        """One request of ``key`` admitted by :meth:`admit` ended."""
        left = self._inflight.get(key.name, 0) - 1
        if left > 0:
            self._inflight[key.name] = left
        else:
            self._inflight.pop(key.name, None)
