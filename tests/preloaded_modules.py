"""Imported once by tests/preloaded.py's forkserver: what ``nodeguard run`` imports before its first tick."""

from nodeguard.log import _import_structlog

_import_structlog(json=True)  # as the daemon's JSON logs import it: without rich

import nodeguard.config  # noqa: E402
import nodeguard.daemon  # noqa: E402
import nodeguard.entry  # noqa: E402
import nodeguard.surfaces.cli  # noqa: E402
import nodeguard.surfaces.http  # noqa: E402
import nodeguard.surfaces.metrics  # noqa: E402
import nodeguard.surfaces.status  # noqa: E402, F401
