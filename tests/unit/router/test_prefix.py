"""Consistent hashing with bounded loads and the prefix key (router.prefix)."""

from __future__ import annotations

import pytest

from router.balancer import pick, usable
from router.catalog import ServiceAddress
from router.endpoint import Endpoint
from router.prefix import PrefixChooser, Ring, hash64, request_prefix


def endpoints(n: int, limit: int = 100) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(ServiceAddress("10.0.0.1", 8000 + i), limit) for i in range(n))


def first_choice(chooser: PrefixChooser, eps: tuple[Endpoint, ...], key: str) -> Endpoint:
    chosen = chooser.choose(eps, key, usable)
    assert chosen is not None
    return chosen


def test_request_prefix_takes_the_first_user_message_or_the_prompt() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "x" * 300},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "next turn"},
        ]
    }
    assert request_prefix(chat) == "x" * 100
    assert request_prefix(chat, 5) == "xxxxx"
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "ab"},
                    {"type": "image_url"},
                    {"type": "text", "text": "cd"},
                ],
            }
        ]
    }
    assert request_prefix(parts) == "abcd"
    assert request_prefix({"prompt": "Once upon"}) == "Once upon"
    assert request_prefix({"prompt": ["first", "second"]}) == "first"
    assert request_prefix({"prompt": [1, 2, 3]}) is None  # token ids: no text
    assert request_prefix({"messages": [{"role": "system", "content": "s"}]}) is None
    assert request_prefix({"input": "embed me"}) is None


def test_the_hash_is_the_same_in_every_process() -> None:
    # A fixed value: routers on different hosts must put a key at the same point.
    assert hash64("a") == 0x40F89E395B66422F
    assert hash64("a") != hash64("b")


def test_a_prefix_always_goes_to_the_same_replica_and_keys_spread() -> None:
    chooser = PrefixChooser()
    eps = endpoints(4)
    chosen = {first_choice(chooser, eps, f"conversation {i}") for i in range(5)}
    for i in range(5):
        assert first_choice(chooser, eps, f"conversation {i}") is first_choice(
            chooser, eps, f"conversation {i}"
        )
    counts = {e: 0 for e in eps}
    for i in range(4000):
        counts[first_choice(chooser, eps, f"k{i}")] += 1
    assert min(counts.values()) > 4000 / 4 * 0.75  # 256 points each: within 25% of even
    assert chosen


def test_losing_a_replica_moves_only_its_keys() -> None:
    chooser = PrefixChooser()
    eps = endpoints(4)
    before = {f"k{i}": first_choice(chooser, eps, f"k{i}") for i in range(1000)}
    fewer = eps[:3]
    for key, endpoint in before.items():
        if endpoint in fewer:
            assert first_choice(chooser, fewer, key) is endpoint


def test_the_load_bound_spills_a_hot_prefix_to_the_same_next_replica() -> None:
    chooser = PrefixChooser(load_factor=1.25)
    eps = endpoints(3)
    home = first_choice(chooser, eps, "hot")
    order = Ring(eps, chooser.replication).walk(hash64("hot"))
    assert eps[order[0]] is home
    # 4 in flight, all at home: bound = ceil(1.25 * 5 / 3) = 3, so home (4) is over it.
    home.inflight = 4
    assert chooser.bound(eps) == 3
    spill = first_choice(chooser, eps, "hot")
    assert spill is eps[order[1]]
    assert first_choice(chooser, eps, "hot") is spill
    home.inflight = 0  # under the bound again: back home
    assert first_choice(chooser, eps, "hot") is home


def test_excluded_and_full_replicas_are_passed_over_then_least_outstanding() -> None:
    chooser = PrefixChooser()
    eps = endpoints(2, limit=1)
    home = first_choice(chooser, eps, "k")
    other = next(e for e in eps if e is not home)
    assert pick(eps, 0, (home,), (chooser, "k")) is other
    home.inflight = 1  # at its limit
    assert pick(eps, 0, (), (chooser, "k")) is other
    other.inflight = 1
    assert chooser.choose(eps, "k", usable) is None
    assert pick(eps, 0, (), (chooser, "k")) is None  # the request queues
    assert chooser.choose((), "k", usable) is None


def test_the_chooser_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="load factor"):
        PrefixChooser(load_factor=0.9)
