"""The gate under its supervisor: an unexpected error is logged with its traceback and the gate comes back."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from nodeguard.gate.service import GateService
from nodeguard.gate.settings import GateSettings
from nodeguard.supervisor import Restarts, supervise
from tests.gate.served import ping, served
from tests.support.gate import Session
from tests.support.poll import wait_until, wait_until_async


def test_an_unexpected_error_restarts_the_gate_which_keeps_its_loads(tmp_path: Path) -> None:
    """A fault in the gate's state writer ends its task group: it is logged with a traceback, reported, and the gate serves again with its loads."""
    with capture_logs() as logs, served(tmp_path, maxStarting=5) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        session = Session(gate.socket)
        assert session.request({"op": "submit", "name": "kept", "detach": True, "readiness": {"type": "notify"}})["ok"]
        session.close()
        writer = gate.gate._writer
        original = writer.write
        faults = threading.Semaphore(1)

        def faulty(generation: int, data: bytes) -> bool:
            if faults.acquire(blocking=False):
                raise RuntimeError("injected fault in the state writer")
            return original(generation, data)

        gate.call(lambda: setattr(writer, "write", faulty))
        session = Session(gate.socket)
        session.send({"op": "submit", "name": "trigger", "detach": True, "readiness": {"type": "notify"}})
        session.close()
        wait_until(lambda: gate.call(gate.gate.problem) is not None, 10, "the gate reported unhealthy")
        assert "injected fault" in str(gate.call(gate.gate.problem))
        wait_until(lambda: ping(gate.socket), 10, "the gate serving again")
        assert gate.call(gate.gate.problem) is None
        loads = gate.call(lambda: {name: load.state.value for name, load in gate.gate.table.loads.items()})
        assert loads["kept"] == "starting", loads
    failed = [e for e in logs if e["event"] == "gate failed; restarting it"]
    assert failed and failed[0]["exc_info"] is True and "injected fault" in failed[0]["error"]


async def test_supervise_backs_off_reports_and_stops_when_cancelled() -> None:
    """Each failure is reported with its pause, the pause doubles up to its limit, and cancelling ends the supervision."""
    attempts: list[float] = []
    reports: list[str | None] = []
    loop = asyncio.get_running_loop()

    async def failing() -> None:
        attempts.append(loop.time())
        raise ValueError(f"failure {len(attempts)}")

    task = asyncio.create_task(
        supervise("part", failing, reports.append, restarts=Restarts(first=0.01, longest=0.04, stable_after=60))
    )
    await wait_until_async(lambda: len(attempts) >= 5, 10, "five attempts", interval=0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reports[0] == "ValueError: failure 1 (restart #1 in 0.01s)"
    pauses: list[Any] = [report.rsplit(" in ", 1)[1] for report in reports if report is not None]
    assert pauses[:5] == ["0.01s)", "0.02s)", "0.04s)", "0.04s)", "0.04s)"]


async def test_a_socket_path_the_kernel_refuses_leaves_the_gate_retrying_not_raising(tmp_path: Path) -> None:
    """A NUL byte in the socket path (which the config refuses, but say it got through) is a problem reported, not an error ending the daemon."""
    settings = GateSettings.model_construct(**{**GateSettings().__dict__, "socket": f"{tmp_path}/gate\0.sock"})
    gate = GateService(settings, 2, str(tmp_path))
    task = asyncio.create_task(gate.run())
    await wait_until_async(lambda: gate.problem() not in (None, "not serving yet"), 10, "the gate's problem reported",
                           interval=0.01, give_up=task.done, detail=lambda: str(task))  # fmt: skip
    assert "null byte" in str(gate.problem()) and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
