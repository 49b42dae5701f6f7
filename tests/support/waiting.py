"""Waiting for something another process does: the one poll loop every test uses."""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.1, what: str = "condition") -> T:
    """The predicate's first true value, polled every `interval` seconds; after `timeout`, a failure naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
