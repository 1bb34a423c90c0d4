"""The gate's command line: ``nodeguard gate``, ``admit``, ``oci-hook`` and ``gatectl``, the gate's clients.

- ``gate --name N [...] -- COMMAND``: waits for admission, runs COMMAND, sees
  its readiness through (probes by the daemon, or ``--notify``: the command
  sends ``READY=1`` to ``$NOTIFY_SOCKET`` like a systemd ``Type=notify``
  service), releases the load when COMMAND exits and passes its exit status
  through. COMMAND does not run if the gate refuses the request (exit 1) or
  the load fails before admission, e.g. a dependency failed (exit 75).
- ``admit --name N [...]``: waits for admission and exits 0; the load stays
  with the daemon (for ``ExecStartPre=`` or an init container); the daemon's
  probes, ``gatectl ready N`` or the start timeout end its start.
- ``oci-hook``: the same for a container, from the OCI state on stdin.
- ``gatectl status|ready|release|cancel``.

While the daemon is unreachable, clients retry for ``--connect-timeout``
seconds (and wait that long for its answer to a submit), then give up with
exit 75, or go ahead with ``--if-unavailable admit``.
This module is imported to build the command line: heavy imports stay inside the handlers. ``admit``,
``oci-hook`` and ``gatectl`` use the blocking connection (``wire.py``): no event loop to import on a container
create; ``gate``, which runs and watches a command, uses asyncio (``gated_command.py``). What a submitted load's
commands share (its fields, the steps of its admission, the exit codes) is in ``submission.py``.
"""

from __future__ import annotations

import argparse

from nodeguard.gate.submission import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    admission,
    say,
    socket_path_of,
    submit_fields,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the OCI hook runs on every container create
if TYPE_CHECKING:
    from typing import Any

    from nodeguard.gate.wire import BlockingGateClient


def add_gate_commands(commands: Any) -> None:
    """Register the gate's client commands on the CLI's ``Commands``; each sets ``handler`` (args -> exit code)."""
    commands.command(
        "gate",
        _gate_options,
        help="run a command once the start gate admits it",
        description="Run COMMAND once admitted.",
    )
    commands.command(
        "admit", _admit_options, help="wait for admission by the start gate (ExecStartPre=, init containers)"
    )
    commands.command("oci-hook", _hook_options, help="OCI createRuntime/poststop hook: gate a container start")
    commands.command("gatectl", _gatectl_options, help="the start gate's loads: status, ready, release, cancel")


def _gate_options(gate: argparse.ArgumentParser) -> None:
    _load_options(gate)
    gate.add_argument(
        "--keep-on-failure",
        action="store_true",
        help="keep COMMAND running when its start fails (not ready in time, its cluster slot revoked); "
        "by default it is stopped, with every process it started",
    )
    gate.add_argument(
        "--stop-grace", type=float, default=10.0, metavar="SECONDS", help="from SIGTERM to SIGKILL when stopping"
    )
    gate.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run")
    gate.set_defaults(handler=cmd_gate)


def _admit_options(admit: argparse.ArgumentParser) -> None:
    _load_options(admit)
    admit.set_defaults(handler=cmd_admit)


def _hook_options(hook: argparse.ArgumentParser) -> None:
    _common_options(hook)
    hook.set_defaults(handler=cmd_oci_hook)


def _gatectl_options(ctl: argparse.ArgumentParser) -> None:
    _common_options(ctl)
    ctl.add_argument(
        "action",
        choices=["status", "ready", "release", "cancel"],
        help="status: the gate and its loads; ready: a starting load is ready; release: the load is done with, "
        "it leaves the gate and frees its slot; cancel: fail a pending or starting load",
    )
    ctl.add_argument("name", nargs="?", help="the load (required except for status)")
    ctl.set_defaults(handler=cmd_gatectl)


def _common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket", help="the gate socket (default: $NODEGUARD_GATE_SOCKET or /run/nodeguard/gate.sock)"
    )
    parser.add_argument(
        "--connect-timeout", type=float, default=30.0, metavar="SECONDS", help="retry this long to reach the daemon"
    )
    parser.add_argument(
        "--if-unavailable",
        choices=["fail", "admit"],
        default="fail",
        help="when the daemon cannot be reached: exit 75 (default), or go ahead ungated",
    )


def _load_options(parser: argparse.ArgumentParser) -> None:
    _common_options(parser)
    parser.add_argument("--name", required=True, help="the load's name (unique on the node)")
    parser.add_argument("--after", action="append", default=[], metavar="A,B", help="loads that must be ready first")
    ready = parser.add_mutually_exclusive_group()
    ready.add_argument("--ready-exec", metavar="CMD", help="ready when this shell command exits 0 (run as you)")
    ready.add_argument("--ready-http", metavar="URL", help="ready when GET URL answers 2xx or 3xx")
    ready.add_argument("--ready-tcp", metavar="HOST:PORT", help="ready when a TCP connection succeeds")
    ready.add_argument("--notify", action="store_true", help="ready when told (READY=1 on $NOTIFY_SOCKET, or gatectl)")
    parser.add_argument("--ready-period", type=float, metavar="SECONDS", help="between probes (default 1)")
    parser.add_argument("--ready-timeout", type=float, metavar="SECONDS", help="of one probe (default 1)")
    parser.add_argument("--ready-threshold", type=int, metavar="N", help="successes in a row (default 1)")
    parser.add_argument("--priority", type=int, default=0, help="higher is admitted first")
    parser.add_argument("--semaphore", metavar="NAME", help="also hold a slot of this cluster semaphore while starting")
    parser.add_argument(
        "--start-timeout", type=float, metavar="SECONDS", help="default: the daemon's startTimeoutSeconds"
    )


