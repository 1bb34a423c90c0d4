"""structlog set-up, and warnings that would otherwise repeat every tick.

In JSON mode every line on stderr is one JSON object: nodeguard's own events
(an exception's traceback in ``exception``), records of the standard logging
module (asyncio's, libraries'), warnings, uncaught exceptions, and errors
asyncio's event loop reports (``log_loop_error``).

structlog (and the logging module) are imported when first needed: the gate's
clients and the OCI hook print their own messages and set logging up lazily
(``configure(lazy=True)``), so a container create does not pay for them; in
JSON mode rich is never imported (structlog would import it for console
tracebacks that JSON lines do not use), nor colorama.
"""

from __future__ import annotations

import sys
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the OCI hook imports this module)
if TYPE_CHECKING:
    import asyncio
    import threading
    from types import TracebackType
    from typing import Any

_state: dict[str, Any] = {"json": False, "lazy": None}  # lazy: the level of a configure() not carried out yet


def configure(level: str = "info", json: bool | None = None, *, lazy: bool = False) -> None:
    """Readable output on a terminal, one JSON object per line otherwise.

    ``lazy``: set up only when something first logs (``get_logger``, an uncaught exception in JSON mode, a
    warning, a record once ``route_records`` has been called): for short-lived commands that print their own
    messages."""
    if json is None:
        json = not sys.stderr.isatty()
    _state["json"] = json
    if lazy:
        _state["lazy"] = level
        if json:
            sys.excepthook = _log_uncaught
        import warnings

        warnings.showwarning = _first_warning
        return
    _state["lazy"] = None
    _import_structlog(json)
    import logging
    import threading

    import structlog

    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    # The console renderer shows exc_info itself; JSON needs it turned into text first.
    tracebacks: list[Any] = [structlog.processors.format_exc_info] if json else []
    common: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *common, *tracebacks, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _route_standard_logging(level, [*common, structlog.stdlib.add_logger_name, *tracebacks], renderer)
    if json:
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


# What structlog imports when installed, for its console renderer only (tracebacks, colours on Windows).
CONSOLE_ONLY = ("rich", "colorama", "better_exceptions")


def _import_structlog(json: bool) -> None:
    """Import structlog; in JSON mode without the modules it imports only for the console renderer: the
    daemon's JSON logs never use them (rich and colorama with ctypes: about 0.1 s and several MB at start)."""
    if "structlog" in sys.modules or not json:
        return
    blocked = [name for name in CONSOLE_ONLY if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # ``import name`` raises ImportError meanwhile
    try:
        import structlog  # noqa: F401
    finally:
        for name in blocked:
            del sys.modules[name]


def _settle() -> None:
    """Carry out a lazy ``configure`` now: something is about to log."""
    level = _state["lazy"]
    if level is not None:
        configure(level, _state["json"])


def route_records() -> None:
    """After a lazy ``configure``: records of the logging module (asyncio's, say) set logging up when the first
    one comes, and go out through the same renderer."""
    level = _state["lazy"]
    if level is None:
        return
    import logging

    class FirstRecord(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _settle()  # replaces this handler with structlog's
            logging.getLogger().handle(record)

    root = logging.getLogger()
    root.handlers = [FirstRecord()]
    root.setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))


def _first_warning(*args: Any, **kwargs: Any) -> None:
    _settle()  # logging.captureWarnings replaces warnings.showwarning
    import warnings

    warnings.showwarning(*args, **kwargs)


def json_mode() -> bool:
    return bool(_state["json"])


def _route_standard_logging(level: str, chain: list[Any], renderer: Any) -> None:
    """Records of the logging module (asyncio, libraries) go out through the same renderer."""
    import logging

    import structlog

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=chain,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    # Libraries' info lines (httpx logs every request) stay out, as before this routing existed.
    root.setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
    logging.captureWarnings(True)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    get_logger("nodeguard").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        thread = args.thread.name if args.thread is not None else None
        exc_info = (args.exc_type, args.exc_value, args.exc_traceback)
        get_logger("nodeguard").critical("uncaught exception in a thread", thread=thread, exc_info=exc_info)


def log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An event loop exception handler: asyncio's own errors as structured events (each kind once a minute)."""
    message = str(context.get("message") or "asyncio error")
    if not _loop_errors.allow(message):
        return
    exc = context.get("exception")
    fields = {k: repr(v)[:300] for k, v in context.items() if k not in ("message", "exception")}
    get_logger("asyncio").error(message, exc_info=exc if isinstance(exc, BaseException) else False, **fields)


def get_logger(name: str) -> Any:
    _settle()
    _import_structlog(_state["json"])
    import structlog

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


_loop_errors = RateLimiter(60.0)
