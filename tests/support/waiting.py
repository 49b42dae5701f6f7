"""Waiting for something another process does: the one poll loop the tests use."""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(predicate: Callable[[], T], timeout: float, interval: float = 0.1) -> T:
    """The predicate's first true value, polled every `interval` seconds; its last value once `timeout` has passed
    (for waits whose end the caller judges itself, such as a process that may need a SIGKILL after all)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.1, what: str = "condition") -> T:
    """The predicate's first true value, polled every `interval` seconds; after `timeout`, a failure naming `what`."""
    value = poll_until(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return value
