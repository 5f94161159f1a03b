"""Least-outstanding choice and in-flight counting (router.balancer)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge

from router.balancer import Endpoint, InFlight, pick
from router.catalog import ServiceAddress


def endpoints(*loads: int) -> list[Endpoint]:
    found = []
    for i, load in enumerate(loads):
        endpoint = Endpoint(ServiceAddress("10.0.0.1", 9000 + i))
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
    eps = endpoints(0, 5)
    assert pick(eps, 0, exclude=[eps[0]]) is eps[1]
    assert pick(eps, 0, exclude=eps) is None
    assert pick([], 0) is None


def test_url_and_ipv6_host() -> None:
    assert str(Endpoint(ServiceAddress("::1", 8080)).url("/v1/x")) == "http://[::1]:8080/v1/x"
    assert str(Endpoint(ServiceAddress("h", 81)).url("/v1/x")) == "http://h:81/v1/x"


def test_inflight_pairs_even_on_error() -> None:
    gauge = Gauge("g", "g", registry=CollectorRegistry())
    (endpoint,) = endpoints(0)
    with InFlight(endpoint, gauge):
        assert endpoint.inflight == 1
        assert gauge._value.get() == 1
    with pytest.raises(RuntimeError), InFlight(endpoint, gauge):
        assert endpoint.inflight == 1
        raise RuntimeError
    assert endpoint.inflight == 0
    assert gauge._value.get() == 0
