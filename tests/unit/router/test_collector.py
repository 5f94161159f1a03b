"""router.collector: the objects alive when the router starts leave the cycle
collector's walks, and so do a model's when the model set changes."""

from __future__ import annotations

import gc
import weakref

import pytest

from router import collector


@pytest.fixture
def serving(monkeypatch: pytest.MonkeyPatch):
    """As in ``router serve``; the test process's collector restored after."""
    monkeypatch.setattr(collector, "_serving", False)
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_moves_what_is_alive_out_of_the_collections(serving: None) -> None:
    frozen = collector.freeze()
    assert frozen == gc.get_freeze_count() > 1000
    # Only what was made since is walked: a full collection sees far fewer.
    tracked = len(gc.get_objects())
    assert tracked < frozen


def test_freeze_raises_only_the_young_threshold(serving: None) -> None:
    _, older, oldest = gc.get_threshold()
    collector.freeze()
    assert gc.get_threshold() == (collector.GEN0_THRESHOLD, older, oldest)


def test_settle_freezes_what_was_made_since_and_keeps_no_garbage(serving: None) -> None:
    collector.freeze()
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(5000)]  # a model's series, say
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage  # a cycle left by a removed model
    collector.settle()
    assert gc.get_freeze_count() >= frozen + 5000
    assert gone() is None  # collected, not frozen
    assert not any(o is kept for o in gc.get_objects())  # frozen: never walked
    assert len(kept) == 5000


def test_settle_does_nothing_outside_a_serving_router(serving: None) -> None:
    collector.settle()
    assert gc.get_freeze_count() == 0
