"""Waiting on state: the suite's one poll, in a blocking and an asyncio form with the same semantics.

The predicate is asked first and then every ``interval`` seconds; its first truthy answer is returned. After
``timeout`` seconds (or as soon as ``give_up()`` holds: the process that would bring the state about has exited)
the wait fails with an AssertionError naming ``what`` and, if given, ``detail()`` at that moment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Wait(Generic[T]):
    """One wait: asks the predicate, and fails once the time is up or the wait is given up."""

    def __init__(
        self,
        predicate: Callable[[], T],
        timeout: float,
        what: str,
        detail: Callable[[], str] | None,
        give_up: Callable[[], bool] | None,
    ) -> None:
        self.predicate, self.timeout, self.what, self.detail, self.give_up = predicate, timeout, what, detail, give_up
        self.deadline = time.monotonic() + timeout

    def ask(self) -> T | None:
        """The predicate's answer when truthy; None to ask again later; an AssertionError when waiting is over."""
        value = self.predicate()
        if value:
            return value
        gave_up = self.give_up is not None and self.give_up()
        if gave_up or time.monotonic() >= self.deadline:
            how = "gave up" if gave_up else f"timed out after {self.timeout}s"
            shown = f"\n{self.detail()}" if self.detail is not None else ""
            raise AssertionError(f"{how} waiting for {self.what}{shown}")
        return None


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.05,
    detail: Callable[[], str] | None = None,
    give_up: Callable[[], bool] | None = None,
) -> T:
    """The first truthy value of ``predicate``, polled every ``interval`` s for up to ``timeout`` s."""
    wait = _Wait(predicate, timeout, what, detail, give_up)
    while (value := wait.ask()) is None:
        time.sleep(interval)
    return value


async def wait_until_async(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.02,
    detail: Callable[[], str] | None = None,
    give_up: Callable[[], bool] | None = None,
) -> T:
    """``wait_until`` inside an event loop: the loop runs other tasks between two questions."""
    wait = _Wait(predicate, timeout, what, detail, give_up)
    while (value := wait.ask()) is None:
        await asyncio.sleep(interval)
    return value
