"""glibc malloc settings for a process that holds large request bodies: large
allocations mapped on their own, and freed heap memory handed back to the OS.

Why: a body arrives as chunks of any size (router.intake keeps it in 1 MiB
blocks), and bodies of many connections are allocated interleaved. glibc serves
allocations under its mmap threshold from the heap, and raises that threshold
(up to 32 MiB) each time a mapped block is freed, so soon every block and body
comes from the heap; freed, they leave holes between other connections' live
ones that the heap cannot give back. Measured (bench/slow_uploads.py, 1 GiB
budget, RSS idle after the load): 200 clients x 50 MiB, half chunked, 253 MiB
before, 113 MiB with this module and router.intake's blocks; 60 x 20 MiB
chunked, 172 MiB before, 136 MiB after (docs/router.md).

- :func:`tune`: a fixed ``M_MMAP_THRESHOLD`` (:data:`MMAP_THRESHOLD_BYTES`;
  fixing it also ends the raising), so each block and body is its own mapping,
  unmapped when freed.
- :func:`released`: after :data:`TRIM_AFTER_BYTES` of bodies were let go, or
  when the last body held is let go (then the router idles at its base RSS), at most
  once per :data:`TRIM_INTERVAL_S`, ``malloc_trim(0)`` returns the free pages
  inside the heap (the chunks the blocks were joined from).

A no-op where the C library has neither call (musl) or :func:`tune` was not
called (tests, other processes importing the router).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 512 * 1024
TRIM_AFTER_BYTES = 64 * 1024 * 1024
TRIM_INTERVAL_S = 1.0
BLOCK_MIN_BYTES = 1024 * 1024  # less freed is not worth a trim when idle

_libc: Any = None
_freed = 0
_last_trim = 0.0
_scheduled = False


def tune() -> bool:
    """Set the mmap threshold and enable :func:`released`; ``False`` when the C
    library has no ``mallopt``/``malloc_trim``."""
    global _libc
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return False
    _libc = libc
    return True


def released(size: int, idle: bool = False) -> None:
    """``size`` bytes of request bodies were let go (``idle``: none is held now):
    trim the heap soon (on the next turn of the event loop, once the body itself
    is freed) when due."""
    global _freed, _scheduled
    if _libc is None:
        return
    _freed += size
    due = _freed >= TRIM_AFTER_BYTES or (idle and _freed >= BLOCK_MIN_BYTES)
    if not due or _scheduled:
        return
    _scheduled = True
    # Not more often than every TRIM_INTERVAL_S: a trim due sooner waits.
    wait = max(0.0, _last_trim + TRIM_INTERVAL_S - time.monotonic())
    try:
        asyncio.get_running_loop().call_later(wait, _trim)
    except RuntimeError:
        _trim()


def _trim() -> None:
    global _freed, _last_trim, _scheduled
    _freed = 0
    _scheduled = False
    started = time.monotonic()
    _libc.malloc_trim(0)
    _last_trim = time.monotonic()
    log.debug("malloc_trim took %.1f ms", (_last_trim - started) * 1000)
