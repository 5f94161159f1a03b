"""Least-outstanding choice under per-replica limits (router.balancer)."""

from __future__ import annotations

from router.balancer import pick
from router.catalog import ServiceAddress
from router.endpoint import Endpoint


def endpoints(*loads: int, limit: int = 4) -> list[Endpoint]:
    found = []
    for i, load in enumerate(loads):
        endpoint = Endpoint(ServiceAddress("10.0.0.1", 9000 + i), limit)
        endpoint.inflight = load
        found.append(endpoint)
    return found


def test_picks_least_loaded() -> None:
    eps = endpoints(3, 1, 2)
    assert pick(eps, 0) is eps[1]
    assert pick(eps, 2) is eps[1]


def test_ties_rotate_with_start() -> None:
    eps = endpoints(0, 0, 0)
    assert [pick(eps, turn) for turn in range(4)] == [eps[0], eps[1], eps[2], eps[0]]


def test_excluded_are_skipped_and_empty_gives_none() -> None:
    eps = endpoints(0, 2)
    assert pick(eps, 0, exclude=[eps[0]]) is eps[1]
    assert pick(eps, 0, exclude=eps) is None
    assert pick([], 0) is None


def test_endpoints_at_their_limit_are_skipped() -> None:
    eps = endpoints(4, 3, limit=4)
    assert pick(eps, 0) is eps[1]
    eps[1].inflight = 4
    assert pick(eps, 0) is None
    eps[0].limit = 8  # its /props said 8 slots
    assert pick(eps, 1) is eps[0]


def test_url_and_ipv6_host() -> None:
    assert str(Endpoint(ServiceAddress("::1", 8080), 4).url("/v1/x")) == "http://[::1]:8080/v1/x"
    assert str(Endpoint(ServiceAddress("h", 81), 4).url("/v1/x")) == "http://h:81/v1/x"
