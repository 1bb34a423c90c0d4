"""A reload's config: the file read and checked for this node, and the settings that change only on restart kept.

A bad file never replaces the running config: every problem is logged with its path, and the caller keeps what
it has. Safe in a worker thread (no daemon state is touched).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path

from nodeguard.config import Document, Settings, load_document
from nodeguard.errors import ConfigError, ConfigUnreadable
from nodeguard.log import get_logger

log = get_logger("nodeguard.daemon")


def read_settings(path: Path, labels: Mapping[str, str], reloads: MutableMapping[str, int]) -> Settings | None:
    """The settings of the config file for a node with ``labels``, or None (rejected: logged, counted)."""
    try:
        document: Document = load_document(path)
        return document.settings_for(labels, str(path))
    except ConfigError as exc:
        reloads["failed"] += 1
        for problem in exc.problems:
            log.error("reload rejected; keeping the running config", problem=problem, source=exc.source)
    except ConfigUnreadable as exc:
        reloads["failed"] += 1
        log.error("reload rejected; keeping the running config", problem=str(exc))
    return None


def kept_on_restart(new: Settings, running: Settings) -> Settings:
    """``new`` with what changes only on restart (cgroupRoot, actuation, history) as it runs now, said when it
    differed."""
    if (
        new.sensing.cgroup_root == running.sensing.cgroup_root
        and new.actuation == running.actuation
        and new.history == running.history
    ):
        return new
    log.warning("cgroupRoot, actuation and history settings change only on restart; the rest is reloaded")
    sensing = new.sensing.model_copy(
        update={"cgroup_root": running.sensing.cgroup_root, "cgroup_version": running.sensing.cgroup_version}
    )
    return new.model_copy(update={"sensing": sensing, "actuation": running.actuation, "history": running.history})
