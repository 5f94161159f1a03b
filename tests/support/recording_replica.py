"""A stub replica that records every request target it receives, byte for byte.

A stub, not a real llama-server, because what it must show is what arrived on the
wire before any server parsed it: an HTTP library would decode or normalise the
path first (the very thing under test, issue 18). It reads the request line,
the headers and a Content-Length body (up to any size, discarded as it comes),
records ``(method, target, body_bytes)``, and answers a small JSON 200 (held back,
after :meth:`hold`, until :meth:`release`). Runs on its own thread with its own
event loop, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import threading

from tests.support.ports import free_port


class RecordingReplica:
    """Listens on 127.0.0.1:``port`` from construction until :meth:`stop`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.received: list[tuple[str, str, int]] = []
        self._waiting = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    def targets(self) -> list[str]:
        """The request targets (path and query, as sent) received so far."""
        return [target for _, target, _ in self.received]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._gate = asyncio.Event()
        self._gate.set()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self._started.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = header.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                remaining = length
                while remaining:
                    chunk = await reader.read(min(remaining, 1 << 20))
                    if not chunk:
                        return
                    remaining -= len(chunk)
                self.received.append((method, target, length))
                if not self._gate.is_set():
                    self._waiting += 1
                    try:
                        await self._gate.wait()
                    finally:
                        self._waiting -= 1
                body = json.dumps({"object": "recorded", "target": target}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def _in_loop(self, action) -> None:
        async def call() -> None:
            action()

        asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    def hold(self) -> None:
        """Answers wait, from now on, until :meth:`release`."""
        self._in_loop(self._gate.clear)

    def release(self) -> None:
        self._in_loop(self._gate.set)

    def waiting(self) -> int:
        """Requests received whose answers are held back."""
        return self._waiting

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
