"""structlog set-up, and warnings that would otherwise repeat every tick."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import structlog


def configure(level: str = "info", json: bool | None = None) -> None:
    """Readable output on a terminal, one JSON object per line otherwise."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


class RateLimiter:
    """Allows one event per key per interval; counts the ones it suppressed."""

    def __init__(self, interval: float = 60.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        return True

    def forget(self, keys: set[str]) -> None:
        for key in keys:
            self._last.pop(key, None)
            self.suppressed.pop(key, None)
