"""A FAKE replica: a TCP server that accepts connections and never answers.

Why a fake: the failure it plays, a llama-server that passes its Consul check
but never answers a request (a wedged inference loop), cannot be produced on
demand with a real llama-server. Registered in Consul with a passing TTL
check, it is what the router sees of such a replica: connections succeed,
requests go out, no byte ever comes back (case C21). It reads and discards
what it is sent, and counts the connections it accepted.
"""

from __future__ import annotations

import socket
import threading

from tests.support.ports import free_port


class WedgedReplica:
    """Listens on 127.0.0.1:``port`` from construction until :meth:`stop`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.accepted = 0
        self._sock = socket.create_server(("127.0.0.1", self.port), backlog=64)
        self._sock.settimeout(0.2)
        self._held: list[socket.socket] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setblocking(False)
            self._held.append(conn)  # kept open, never answered
            self.accepted += 1

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._sock.close()
        for conn in self._held:
            conn.close()
