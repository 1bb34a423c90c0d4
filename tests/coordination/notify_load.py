"""A load for `nodeguard gate --notify`: records its own start, readiness and end (CLOCK_MONOTONIC, one line each,
appended to a log the auditor reads), so what runs at once is counted from the loads, not from nodeguard.

    python tests/coordination/notify_load.py NAME LOG STARTING_SECONDS

It starts (a ``start`` line), starts for STARTING_SECONDS, writes ``ready``, then sends READY=1 to
$NOTIFY_SOCKET and exits 0. Stopped by a signal while starting, it writes ``end`` and exits 143.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time


def record(log: str, event: str, name: str) -> None:
    with open(log, "a", encoding="ascii") as handle:  # one short append: whole lines from every process
        handle.write(f"{event} {name} {time.monotonic():.6f}\n")


def main() -> int:
    name, log, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])

    def stopped(signum: int, frame: object) -> None:
        record(log, "end", name)
        os._exit(143)

    signal.signal(signal.SIGTERM, stopped)
    record(log, "start", name)
    time.sleep(seconds)  # "starting": the scenario this load plays
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record(log, "ready", name)  # before READY=1: the slot is still held when the record is written
    address = os.environ["NOTIFY_SOCKET"]
    target = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"READY=1", target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
