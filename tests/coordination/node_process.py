"""A minimal process hosting a CoordinationService and a tiny local load driver (tests, benchmarks).

    python -m tests.coordination.node_process --config coordination.json [--node NAME]
        [--burst N --hold SECONDS --semaphore NAME]

The config file holds the ``coordination`` section (or a document with it under
``coordination``). Loads come from ``--burst`` and from JSON lines on stdin::

    {"cmd": "burst", "count": 5, "hold": 0.2, "semaphore": "prepare"}
    {"cmd": "status"}
    {"cmd": "quit"}

Every event is one JSON line on stdout, with ``t`` = CLOCK_MONOTONIC (shared by
the processes of one machine): ``hold`` once a load holds its slot, ``free``
just before it gives it back (also when the process stops: ``cancelled``),
``revoked`` when the node fenced and took it back (the load then waits again),
``done`` when a load held for its full time; plus ``status`` on request. On
SIGTERM the loads end, then the node drains (hands its slots on) and leaves.
Logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nodeguard.coordination.mqtt_link import raise_if_cancelling
from nodeguard.coordination.service import CoordinationService
from nodeguard.coordination.settings import CoordinationError, CoordinationSettings
from nodeguard.log import configure


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"ev": event, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def load_settings(path: str) -> CoordinationSettings:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CoordinationError(f"{path}: {exc}") from None
    if isinstance(data, dict) and "coordination" in data:
        data = data["coordination"]
    try:
        return CoordinationSettings.model_validate(data)
    except ValidationError as exc:
        from nodeguard.config_base import format_errors

        raise CoordinationError(
            f"{path}: " + "; ".join(f"coordination.{line}" for line in format_errors(exc))
        ) from None


def dump_tasks() -> None:
    """SIGUSR2: every asyncio task's stack on stderr (SIGUSR1 dumps the threads)."""
    for task in asyncio.all_tasks():
        sys.stderr.write(f"--- task {task.get_name()} {'cancelling' if task.cancelling() else ''}\n")
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


class Driver:
    """Runs loads: acquire, hold for a while, release; a revoked load waits again."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.service: CoordinationService | None = None
        self.loads: dict[str, asyncio.Task[None]] = {}
        self.revoked: dict[str, asyncio.Event] = {}
        self._ids = itertools.count(1)

    def on_revoke(self, semaphore: str, load: str) -> None:
        emit("revoked", node=self.node, sem=semaphore, load=load)
        event = self.revoked.get(load)
        if event is not None:
            event.set()

    def burst(self, count: int, hold: float, semaphore: str) -> None:
        for _ in range(count):
            load = f"{self.node}-{next(self._ids)}"
            self.loads[load] = asyncio.get_running_loop().create_task(self._load(load, hold, semaphore))

    async def _load(self, load: str, hold: float, semaphore: str) -> None:
        assert self.service is not None
        emit("request", node=self.node, sem=semaphore, load=load)
        while True:
            revoked = self.revoked[load] = asyncio.Event()
            await self.service.acquire(semaphore, load)
            emit("hold", node=self.node, sem=semaphore, load=load)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(revoked.wait(), timeout=hold)
                raise_if_cancelling()
            except asyncio.CancelledError:  # stopping: the load ends before its slot goes back
                emit("free", node=self.node, sem=semaphore, load=load, cancelled=True)
                self.service.release(semaphore, load)
                raise
            if not revoked.is_set():
                break
        emit("free", node=self.node, sem=semaphore, load=load)
        self.service.release(semaphore, load)
        emit("done", node=self.node, sem=semaphore, load=load)
        del self.revoked[load]


async def commands(driver: Driver, service: CoordinationService, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        try:
            cmd = json.loads(line)
        except ValueError:
            emit("error", error=f"not JSON: {line!r}")
            continue
        if cmd.get("cmd") == "burst":
            driver.burst(int(cmd.get("count", 1)), float(cmd.get("hold", 0.1)), str(cmd.get("semaphore", "")))
        elif cmd.get("cmd") == "status":
            emit("status", node=driver.node, status=service.status())
        elif cmd.get("cmd") == "quit":
            break
    stop.set()


async def main_async(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    driver = Driver(args.node or settings.node_name or "")
    service = CoordinationService(settings, args.node, on_revoke=driver.on_revoke)
    driver.node = service.name
    driver.service = service
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
    emit("started", node=service.name, pid=os.getpid())
    async with asyncio.TaskGroup() as group:
        runner = group.create_task(service.run(), name="coordination")
        reader = group.create_task(commands(driver, service, stop), name="commands") if args.stdin else None
        if args.burst:
            driver.burst(args.burst, args.hold, args.semaphore or next(iter(settings.semaphores)))
        await stop.wait()
        # The loads end first (as a gate's do when the daemon stops), then the service drains and leaves.
        loads = list(driver.loads.values())
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        runner.cancel()
        if reader is not None:
            reader.cancel()
    emit("stopped", node=service.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.coordination.node_process", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--node", help="this node's name (default: coordination.nodeName, NODE_NAME, hostname)")
    parser.add_argument("--burst", type=int, default=0, help="loads to start at once")
    parser.add_argument("--hold", type=float, default=0.2, help="seconds each load holds its slot")
    parser.add_argument("--semaphore", help="semaphore of the --burst loads (default: the first configured)")
    parser.add_argument("--stdin", action="store_true", help="read commands from stdin")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    configure(args.log_level, json=True)
    faulthandler.register(signal.SIGUSR1)  # stacks on stderr: for a test that finds a node stuck
    try:
        return asyncio.run(main_async(args))
    except CoordinationError as exc:
        sys.stderr.write(f"nodeguard coordination: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
