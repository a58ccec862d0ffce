"""Waiting for a condition in a test: polls until it holds or a timeout, which bounds a hang
only (a test asserts the condition, never how long it took)."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(cond: Callable[[], object], timeout: float, step: float = 0.005) -> bool:
    """Calls ``cond`` every ``step`` seconds until it returns something true (True) or
    ``timeout`` seconds passed (then ``cond()`` once more decides)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())
