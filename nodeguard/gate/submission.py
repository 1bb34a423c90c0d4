"""A load submitted from the command line, as ``gate``, ``admit`` and ``oci-hook`` share it.

Its fields from the options, the steps that wait for its admission (for the
blocking connection in ``commands.py`` or the asyncio one in
``gated_command.py`` to carry out), the socket, the exit codes and the one
way of saying what happened. Imported on every container create: it imports
nothing until a function needs it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the OCI hook runs on every container create
if TYPE_CHECKING:
    import argparse
    from collections.abc import Generator
    from typing import Any

    # One admission's steps, for a blocking or an asyncio connection to carry out: a request to make (op, fields),
    # answered with its response or with the error it raised thrown in; a pause (seconds); None: drop the
    # connection (the next request connects again).
    Step = tuple[str, dict[str, Any]] | float | None

EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 75  # 75: EX_TEMPFAIL, try again later
WAIT_STATES = ("starting", "ready", "failed")


def submit_fields(args: argparse.Namespace, detach: bool) -> dict[str, Any]:
    from nodeguard.gate.oci import readiness_of

    readiness = readiness_of(args.ready_http, args.ready_tcp, args.ready_exec, args.notify)
    if readiness is not None and readiness["type"] != "notify":
        timing = (("periodSeconds", args.ready_period), ("timeoutSeconds", args.ready_timeout))
        readiness.update({key: value for key, value in timing if value is not None})
        if args.ready_threshold is not None:
            readiness["successThreshold"] = args.ready_threshold
    return {
        "name": args.name,
        "dependsOn": [dep.strip() for item in args.after for dep in item.split(",") if dep.strip()],
        "readiness": readiness,
        "priority": args.priority,
        "startTimeoutSeconds": args.start_timeout,
        "detach": detach,
        "semaphore": args.semaphore,
    }


def say(message: str) -> None:
    import sys

    print(f"nodeguard: {message}", file=sys.stderr, flush=True)


def admission(fields: dict[str, Any], patience: float) -> Generator[Step, Any, dict[str, Any]]:
    """Submit and wait until admitted (or failed): the load's status. Reconnects (the daemon restarted) attach to the
    load, which the daemon may have admitted before it went away, or submit it again."""
    from nodeguard.gate.wire import ConnectionLost, GateError

    name = fields["name"]
    answer_within = max(patience, 1.0)  # a stopped or hung daemon is unavailable too
    resubmit, reconnected = True, False
    while True:
        try:
            if resubmit:
                try:
                    load: dict[str, Any] = (yield ("submit", {"answer_within": answer_within, **fields}))["load"]
                except GateError as exc:
                    # Our old connection's load may not have been failed yet; it will be at once.
                    if not (reconnected and exc.code == "name_in_use"):
                        raise
                    reconnected = False
                    yield 0.2
                    continue
            else:
                # Back after a lost connection: the daemon may have admitted us before it went away.
                try:
                    load = (yield ("attach", {"name": name}))["load"]
                except GateError as exc:
                    if exc.code != "unknown_load":
                        raise
                    resubmit = True
                    continue
                if load["state"] == "failed":  # e.g. failed as "client disconnected": try again
                    resubmit = True
                    continue
            if load["state"] in WAIT_STATES:
                return load
            return dict((yield ("wait", {"name": name, "until": "starting"}))["load"])
        except ConnectionLost:
            yield None
            resubmit, reconnected = False, True


def socket_path_of(args: argparse.Namespace) -> str:
    from nodeguard.gate.wire import default_socket

    return str(args.socket or default_socket())
