"""Server-sent events' framing, as the router reads a replica's stream.

An event ends at a blank line, whichever of SSE's line ends frame it (WHATWG HTML
9.2.6: CRLF, LF or CR); llama-server writes LF LF. Read by
:class:`router.replica_errors.StreamErrors` (which passes whole events) and
:class:`router.accounting.StreamMeter` (which reads their usage).
"""

from __future__ import annotations

import re

# llama-server's event end: what a chunk ending in it is checked against first.
EVENT_END = b"\n\n"
# Most specific first.
EVENT_ENDS = (b"\r\n\r\n", b"\n\r\n", EVENT_END, b"\r\r")
# Splits bytes into events and the ends between them: [event, end, event, end, ..., rest].
EVENT_SPLIT = re.compile(b"(" + b"|".join(map(re.escape, EVENT_ENDS)) + b")")


def whole_events(chunk: bytes) -> int:
    """How many bytes at the start of ``chunk`` are whole events (up to and with
    the last blank line); 0 when none ends in it."""
    whole = 0
    for end in EVENT_ENDS:
        at = chunk.rfind(end)
        if at >= 0:
            whole = max(whole, at + len(end))
    return whole
