"""devcluster.ports: one process never gets the same port twice (CI: a Consul dev agent
given one port for two of its listeners refused to start)."""

from __future__ import annotations

import socket

from devcluster.ports import free_port


def test_no_port_is_handed_out_twice_and_each_is_free() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # free when handed out
