"""JSON logs: every line of stderr one JSON object, exceptions with their tracebacks, whoever logs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROGRAM = """
import asyncio, logging, warnings
from nodeguard.log import configure, get_logger, log_loop_error
configure("info", json=True)
log = get_logger("test")
try:
    raise KeyError("from nodeguard's own code")
except KeyError:
    log.error("own error", exc_info=True)
logging.getLogger("somelibrary").warning("a library's warning")
warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)

async def main():
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(log_loop_error)
    loop.call_soon(lambda: 1 / 0)  # an error inside a callback: asyncio reports it to the handler
    await asyncio.sleep(0)  # one turn of the loop: the callback runs
asyncio.run(main())
raise RuntimeError("uncaught at the end")
"""


def test_every_stderr_line_is_json_with_tracebacks() -> None:
    """nodeguard's errors, library and asyncio records, warnings and an uncaught exception all come out as JSON lines with tracebacks."""
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    events = {}
    for line in result.stderr.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            raise AssertionError(f"not JSON: {line!r}\n{result.stderr}") from None
        events[event["event"].splitlines()[0]] = event
    own = events["own error"]
    assert own["level"] == "error" and "Traceback" in own["exception"] and "KeyError" in own["exception"]
    assert events["a library's warning"]["logger"] == "somelibrary"
    assert any("a deprecation" in name for name in events)
    callback = next(e for name, e in events.items() if name.startswith("Exception in callback"))
    assert "ZeroDivisionError" in callback["exception"]
    uncaught = events["uncaught exception"]
    assert uncaught["level"] == "critical" and "RuntimeError: uncaught at the end" in uncaught["exception"]
