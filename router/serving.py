"""The HTTP/1.1 protocol ``router serve`` runs: uvicorn's httptools protocol with a
header-read timeout and a bound on header bytes.

uvicorn (0.54) bounds neither: its only timer, ``timeout_keep_alive``, is armed
after a response (and any byte received cancels it), so a connection that sends
nothing, or trickles its request line and headers a byte at a time, is held
forever; and httptools buffers a header value whole, however large, before it
hands it over. Here, for every request on a connection, pipelined or not:

- the request line and headers must arrive within ``header_timeout_s``, else the
  client gets 408 ``request_timeout`` (an OpenAI error object) and the connection
  is closed. The clock starts at the connection's first moment, and at the first
  byte of each later request; while an earlier request's response is still being
  sent it does not run out (the answer in progress is not cut): it starts again,
  whole, when that response ends (issue 18, D2: a pipelined request whose clock
  ran out during a long answer was never timed again);
- they may take at most :data:`MAX_HEADER_BYTES`, else 431
  ``request_header_fields_too_large``, closed. Bytes are counted *before* the
  parser sees them, up to the end of the header section (``CRLF CRLF``), so no
  read can complete an oversized header section unseen (issue 18, D1: a read that
  crossed the bound and completed the headers was never counted). A request that
  begins inside a read after another request's body (pipelined) is counted from
  what the parser reports (request target and each header), and checked again
  when its headers complete, before the app sees it. The parser does not report
  the whitespace around header values, so such a request's section can pass the
  bound by what that one read held (at most 256,000 bytes, uvloop's receive
  buffer; later reads are counted off the wire): bounded, not exact.

Bytes the parser cannot read as HTTP/1.1 (a bad request line, header or chunk
size, a ``Content-Length`` beside a ``Transfer-Encoding``, the HTTP/2 preface) get
400 ``invalid_http_request`` with the parser's reason, closed, where uvicorn would
answer ``text/plain``. A request whose body is the part not readable gets that
answer instead of its own (its app sees a disconnect); one queued behind an
answer in progress gets it when that answer ends.

A connection closed with a request's bytes still arriving (a refusal here, or the
proxy's before it read the body: ``Connection: close``) is closed *lingering*, as
nginx's ``lingering_close``: the answer, then a FIN, then what the client still
sends is read and dropped until it closes its side, at most :data:`LINGER_S`.
Closed at once, the kernel would answer those bytes with a reset, and a client
still sending its body often loses the answer to it.

A response the app leaves unfinished on purpose (:func:`cut_on_purpose`: a stream
its replica broke off) is not logged by uvicorn as an application fault.

The body's timeout is the proxy's (:mod:`router.intake`): it runs once the app
has the request. Built by :func:`protocol_class` for :mod:`router.cli`, which
passes it to uvicorn as ``http=``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from contextvars import ContextVar
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router import errors

log = logging.getLogger(__name__)

# Request line and headers together. cpp-httplib (llama-server) takes 8 KiB per
# header line; nginx's default large_client_header_buffers is 4 x 8 KiB.
MAX_HEADER_BYTES = 64 * 1024

# What the parser's callbacks do not report of a header section: the method, the
# spaces and version of the request line, each header's ": " and CRLF (counted per
# header), the final CRLF. A lower bound is all the check needs.
_REQUEST_LINE_OVERHEAD = len(b"GET  HTTP/1.1\r\n\r\n")
_END = b"\r\n\r\n"
_LINE_ENDS = (b"\r", b"\n")

# How long a connection closed with bytes still arriving keeps reading (and
# dropping) them so that its answer is not lost to a reset; nginx's
# lingering_timeout is 5 s.
LINGER_S = 5.0

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
}

# The parser's reason is a fixed text of llhttp's, except a callback's error,
# which can quote the request (httptools' "invalid url b'...'"): cut to this.
_MAX_REASON_CHARS = 200
# What llhttp says of the HTTP/2 connection preface (PRI * HTTP/2.0): said plainly.
_H2_PREFACE = "Pause on PRI/Upgrade"

# The ASGI scope extension (scope["extensions"]) that says the server received a
# request's whole body before the app read any of it.
BODY_WHOLE = "llmgw.body_whole"

# What uvicorn logs (ERROR, "uvicorn.error") when an app returns with its response
# begun and unfinished, before it drops the connection.
_UNFINISHED = "ASGI callable returned without completing response."
_cut: ContextVar[bool] = ContextVar("llmgw_cut_on_purpose", default=False)


def cut_on_purpose() -> None:
    """Say that the current request's response will be left unfinished on purpose and
    the app has logged why: uvicorn then drops the connection without logging
    "ASGI callable returned without completing response." as an application fault.

    For :mod:`router.streaming`, which ends a stream its replica broke off without
    the last chunk, so that a client sees a truncated stream and not a clean end
    (and which logs the break as a warning with its cause). Holds for the task that
    calls it, which is uvicorn's task for the request (a context variable: each
    request's task has its own)."""
    _cut.set(True)


