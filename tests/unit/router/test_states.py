"""router.states: a read of llmgw/routing/ decodes only the keys whose ModifyIndex moved,
keeps the objects of the others, scans Consul's answer in pieces cut anywhere, and
skips documents too large or invalid (issue 21, item 4)."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from llmgw_contract import (
    Parked,
    RoutingDocument,
    StateDocument,
    Unplaceable,
    encode,
    routing_of,
)
from router.catalog import parse_states
from router.states import EntryScanner, StateView, pieces_of, routed
from router.watch import STATE_LOOP_SHARE, STATE_MIN_INTERVAL_S, state_interval


def entry(name: str, doc: StateDocument | bytes, index: int) -> dict[str, object]:
    """Consul's KV entry of ``name``'s routing document, as the planner writes it for
    the state ``doc`` (bytes: written as they are)."""
    raw = doc if isinstance(doc, bytes) else encode(routing_of(doc)).encode()
    return {
        "LockIndex": 0, "Key": f"llmgw/routing/{name}", "Flags": 0,
        "Value": base64.b64encode(raw).decode(), "CreateIndex": 1, "ModifyIndex": index,
    }  # fmt: skip


def body(*entries: dict[str, object]) -> bytes:
    return json.dumps(list(entries), separators=(",", ":")).encode()


def read(
    view: StateView, data: bytes | None, piece: int = 7, index: int = 100
) -> dict[str, RoutingDocument]:
    return asyncio.run(view.read(None if data is None else pieces_of(data, piece), index))


PARKED = StateDocument(name="a", parked=Parked(reason="5 failures"), last_error="boom")
UNPLACEABLE = StateDocument(name="b", unplaceable=Unplaceable(reason="no room", desired=1))
FINE = StateDocument(name="c", consecutive_failures=2)


def test_a_changed_key_alone_is_decoded_and_the_others_keep_their_objects() -> None:
    view = StateView()
    first = read(
        view, body(entry("a", PARKED, 10), entry("b", UNPLACEABLE, 11), entry("c", FINE, 12))
    )
    assert set(first) == {"a", "b"}  # c is fine: nothing to keep
    assert first["a"].parked is not None and first["a"].parked.last_error == "boom"
    assert view.decoded == 3
    moved = UNPLACEABLE.model_copy(update={"unplaceable": Unplaceable(reason="still no room")})
    second = read(view, body(entry("a", PARKED, 10), entry("b", moved, 13), entry("c", FINE, 12)))
    assert view.decoded == 1
    assert second["a"] is first["a"]
    assert second["b"] is not first["b"] and second["b"].unplaceable == moved.unplaceable


def test_a_rewrite_with_the_same_content_keeps_the_object() -> None:
    view = StateView()
    first = read(view, body(entry("a", PARKED, 10)))
    again = read(view, body(entry("a", PARKED, 20)))
    assert view.decoded == 1
    assert again["a"] is first["a"]


def test_an_index_that_went_back_decodes_everything_again() -> None:
    """A Consul that lost its state starts its indexes over: the same ModifyIndex
    may now hold another document."""
    view = StateView()
    read(view, body(entry("a", PARKED, 10)), index=50)
    other = read(view, body(entry("a", UNPLACEABLE, 10)), index=12)
    assert view.decoded == 1
    assert other["a"].unplaceable is not None and other["a"].parked is None


def test_a_removed_key_is_removed_and_a_404_empties_the_view() -> None:
    view = StateView()
    read(view, body(entry("a", PARKED, 10), entry("b", UNPLACEABLE, 11)))
    assert set(read(view, body(entry("b", UNPLACEABLE, 11)))) == {"b"}
    assert read(view, None) == {}
    # Back after the 404: decoded again, not taken from a forgotten cache.
    assert set(read(view, body(entry("b", UNPLACEABLE, 11)))) == {"b"}
    assert view.decoded == 1


def test_too_large_and_invalid_documents_are_skipped_others_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    view = StateView(max_bytes=1024)
    huge = PARKED.model_copy(update={"last_error": "x" * 4000})
    found = read(
        view,
        body(
            entry("huge", huge, 5), entry("junk", b"{not json", 6), entry("a", PARKED, 7),
            {"LockIndex": 0, "Key": "llmgw/routing/nothing", "Flags": 0, "Value": None,
             "CreateIndex": 1, "ModifyIndex": 8},
            entry("deeper/x", PARKED, 9),
        ),
    )  # fmt: skip
    assert set(found) == {"a"}
    assert "llmgw/routing/huge" in caplog.text and "more than a routing document" in caplog.text
    assert "llmgw/routing/junk" in caplog.text
    caplog.clear()
    read(view, body(entry("huge", huge, 5), entry("junk", b"{not json", 6), entry("a", PARKED, 7)))
    assert caplog.text == ""  # warned once per write, not once per read


def test_it_agrees_with_parse_states() -> None:
    entries = [entry("a", PARKED, 1), entry("b", UNPLACEABLE, 2), entry("c", FINE, 3)]
    assert read(StateView(), body(*entries)) == parse_states(entries)
    assert routed(routing_of(FINE)) is None


@pytest.mark.parametrize("piece", [1, 2, 3, 64, 1 << 20])
def test_the_scanner_takes_pieces_cut_anywhere(piece: int) -> None:
    data = body(entry("a", PARKED, 1), entry("é", UNPLACEABLE, 2))
    data = data.replace(b",", b" ,\n ", 1)  # whitespace between entries
    scanner = EntryScanner()
    found = []
    for start in range(0, len(data), piece):
        found += scanner.feed(data[start : start + piece])
    found += scanner.end()
    assert found == json.loads(data)


@pytest.mark.parametrize(
    "data", [b"{}", b'[{"Key":"x"}', b'[{"Key":"x"} {"Key":"y"}]', b"[1,", b""]
)
def test_the_scanner_refuses_what_is_not_a_list(data: bytes) -> None:
    scanner = EntryScanner()
    with pytest.raises(ValueError):
        scanner.feed(data)
        scanner.end()


def test_a_failed_read_leaves_the_view_as_it_was() -> None:
    view = StateView()
    first = read(view, body(entry("a", PARKED, 1)))
    with pytest.raises(ValueError):
        read(view, body(entry("a", PARKED, 2))[:-1])
    assert read(view, body(entry("a", PARKED, 1)))["a"] is first["a"]
    assert view.decoded == 0


def test_the_scan_yields_to_the_loop_and_the_reads_are_spaced_by_their_cost() -> None:
    view = StateView(slice_s=0.0)  # yield after every entry
    ticks = 0

    async def scenario() -> None:
        nonlocal ticks
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        data = body(*(entry(f"m{i}", PARKED, i + 1) for i in range(50)))
        await view.read(pieces_of(data, 1 << 20))  # one piece: all yields are the scan's
        stop.set()
        await task

    asyncio.run(scenario())
    assert ticks >= 50
    assert view.cost_s > 0
    assert state_interval(0.0) == STATE_MIN_INTERVAL_S
    assert state_interval(0.2) == pytest.approx(0.2 / STATE_LOOP_SHARE)


def test_present_names_every_key_read_parked_or_not() -> None:
    """A Consul reset's remembered state ends when the model's key is back, whatever
    its document says (router.endpoints.EndpointTable.set_states): the view names
    every key, not only the parked and unplaceable ones it hands on."""
    view = StateView()
    states = read(view, body(entry("a", PARKED, 10), entry("c", FINE, 12)))
    assert set(states) == {"a"} and view.present == {"a", "c"}
    with pytest.raises(ValueError):
        read(view, body(entry("c", FINE, 13))[:-1])
    assert view.present == {"a", "c"}  # a failed read changes nothing
    read(view, None)
    assert view.present == frozenset()


def test_a_read_that_fails_during_a_reset_keeps_the_old_index_too() -> None:
    """The index and the documents change together: a read of the new timeline (its
    index went back) that fails partway must not leave the new index beside the old
    timeline's documents, or the next read takes them for current."""
    view = StateView()
    read(view, body(entry("a", PARKED, 10)), index=50)
    with pytest.raises(ValueError):
        read(view, body(entry("a", UNPLACEABLE, 10))[:-1], index=12)
    after = read(view, body(entry("a", UNPLACEABLE, 10)), index=13)
    assert view.decoded == 1
    assert after["a"].unplaceable is not None and after["a"].parked is None
