"""Signals that arrive while the daemon starts, before its event loop can take them: remembered, never fatal.

Without this a SIGTERM during start-up (a drain, ``systemctl stop``, a
rolling update) takes the default action and kills the daemon before it has
restored what a crashed predecessor left held, and a SIGHUP kills it too.
``install`` runs as the first thing ``nodeguard run`` does (standard library
only, so nothing slow comes before it); the daemon's loop takes the signals
over and applies what was remembered: a stop restores what the ledger holds
and exits 0, a reload happens once the daemon has started.
"""

from __future__ import annotations

import signal
from types import FrameType

STOPS = (signal.SIGTERM, signal.SIGINT)


class EarlySignals:
    def __init__(self) -> None:
        self.stop: signal.Signals | None = None  # the first SIGTERM or SIGINT
        self.reload = False

    def install(self) -> EarlySignals:
        for signum in (*STOPS, signal.SIGHUP):
            signal.signal(signum, self._remember)
        return self

    def _remember(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.reload = True
        elif self.stop is None:
            self.stop = signal.Signals(signum)


# One per process: ``nodeguard run`` installs it, the daemon reads it when its loop takes the signals over.
EARLY = EarlySignals()
