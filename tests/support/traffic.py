"""A client that keeps asking while a test breaks something, and what it was answered."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from typing import Any

CONNECTION_ERROR = 0  # no HTTP answer at all


@contextlib.contextmanager
def steady(request: Callable[[], Any], interval: float = 0.05) -> Iterator[list[int]]:
    """Call `request` every `interval` seconds in a thread for as long as the block runs;
    yields the list of HTTP statuses it got (200, an HTTPError's code, or
    CONNECTION_ERROR), appended as they come. The thread ends when the block does."""
    codes: list[int] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            try:
                request()
                codes.append(200)
            except urllib.error.HTTPError as exc:
                codes.append(exc.code)
            except OSError:
                codes.append(CONNECTION_ERROR)  # refused, reset, timed out: a failure too
            time.sleep(interval)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield codes
    finally:
        done.set()
        thread.join()
