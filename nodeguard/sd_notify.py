"""The sd_notify protocol, in the few lines it needs (no dependency).

systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC``. Each notification is
one datagram of ``KEY=value`` lines.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        usec = env.get("WATCHDOG_USEC", "")
        self.watchdog_seconds = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 else None
        self._socket: socket.socket | None = None

    def notify(self, *lines: str) -> bool:
        """Send ``READY=1``, ``WATCHDOG=1``, ``STATUS=...`` ...; False when not under systemd or on error."""
        if self.address is None:
            return False
        try:
            if self._socket is None:
                # Non-blocking: a receiver that stops reading (its queue full) must not stall the event loop.
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._socket.sendto("\n".join(lines).encode(), self.address)
        except OSError:
            return False  # systemd gone or socket full: never worth failing a tick for
        return True
