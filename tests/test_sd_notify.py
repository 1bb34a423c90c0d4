"""sd_notify: notifications never hold the daemon up."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from nodeguard.sd_notify import Notifier


def test_a_receiver_that_stops_reading_never_blocks_the_sender(tmp_path: Path) -> None:
    """With the receiver's queue full (it never reads), notify returns False at once instead of blocking the tick."""
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(tmp_path / "notify"))
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    started = time.monotonic()
    sent = [notifier.notify("WATCHDOG=1") for _ in range(2000)]
    assert time.monotonic() - started < 5
    assert sent[0] is True and sent[-1] is False  # the first ones queued, the rest dropped
    assert receiver.recv(64) == b"WATCHDOG=1"
    receiver.close()
