"""The HTTP/1.1 protocol ``router serve`` runs: uvicorn's httptools protocol with a
header-read timeout and a bound on header bytes.

uvicorn (0.54) bounds neither: its only timer, ``timeout_keep_alive``, is armed
after a response, so a connection that sends nothing, or trickles its request
line and headers a byte at a time, is held forever; and httptools buffers a
header value whole, however large, before it hands it over. Here, from a
connection's first moment and from each request's first byte:

- the request line and headers must arrive within ``header_timeout_s``, else the
  client gets 408 ``request_timeout`` (an OpenAI error object) and the connection
  is closed;
- they may take at most :data:`MAX_HEADER_BYTES`, else 431
  ``request_header_fields_too_large``, closed.

The body's timeout is the proxy's (:mod:`router.intake`): it runs once the app
has the request. Built by :func:`protocol_class` for :mod:`router.cli`, which
passes it to uvicorn as ``http=``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router import errors

log = logging.getLogger(__name__)

# Request line and headers together. cpp-httplib (llama-server) takes 8 KiB per
# header line; nginx's default large_client_header_buffers is 4 x 8 KiB.
MAX_HEADER_BYTES = 64 * 1024

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def protocol_class(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, bounded as described above."""

    class BoundedHttpToolsProtocol(_Bounded):
        timeout_s = header_timeout_s

    return BoundedHttpToolsProtocol


class _Bounded(HttpToolsProtocol):
    timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._reading_headers = False
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_headers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._reading_headers and not self.transport.is_closing():
            # Bytes fed while the headers are still incomplete are header bytes
            # (at most the tail of the previous request's body besides).
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(errors.HeadersTooLarge(
                    f"The request line and headers are larger than {MAX_HEADER_BYTES} bytes."
                ))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._reading_headers:
            self._begin_headers()

    def on_headers_complete(self) -> None:
        self._end_headers()
        super().on_headers_complete()

    def _begin_headers(self) -> None:
        self._reading_headers = True
        self._header_bytes = 0
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.timeout_s, self._headers_late)

    def _end_headers(self) -> None:
        self._reading_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # Between requests on a busy keep-alive connection (a pipelined one
            # waits its turn): the answer in progress is not cut.
            return
        self._refuse(errors.RequestTimeout(
            f"The request line and headers were not received within the router's "
            f"{self.timeout_s:g} s."
        ))

    def _refuse(self, exc: errors.RouterError) -> None:
        self._end_headers()
        status, headers, body = errors.render(exc)
        lines = [b"HTTP/1.1 %d %s" % (status, _REASONS[status])]
        lines += [name + b": " + value for name, value in headers]
        lines.append(b"connection: close")
        self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        self.transport.close()
        log.info("%s; connection from %s closed", exc.message, self.client)