class _UnfinishedOnPurpose(logging.Filter):
    """Drops uvicorn's unfinished-response error for a request that called
    :func:`cut_on_purpose`; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _UNFINISHED and _cut.get())


_ON_PURPOSE = _UnfinishedOnPurpose()


def body_whole(scope: dict[str, Any]) -> bool:
    """Whether the server already holds the request's whole body, so the app's first
    ``receive()`` returns it without waiting (:func:`router.intake.read_body` arms
    no clock then). False from any other server."""
    extensions = scope.get("extensions")
    return extensions is not None and extensions.get(BODY_WHOLE, False)


def protocol_class(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, bounded as described above. Also quiets
    uvicorn's log for responses cut on purpose (:func:`cut_on_purpose`)."""
    logging.getLogger("uvicorn.error").addFilter(_ON_PURPOSE)  # once: same filter

    class BoundedHttpToolsProtocol(_Bounded):
        timeout_s = header_timeout_s

    return BoundedHttpToolsProtocol


class _Refused(Exception):
    """Raised in a parser callback after a refusal was sent: stops the parser."""


class _CycleTransport:
    """The transport as a request's cycle (uvicorn's ``RequestResponseCycle``) sees
    it: closing it lingers, and a whole answer leaves in one send.

    uvicorn writes a response's head (status line and headers) and then its body
    as two writes: two ``send`` calls and two TCP segments, and two wake-ups of the
    client. The first write is held until the next one or the end of this turn of
    the event loop, whichever comes first, and the two go out as one
    ``writelines``. Measured (bench/side_by_side.py, cProfile): the client write
    was the router's costliest call, about 40 us each on the loaded 2-core machine,
    two per request. A stream's head waits no longer than the turn: its first
    event may be minutes away.
    """

    __slots__ = ("_held", "_protocol", "_wrote")

    def __init__(self, protocol: _Bounded) -> None:
        self._protocol = protocol
        self._held: bytes | None = None
        self._wrote = False

    def write(self, data: bytes) -> None:
        if not self._wrote:
            self._wrote = True
            self._held = data
            self._protocol.loop.call_soon(self._flush)
            return
        held = self._held
        if held is None:
            self._protocol.transport.write(data)
        else:
            self._held = None
            self._protocol.transport.writelines((held, data))

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._protocol.transport.is_closing():
                self._protocol.transport.write(held)

    def close(self) -> None:
        self._flush()
        self._protocol.close_after_answer()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._protocol.transport.is_closing()