class BlockingSession:
    """``admission`` over the blocking connection (``admit``, ``oci-hook``)."""

    def __init__(self, socket_path: str, fields: dict[str, Any], patience: float) -> None:
        self.socket_path = socket_path
        self.fields = fields
        self.name: str = fields["name"]
        self.patience = patience
        self.client: BlockingGateClient | None = None

    def admit(self) -> dict[str, Any]:
        import time

        from nodeguard.gate.wire import BlockingGateClient

        steps = admission(self.fields, self.patience)
        reply: Any = None
        error: Exception | None = None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return dict(done.value)
            reply, error = None, None
            if step is None:
                self._drop()
            elif isinstance(step, float):
                time.sleep(step)
            else:
                try:
                    if self.client is None:
                        self.client = BlockingGateClient.connect(self.socket_path, self.patience)
                    reply = self.client.request(step[0], **step[1])
                except Exception as exc:  # thrown into the steps: they decide, as if the request had raised there
                    error = exc

    def _drop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def _run(coro: Any) -> int:
    import asyncio

    from nodeguard.log import route_records

    route_records()  # asyncio's records, should it have any, go out like the daemon's
    return int(asyncio.run(coro))


# --- nodeguard gate ------------------------------------------------------------------


def cmd_gate(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        say("gate: nothing to run; give the command after --")
        return EXIT_FAILED
    from nodeguard.gate.gated_command import run_gated

    return _run(run_gated(args, command))


# --- nodeguard admit ------------------------------------------------------------------


def cmd_admit(args: argparse.Namespace) -> int:
    from nodeguard.gate.oci import HookInputError

    try:
        fields = submit_fields(args, detach=True)
    except HookInputError as exc:
        say(str(exc))
        return EXIT_FAILED
    return _admit(socket_path_of(args), fields, args.connect_timeout, args.if_unavailable)


def _admit(
    socket_path: str, fields: dict[str, Any], patience: float, if_unavailable: str, hook_state: Any = None
) -> int:
    from nodeguard.gate.wire import GateError, GateUnavailable

    session = BlockingSession(socket_path, fields, patience)
    try:
        load = session.admit()
    except GateError as exc:
        say(f"gate refused {session.name}: {exc.message}")
        return EXIT_FAILED
    except GateUnavailable as exc:
        if hook_state is not None:  # the runtime shows this line: name the container, say what to do
            from nodeguard.gate.hook_errors import hook_unavailable

            fail_open = if_unavailable == "admit"
            line, code = hook_unavailable(hook_state, exc.cause, exc.path, exc.waited, fail_open=fail_open)
            say(line)
            return code
        if if_unavailable == "fail":
            say(f"gate unavailable ({exc}); {session.name} not admitted")
            return EXIT_UNAVAILABLE
        say(f"gate unavailable ({exc}); {session.name} goes ahead ungated")
        return EXIT_OK
    finally:
        session._drop()
    if load["state"] == "failed":
        say(f"{session.name} was not admitted: {load['reason']}")
        return EXIT_FAILED
    return EXIT_OK


# --- nodeguard oci-hook ---------------------------------------------------------------


def cmd_oci_hook(args: argparse.Namespace) -> int:
    import json
    import sys

    from nodeguard.gate.oci import HookInputError, hook_action

    try:
        state = json.loads(sys.stdin.buffer.read(1 << 20))
        action = hook_action(state)
    except (ValueError, HookInputError) as exc:
        say(f"oci-hook: {exc}")
        return EXIT_FAILED
    if action.kind == "admit":
        return _admit(socket_path_of(args), action.submit, args.connect_timeout, args.if_unavailable, state)
    if action.kind == "release":
        return _control(socket_path_of(args), "release", action.name, quiet_unknown=True)
    return EXIT_OK


# --- nodeguard gatectl ----------------------------------------------------------------


def cmd_gatectl(args: argparse.Namespace) -> int:
    if args.action != "status" and not args.name:
        say(f"gatectl {args.action}: which load? give its name")
        return EXIT_FAILED
    return _control(socket_path_of(args), args.action, args.name, patience=args.connect_timeout)


def _control(socket_path: str, op: str, name: str | None, *, quiet_unknown: bool = False, patience: float = 5.0) -> int:
    import json

    from nodeguard.gate.wire import BlockingGateClient, ConnectionLost, GateError, GateUnavailable

    try:
        client = BlockingGateClient.connect(socket_path, patience)
    except GateUnavailable as exc:
        say(f"gate unavailable: {exc}")
        return EXIT_UNAVAILABLE
    try:
        response = client.request(op, name=name)
    except GateError as exc:
        if quiet_unknown and exc.code == "unknown_load":
            return EXIT_OK
        say(f"{op} {name or ''}: {exc.message}".replace("  ", " "))
        return EXIT_FAILED
    except ConnectionLost as exc:
        say(str(exc))
        return EXIT_UNAVAILABLE
    finally:
        client.close()
    if op == "status":
        print(json.dumps(response.get("gate", response.get("load")), indent=2))
    elif not quiet_unknown:
        load = response["load"]
        print(f"{load['name']}: {load['state']} ({load['reason']})")
    return EXIT_OK
