"""A free TCP port on 127.0.0.1, for a server a test starts (never the same twice in
one process: :mod:`devcluster.ports`)."""

from __future__ import annotations

from devcluster.ports import free_port

__all__ = ["free_port"]
