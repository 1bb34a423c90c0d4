"""The suite's one poll: it returns the first truthy answer, fails naming what it waited for, and gives up early."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from tests.support.poll import wait_until, wait_until_async


def test_the_first_truthy_answer_is_returned_after_the_falsy_ones() -> None:
    """Falsy answers are asked again; the first truthy one is the result."""
    answers = iter([None, 0, "", "found", "later"])
    assert wait_until(lambda: next(answers), 5, "an answer", interval=0.001) == "found"


def test_a_wait_past_its_timeout_fails_naming_what_and_the_detail() -> None:
    """A predicate that never holds fails after the timeout with what was awaited and the detail at that moment."""
    asked = itertools.count()
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0\.2s waiting for the thing\nasked \d+ times"):
        wait_until(
            lambda: next(asked) < 0, 0.2, "the thing", interval=0.01, detail=lambda: f"asked {next(asked)} times"
        )
    assert 0.2 <= time.monotonic() - start < 2


def test_a_wait_given_up_fails_at_once() -> None:
    """When ``give_up`` holds (the process that would bring the state about exited) the wait ends without the timeout."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match="gave up waiting for the daemon"):
        wait_until(lambda: False, 60, "the daemon", give_up=lambda: True)
    assert time.monotonic() - start < 1


async def test_the_async_wait_has_the_same_semantics() -> None:
    """The asyncio form returns the first truthy answer, lets other tasks run meanwhile, and fails the same way."""
    seen: list[int] = []

    async def other() -> None:
        seen.append(1)

    task = asyncio.create_task(other())
    assert await wait_until_async(lambda: seen, 5, "the other task ran") == [1]
    await task
    with pytest.raises(AssertionError, match=r"timed out after 0\.05s waiting for nothing"):
        await wait_until_async(lambda: None, 0.05, "nothing")
