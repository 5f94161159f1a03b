"""router.collector: the objects alive when the router starts leave the cycle
collector's walks."""

from __future__ import annotations

import gc

from router import collector


def test_freeze_moves_what_is_alive_out_of_the_collections() -> None:
    try:
        frozen = collector.freeze()
        assert frozen == gc.get_freeze_count() > 1000
        # Only what was made since is walked: a full collection sees far fewer.
        tracked = len(gc.get_objects())
        assert tracked < frozen
    finally:
        gc.unfreeze()
