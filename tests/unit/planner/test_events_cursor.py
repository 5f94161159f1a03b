"""How the watcher judges the indexes of one event stream (planner.agents.events.Cursor), after
Nomad's broker: a subscription starts at the closest item it still buffers
(nomad/stream/event_buffer.go, StartAtClosest), silently."""

from __future__ import annotations

from planner.agents.events import Cursor, Verdict


def test_a_stream_that_starts_where_asked_is_new_all_along() -> None:
    cursor = Cursor(asked=100)
    assert [cursor.judge(i) for i in (100, 100, 101, 140)] == [Verdict.NEW] * 4


def test_a_stream_that_starts_later_than_asked_is_a_gap_once() -> None:
    # The buffer was trimmed past 100: the broker starts at its oldest item, 130.
    cursor = Cursor(asked=100)
    assert cursor.judge(130) == Verdict.GAP
    assert cursor.judge(130) == Verdict.NEW
    assert cursor.judge(131) == Verdict.NEW


def test_the_newest_item_delivered_again_asks_nomad_once_then_is_seen() -> None:
    # Asked beyond the buffer's end: the broker delivers its newest item (index 99) again;
    # whether Nomad was reset only Nomad's own index can tell (CHECK).
    cursor = Cursor(asked=100)
    assert cursor.judge(99) == Verdict.CHECK
    assert cursor.judge(99) == Verdict.SEEN
    assert cursor.judge(100) == Verdict.NEW


def test_an_index_going_back_on_one_stream_is_checked() -> None:
    cursor = Cursor(asked=10)
    assert cursor.judge(10) == Verdict.NEW
    assert cursor.judge(50) == Verdict.NEW
    assert cursor.judge(3) == Verdict.CHECK
