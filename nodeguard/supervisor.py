"""Keep a part of the daemon running: restart it after an error, with back-off, and say how it is.

A part (the gate) that fails must not end the daemon: the guard goes on
ticking. The supervisor logs the error (with its traceback, unless it is an
expected one such as a socket that cannot be bound), reports the part
unhealthy until it runs again, and restarts it after a pause that doubles with
each failure in a row, up to a limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nodeguard.backoff import Backoff
from nodeguard.log import get_logger

log = get_logger("nodeguard.supervisor")


@dataclass(frozen=True, slots=True)
class Restarts:
    """How soon a part is restarted: ``first``, doubling to ``longest``; a run of ``stable_after`` starts afresh."""

    first: float = 0.5
    longest: float = 30.0
    stable_after: float = 60.0


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    report: Callable[[str | None], None],
    *,
    expected: tuple[type[Exception], ...] = (),
    restarts: Restarts = Restarts(),
) -> None:
    """Run ``run()`` until cancelled, restarting it whenever it ends; ``report`` gets each problem, None once cured.

    ``run`` itself reports None once it is healthy again (e.g. serving), since
    only it knows when that is.
    """
    backoff = Backoff(restarts.first, restarts.longest)
    pause = backoff.failed()
    failures = 0
    while True:
        started = time.monotonic()
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except expected as exc:
            problem = str(exc)
            log.error(f"{name} not running; retrying", error=problem, retry_in=pause, failures=failures + 1)
        except Exception as exc:  # any bug: logged with its traceback, and the part comes back
            problem = describe(exc)
            log.error(
                f"{name} failed; restarting it", error=problem, retry_in=pause, failures=failures + 1, exc_info=True
            )
        else:
            problem = "stopped on its own"
            log.error(f"{name} stopped on its own; restarting it", retry_in=pause)
        failures += 1
        report(f"{problem} (restart #{failures} in {pause:g}s)")
        await asyncio.sleep(pause)
        if time.monotonic() - started >= restarts.stable_after:
            backoff.succeeded()
        pause = backoff.failed()


def describe(exc: BaseException) -> str:
    """``Type: message``; for a task group's ExceptionGroup, those of the errors inside it."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"