class _Bounded(HttpToolsProtocol):
    timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_deadline = 0.0  # time.monotonic()
        # The clock ran out while an earlier response was being sent: restarted
        # when that response ends (on_response_complete).
        self._late_while_busy = False
        # Between a request's headers complete and its message complete.
        self._in_body = False
        # The current header section's bytes as read off the wire; the last bytes
        # read of it (an end split across reads).
        self._wire_bytes = 0
        self._tail = b""
        # The current request began inside a read after another request's end (or
        # while a request was split across reads): its bytes in that read are known
        # only from what the parser reported (_reported_bytes).
        self._uncounted = False
        # The parser began the current request (on_message_begin: its first byte
        # other than CR or LF).
        self._line_begun = False
        self._messages = 0
        self.lingering = False
        # A refusal that waits for an earlier request's response to end first.
        self._refusal: errors.RouterError | None = None
        self._refusal_logged = False
        self._linger_timer: asyncio.TimerHandle | None = None
        # The read being parsed, and what the parser left of it after a request
        # that asked to upgrade (_should_upgrade).
        self._read = b""
        self._after_upgrade = b""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._read = data
        self._received(data)
        while self._after_upgrade:
            # What followed a request that asked to upgrade, in the same read: the
            # parser stops there (httptools raises HttpParserUpgrade with its
            # offset) and takes the next read as HTTP again, so these bytes are
            # read here as a read of their own (found in review: a request pipelined
            # after an upgrade request was dropped, its client left waiting).
            rest, self._after_upgrade = self._after_upgrade, b""
            self._read = rest
            self._received(rest)

    def _received(self, data: bytes) -> None:
        if self.lingering or self._refusal is not None or self.transport.is_closing():
            return  # refused, or answered with "close": the rest is dropped
        if not self._in_body:
            part, ends = self._header_part(data)
            if self._wire_bytes + part > MAX_HEADER_BYTES:
                self._too_large()
                return
            self._wire_bytes += part
            if not ends and self._header_timer is None and not self._late_while_busy:
                # The first bytes of a next request, its headers not all here. Headers
                # whole in one read (the common case) are parsed within this call:
                # no clock (a call_later and its cancel, 3.8 us, per request).
                self._start_clock()
        begun = self._messages
        super().data_received(data)
        if self._in_body or self._refusal is not None or self.transport.is_closing():
            return
        if self._messages != begun and self._line_begun:
            # A request began inside this read, perhaps after another's body: its
            # bytes in it are at least what the parser reported of it.
            self._uncounted = True
            self._wire_bytes = max(self._wire_bytes, self._reported_bytes())
            if self._wire_bytes > MAX_HEADER_BYTES:
                self._too_large()
                return
        if self._wire_bytes:  # bytes of a next request's headers came in this read
            self._tail = (self._tail + data)[-3:]
            if self._header_timer is None and not self._late_while_busy:
                self._start_clock()

    def _header_part(self, data: bytes) -> tuple[int, bool]:
        """How many bytes of ``data`` belong to the header section being read (up to
        its end, else all), and whether that section ends in ``data``."""
        seen = self._tail + data
        start = 0
        if not self._line_begun and seen[:1] in _LINE_ENDS:
            # Empty lines before a request line are skipped (RFC 9112 2.2), however
            # they are split across reads: keyed on bytes counted, a blank line
            # that ended one read and began the next was taken for the section's
            # end, and what followed it in that read went uncounted.
            start = len(seen) - len(seen.lstrip(b"\r\n"))
        end = seen.find(_END, start)
        if end < 0:
            return len(data), False
        return end + len(_END) - len(self._tail), True

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes the parser refused (``msg`` is its fixed text):
        400 ``invalid_http_request`` here, in the error shape every answer has.

        Called only from the ``except httptools.HttpParserError`` of uvicorn's
        ``data_received``, after its warning is logged: the parser's exception is
        read from there (``sys.exc_info``) rather than caught in an override of
        ``data_received``, which would put a second ``try`` on every read.
        """
        if self._refusal is not None or self.lingering or self.transport.is_closing():
            return  # already refused (_Refused), or closing: nothing more is said
        refused = errors.InvalidHttpRequest(_parser_reason(sys.exc_info()[1], msg))
        in_body, self._in_body = self._in_body, False
        self._refuse_unread(refused, logged=True, headers_read=in_body)

    def _refuse_unread(
        self, refused: errors.RouterError, *, logged: bool, headers_read: bool
    ) -> None:
        """Refuse the request being read: in its line or headers, or (``headers_read``,
        its cycle made) in a body that cannot be read, whose answer then replaces its
        own."""
        cycle = self.cycle
        if not headers_read or cycle is None or cycle.scope is not self.scope:
            # In the request line or headers, or in uvicorn's on_headers_complete
            # before it made this request's cycle (a CONNECT target it cannot parse):
            # no app has this request.
            self._refuse(refused, logged=logged)
            return
        # The request's headers were read (its cycle exists) and its body was not
        # readable (a chunk size): this answer replaces its own.
        if cycle.response_started:
            # Its app answered before reading the body: that answer is not cut (it
            # ends, then this one).
            self._refuse(refused, logged=logged)
            return
        # Its app gets a disconnect (its sends are dropped), and never starts if
        # it waits behind an earlier request's answer.
        cycle.disconnected = True
        cycle.message_event.set()
        queued = [entry for entry in self.pipeline if entry[0] is cycle]
        for entry in queued:
            self.pipeline.remove(entry)
        if queued:
            # That earlier answer is in progress: this one when it ends.
            self._defer(refused, logged=logged)
        else:
            self._answer(refused, logged=logged)

    def _should_upgrade(self) -> bool:
        # The router serves no WebSocket; uvicorn would hand an upgrade request to
        # its websockets protocol, whose refusal is text/plain (403, or 500). Not
        # upgraded, it reaches the app as the plain request it also is, and is
        # answered as one (uvicorn logs "Unsupported upgrade request."). Called in
        # uvicorn's except for HttpParserUpgrade: what of the read the parser left
        # is read next (data_received).
        stopped = sys.exc_info()[1]
        if isinstance(stopped, httptools.HttpParserUpgrade) and stopped.args:
            self._after_upgrade = self._take_upgrade_body(self._read[stopped.args[0] :])
        return False

    def _take_upgrade_body(self, rest: bytes) -> bytes:
        """The parser ends an upgrade request at its headers, so its body is in
        ``rest``: a ``Content-Length`` body that arrived with them goes to the
        request (its app has not run yet) and the bytes after it are returned
        (found in review: ``curl --http2`` on http:// sends ``Upgrade: h2c``, and its
        POST reached the app with no body, 400 ``invalid_json``). A body the parser
        can no longer read (chunked, or not all arrived with the headers) gets 400
        ``invalid_http_request`` saying so, closed (it was read as the next request:
        400 "Invalid method" after the request's own 400 ``invalid_json``)."""
        lengths = [v for name, v in self.headers if name == b"content-length"]
        chunked = any(name == b"transfer-encoding" for name, _ in self.headers)
        cycle = self.cycle
        if cycle is None or cycle.body or cycle.response_started or not (lengths or chunked):
            return rest  # no body: the bytes after it are a next request
        length = int(lengths[0]) if len(lengths) == 1 and lengths[0].isdigit() else -1
        if chunked or not 0 <= length <= len(rest):
            # The parser may have ended the message at its headers (its app is
            # told the body is empty): its answer is replaced all the same.
            self._in_body = False
            self._refuse_unread(
                errors.InvalidHttpRequest(
                    "The request asks to upgrade the connection (Upgrade: "
                    f"{(self._get_upgrade() or b'').decode(errors='replace')[:40]}) and its "
                    "body is chunked or did not arrive with its headers; the router does "
                    "not upgrade and cannot read that body: send the request without "
                    "Upgrade (curl: --http1.1)."
                ),
                logged=False,
                headers_read=True,
            )
            return b""
        cycle.body = rest[:length]
        return rest[length:]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._messages += 1
        self._line_begun = True

    def _reported_bytes(self) -> int:
        """A lower bound on the current request's header bytes from what the parser
        reported of it so far: its target and each header it completed (uvicorn keeps
        them, ``url`` and ``headers``, names lowercased: the same length). Counted when
        needed rather than in ``on_url`` and ``on_header``: a call per header less."""
        headers = sum(len(name) + len(value) + 4 for name, value in self.headers)
        return _REQUEST_LINE_OVERHEAD + len(self.url) + headers

    def on_headers_complete(self) -> None:
        # A section counted whole off the wire needs no parser count; one with
        # bytes in a read that counted another request's does.
        counted = self._wire_bytes
        if not counted or self._uncounted:
            counted = max(counted, self._reported_bytes())
        if counted > MAX_HEADER_BYTES:
            self._too_large()
            raise _Refused  # the app never sees this request
        self._stop_clock()
        # Nothing of this request is late any more (a flag left set restarted the
        # clock at the earlier answer's end for no request: 408 on an idle connection).
        self._late_while_busy = False
        self._in_body = True
        # This request's count ends here. (The parser's count was once kept: a request
        # read whole in one read then counted as a next one begun, which started the
        # clock for an idle connection, 408 after the header timeout, and added its
        # header bytes to the next request's, 431 for two of 40 KiB.)
        self._wire_bytes = 0
        self._tail = b""
        self._line_begun = False
        self._uncounted = False
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = _CycleTransport(self)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            # The proxy reads this once, before its first receive(): then the whole
            # body waits in the cycle's buffer, and reading it needs no deadline
            # (router.intake). A body still arriving then is read on the clock.
            cycle.scope.setdefault("extensions", {})[BODY_WHOLE] = True  # type: ignore[typeddict-item]

    def on_response_complete(self) -> None:
        refusal = self._refusal
        if refusal is not None and self.pipeline:
            # Requests queued before the refused one are answered first, in order.
            super().on_response_complete()
            return
        if self.lingering or refusal is not None:
            self.server_state.total_requests += 1
            if refusal is not None:
                # The answer it waited for just ended; what self.cycle holds may be
                # the refused request's own (disconnected) cycle: no busy check.
                self._answer(refusal, logged=self._refusal_logged)
            return  # no next request on this connection
        super().on_response_complete()
        if self.transport.is_closing() or self._in_body:
            return
        if self._late_while_busy or self._wire_bytes:
            # Part of a next request waited behind this response: its clock starts
            # now, whole (it would otherwise never run out: D2).
            self._late_while_busy = False
            self._stop_clock()
            self._start_clock()

    def _start_clock(self) -> None:
        if self._header_timer is None:
            self._header_deadline = time.monotonic() + self.timeout_s
            self._header_timer = self.loop.call_later(self.timeout_s, self._headers_late)

    def _stop_clock(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _busy(self) -> bool:
        """An earlier request's response is still being sent."""
        return self.cycle is not None and not self.cycle.response_complete

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        early = self._header_deadline - time.monotonic()
        if early > 0:
            # uvloop schedules from the time cached at the start of the loop's
            # turn, so a timer can fire a little before the deadline.
            self._header_timer = self.loop.call_later(early, self._headers_late)
            return
        if self._busy():
            self._late_while_busy = True
            return
        self._refuse(
            errors.RequestTimeout(
                f"The request line and headers were not received within the router's "
                f"{self.timeout_s:g} s."
            )
        )

    def _too_large(self) -> None:
        self._refuse(
            errors.HeadersTooLarge(
                f"The request line and headers are larger than {MAX_HEADER_BYTES} bytes."
            )
        )

    def _refuse(self, exc: errors.RouterError, *, logged: bool = False) -> None:
        """Answer ``exc`` and close, or, while an earlier request's answer is being
        sent, once it ends. ``logged``: uvicorn already logged the refusal."""
        self._stop_clock()
        if self._busy():
            # A pipelined request refused while an earlier one is answered: the
            # answer ends first (on_response_complete).
            self._defer(exc, logged=logged)
            return
        self._answer(exc, logged=logged)

    def _defer(self, exc: errors.RouterError, *, logged: bool = False) -> None:
        """Answer ``exc`` when the answer in progress ends (on_response_complete)."""
        self._stop_clock()
        if self._refusal is None:
            self._refusal = exc
            self._refusal_logged = logged
            self.flow.pause_reading()

    def _answer(self, exc: errors.RouterError, *, logged: bool = False) -> None:
        """Write ``exc`` as an error object with ``connection: close``, and close
        lingering. One log line per refusal: uvicorn's warning where ``logged``."""
        self._stop_clock()
        self._refusal = None
        status, headers, body = errors.render(exc)
        lines = [b"HTTP/1.1 %d %s" % (status, _REASONS[status])]
        lines += [name + b": " + value for name, value in headers]
        lines.append(b"connection: close")
        self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        self.linger()
        if not logged:
            log.info("%s; connection from %s closed", exc.message, self.client)

    def close_after_answer(self) -> None:
        """The cycle closes the connection: lingering when its request's body may
        still be arriving, at once otherwise."""
        if self._in_body:
            self.linger()
        elif not self.transport.is_closing():
            self.transport.close()

    def linger(self) -> None:
        """Close after the answer, reading and dropping what still arrives until the
        client closes its side, at most :data:`LINGER_S` (see the module docstring)."""
        if self.lingering or self.transport.is_closing():
            return
        self.lingering = True
        self._stop_clock()
        # No next request is read: what the read in progress counted of one must
        # not start the header clock when the parser returns (data_received).
        self._wire_bytes = 0
        self._line_begun = False
        self._unset_keepalive_if_required()
        if not self.transport.can_write_eof():  # TLS: no half-close
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)


def _parser_reason(error: BaseException | None, fallback: str) -> str:
    """The message of an :class:`errors.InvalidHttpRequest`: what the parser said
    was wrong (``error``, its ``HttpParserError``; ``fallback`` without one)."""
    if isinstance(error, httptools.HttpParserCallbackError) and isinstance(
        error.__context__, httptools.HttpParserError
    ):
        # A callback's own parse failed (uvicorn's httptools.parse_url of the target):
        # that says more than "User callback error".
        error = error.__context__
    reason = str(error) if error is not None else ""
    if reason == _H2_PREFACE:
        return "HTTP/2 is not served here (its connection preface was sent): use HTTP/1.1."
    if not reason:
        return fallback
    if len(reason) > _MAX_REASON_CHARS:
        reason = reason[:_MAX_REASON_CHARS] + "..."
    return f"The request is not valid HTTP/1.1: {reason.rstrip('.')}."
