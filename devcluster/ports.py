"""Free TCP ports on 127.0.0.1 for the servers the dev cluster, the tests and the
benches start.

The OS picks a port nothing listens on (bind to port 0); between that answer and
the server's own bind the port is free, so the kernel may hand the same one to the
next call. It did in CI: a Consul dev agent given ``-serf-lan-port`` and
``-serf-wan-port`` from two calls got one port twice and refused to start ("Serf
Advertise WAN address ... already configured for Serf Advertise LAN"), so the test
waited 30 s for a leader that never came. So no port is handed out twice by one
process.
"""

from __future__ import annotations

import socket
import threading

_given: set[int] = set()
_lock = threading.Lock()
# More than any run asks for: a port the kernel keeps offering again is skipped.
_ATTEMPTS = 1000


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before.
    Raises OSError when none is found (the ephemeral range exhausted)."""
    with _lock:
        for _ in range(_ATTEMPTS):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
    raise OSError(f"no free port on 127.0.0.1 not handed out before in {_ATTEMPTS} tries")
