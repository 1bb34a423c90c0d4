"""Gate clients on the command line: ``nodeguard gate``, ``admit``, ``oci-hook`` and ``gatectl``.

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
create; ``gate``, which runs and watches a command, uses asyncio.
"""

from __future__ import annotations

import argparse

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the OCI hook runs on every container create
if TYPE_CHECKING:
    from collections.abc import Awaitable, Generator
    from typing import Any

    from nodeguard.gate.connection import GateClient
    from nodeguard.gate.wire import BlockingGateClient

    # One admission's steps, for a blocking or an asyncio connection to carry out: a request to make (op, fields),
    # answered with its response or with the error it raised thrown in; a pause (seconds); None: drop the
    # connection (the next request connects again).
    Step = tuple[str, dict[str, Any]] | float | None

EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 75  # 75: EX_TEMPFAIL, try again later
WAIT_STATES = ("starting", "ready", "failed")


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
    ctl.add_argument("action", choices=["status", "ready", "release", "cancel"])
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


def _say(message: str) -> None:
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


class LoadSession:
    """One load seen through from submit to release, reconnecting if the daemon restarts meanwhile."""

    def __init__(self, socket_path: str, fields: dict[str, Any], patience: float) -> None:
        self.socket_path = socket_path
        self.fields = fields
        self.name: str = fields["name"]
        self.patience = patience
        self.client: GateClient | None = None

    async def _connect(self) -> GateClient:
        from nodeguard.gate.connection import GateClient

        if self.client is None:
            self.client = await GateClient.connect(self.socket_path, self.patience)
        return self.client

    async def _drop(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def admit(self) -> dict[str, Any]:
        """Submit and wait until admitted (or failed): the load's status (``admission`` over asyncio)."""
        import asyncio

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
                await self._drop()
            elif isinstance(step, float):
                await asyncio.sleep(step)
            else:
                try:
                    reply = await (await self._connect()).request(step[0], **step[1])
                except Exception as exc:  # thrown into the steps: they decide, as if the request had raised there
                    error = exc

    async def follow(self, notified: Any, fence: float | None = None) -> dict[str, Any] | None:
        """Until the load is ready (or failed), watched from submission: READY=1 (``notified``, an asyncio.Event) is
        reported on the side while the wait goes on, so a failure (a revoked cluster slot) ends it whatever the
        readiness. ``fence``: the seconds this load may go on starting without its daemon (it holds a cluster
        slot, I14); past them it counts as failed. The load as it ended, None when the daemon could not say."""
        import asyncio
        import time

        from nodeguard.gate.connection import ConnectionLost, GateError, GateUnavailable

        notifier = asyncio.get_running_loop().create_task(self._report_ready(notified)) if notified else None
        reattach, lost_at = False, None
        try:
            while True:
                try:
                    if reattach:  # after a daemon restart: this connection owns the load again
                        left = None if fence is None or lost_at is None else fence - (time.monotonic() - lost_at)
                        if left is not None and left <= 0:
                            raise TimeoutError
                        await asyncio.wait_for(self._reattach(), left)
                        reattach, lost_at = False, None
                    client = await self._connect()
                    load = (await client.request("wait", name=self.name, until="ready"))["load"]
                    _say(f"{self.name} is {load['state']}: {load['reason']}")
                    return dict(load)
                except ConnectionLost:
                    await self._drop()
                    reattach = True
                    lost_at = lost_at if lost_at is not None else time.monotonic()
                except TimeoutError:
                    await self._drop()
                    why = f"the daemon was away longer than {fence:g}s: its cluster slot may be used elsewhere"
                    _say(f"{self.name}: {why}")
                    return {"state": "failed", "reason": why, "fenced": True}
                except (GateError, GateUnavailable) as exc:
                    _say(f"{self.name}: {exc}")
                    if fence is not None:  # the load (and its slot) is gone, or unknown: it must not go on
                        return {"state": "failed", "reason": str(exc)}
                    return None
        finally:
            if notifier is not None:
                notifier.cancel()
                await asyncio.gather(notifier, return_exceptions=True)

    async def _reattach(self) -> None:
        client = await self._connect()
        await client.request("attach", name=self.name)

    async def _report_ready(self, notified: Any) -> None:
        """READY=1 came: tell the daemon (the wait goes on beside it)."""
        import asyncio

        from nodeguard.gate.connection import ConnectionLost, GateClient, GateError, GateUnavailable

        await notified.wait()
        while True:
            own = self.client is None  # the load's connection carries it beside the wait, unless it is down
            try:
                client = await GateClient.connect(self.socket_path, self.patience) if own else self.client
            except GateUnavailable:
                return  # the wait on the load's connection reports what became of it
            assert client is not None
            try:
                await client.request("ready", name=self.name)
                return
            except GateError:
                return  # failed or released meanwhile: the wait says so
            except ConnectionLost:
                await asyncio.sleep(0.05)  # the daemon restarting: once it is back
            finally:
                if own:
                    await client.close()

    async def release(self, patience: float | None = None) -> None:
        """Give the load back, reconnecting if the daemon restarts meanwhile; a load already gone is released."""
        import asyncio
        import time

        from nodeguard.gate.connection import ConnectionLost, GateClient, GateError, GateUnavailable

        patience = self.patience if patience is None else min(patience, self.patience)
        deadline = time.monotonic() + patience
        while True:
            try:
                if self.client is None:
                    self.client = await GateClient.connect(self.socket_path, max(0.0, deadline - time.monotonic()))
                await self.client.request("release", name=self.name)
                break
            except ConnectionLost:
                await self._drop()
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.05)
            except (GateError, GateUnavailable, OSError):
                break  # unknown_load: released already (or the daemon failed it)
        await self._drop()


def _socket(args: argparse.Namespace) -> str:
    from nodeguard.gate.wire import default_socket

    return str(args.socket or default_socket())


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
        _say("gate: nothing to run; give the command after --")
        return EXIT_FAILED
    return _run(_gate(args, command))


async def _gate(args: argparse.Namespace, command: list[str]) -> int:
    import asyncio
    import os
    import signal

    from nodeguard.gate.connection import GateError, GateUnavailable
    from nodeguard.gate.oci import HookInputError

    try:
        fields = submit_fields(args, detach=False)
    except HookInputError as exc:
        _say(str(exc))
        return EXIT_FAILED
    session = LoadSession(_socket(args), fields, args.connect_timeout)
    gated = True
    try:
        load = await session.admit()
    except GateError as exc:
        _say(f"gate refused {args.name}: {exc.message}")
        await session._drop()
        return EXIT_FAILED
    except GateUnavailable as exc:
        if args.if_unavailable == "fail":
            _say(f"gate unavailable ({exc}); not starting {args.name}")
            return EXIT_UNAVAILABLE
        _say(f"gate unavailable ({exc}); starting {args.name} ungated")
        gated, load = False, {"state": "ready"}
    if load["state"] == "failed":
        _say(f"{args.name} was not admitted: {load['reason']}")
        await session._drop()
        return EXIT_UNAVAILABLE

    loop = asyncio.get_running_loop()
    env = {**os.environ, "NODEGUARD_GATE_NAME": args.name, "NODEGUARD_GATE_SOCKET": session.socket_path}
    notified: asyncio.Event | None = None
    notify_sock = None
    if gated and args.notify:
        notified = asyncio.Event()
        notify_sock, env["NOTIFY_SOCKET"] = _notify_socket()
        loop.add_reader(notify_sock.fileno(), _on_notify, notify_sock, notified)
    try:
        child = await asyncio.create_subprocess_exec(*command, env=env)
    except OSError as exc:
        _say(f"cannot run {command[0]}: {exc.strerror}")
        await session.release()
        return 127
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
    for signum in forwarded:
        loop.add_signal_handler(signum, child.send_signal, signum)
    fence = load.get("clusterFenceSeconds")
    follower = loop.create_task(session.follow(notified, fence)) if gated and load["state"] != "ready" else None
    exited = loop.create_task(child.wait())
    if follower is not None:
        await asyncio.wait({follower, exited}, return_when=asyncio.FIRST_COMPLETED)
        ended = follower.result() if follower.done() and not follower.cancelled() else None
        if ended is not None and ended["state"] == "failed" and not exited.done() and not args.keep_on_failure:
            # A start that failed (never ready, or its cluster slot taken back) must not go on starting.
            _say(f"stopping {args.name} and what it started: its start failed ({ended['reason']})")
            await stop_process_tree(child.pid, exited, args.stop_grace)
    code = await exited
    for signum in forwarded:
        loop.remove_signal_handler(signum)
    quick = load["state"] == "ready"
    if follower is not None:
        follower.cancel()
        results = await asyncio.gather(follower, return_exceptions=True)
        quick = isinstance(results[0], dict) and (results[0]["state"] == "ready" or bool(results[0].get("fenced")))
    if notify_sock is not None:
        loop.remove_reader(notify_sock.fileno())
        notify_sock.close()
    if gated:
        # A load that never became ready holds its slots: its release must reach a restarting daemon. A ready one
        # holds nothing (the daemon only forgets it), and a fenced one is released by the restarted daemon when no
        # client attaches (I14): the exit status is not kept waiting for them.
        await session.release(None if not quick else 2.0)
    return code if code >= 0 else 128 - code


async def stop_process_tree(pid: int, exited: Awaitable[int], grace: float) -> None:
    """SIGTERM our child ``pid`` and every descendant it has now (psutil walks the tree), then SIGKILL what is
    left after ``grace`` seconds. ``exited`` is the child's own wait: its exit status stays asyncio's to reap."""
    import asyncio
    import contextlib
    import time

    import psutil

    try:
        top = psutil.Process(pid)
        descendants = top.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for process in [top, *descendants]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    deadline = time.monotonic() + grace
    try:
        await asyncio.wait_for(asyncio.shield(exited), grace)
    except TimeoutError:
        with contextlib.suppress(psutil.NoSuchProcess):
            top.kill()
    _, alive = await asyncio.to_thread(psutil.wait_procs, descendants, max(0.0, deadline - time.monotonic()))
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _notify_socket() -> tuple[Any, str]:
    """A datagram socket in the abstract namespace for sd_notify-style READY=1 (no file to clean up)."""
    import os
    import secrets
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"nodeguard-gate/{os.getpid()}/{secrets.token_hex(8)}"
    sock.bind("\0" + name)
    sock.setblocking(False)
    return sock, "@" + name


def _on_notify(sock: Any, notified: Any) -> None:
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return
    if b"READY=1" in data.split(b"\n"):
        notified.set()


# --- nodeguard admit ------------------------------------------------------------------


def cmd_admit(args: argparse.Namespace) -> int:
    from nodeguard.gate.oci import HookInputError

    try:
        fields = submit_fields(args, detach=True)
    except HookInputError as exc:
        _say(str(exc))
        return EXIT_FAILED
    return _admit(_socket(args), fields, args.connect_timeout, args.if_unavailable)


def _admit(
    socket_path: str, fields: dict[str, Any], patience: float, if_unavailable: str, hook_state: Any = None
) -> int:
    from nodeguard.gate.wire import GateError, GateUnavailable

    session = BlockingSession(socket_path, fields, patience)
    try:
        load = session.admit()
    except GateError as exc:
        _say(f"gate refused {session.name}: {exc.message}")
        return EXIT_FAILED
    except GateUnavailable as exc:
        if hook_state is not None:  # the runtime shows this line: name the container, say what to do
            from nodeguard.gate.hook_errors import hook_unavailable

            fail_open = if_unavailable == "admit"
            line, code = hook_unavailable(hook_state, exc.cause, exc.path, exc.waited, fail_open=fail_open)
            _say(line)
            return code
        if if_unavailable == "fail":
            _say(f"gate unavailable ({exc}); {session.name} not admitted")
            return EXIT_UNAVAILABLE
        _say(f"gate unavailable ({exc}); {session.name} goes ahead ungated")
        return EXIT_OK
    finally:
        session._drop()
    if load["state"] == "failed":
        _say(f"{session.name} was not admitted: {load['reason']}")
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
        _say(f"oci-hook: {exc}")
        return EXIT_FAILED
    if action.kind == "admit":
        return _admit(_socket(args), action.submit, args.connect_timeout, args.if_unavailable, state)
    if action.kind == "release":
        return _control(_socket(args), "release", action.name, quiet_unknown=True)
    return EXIT_OK


# --- nodeguard gatectl ----------------------------------------------------------------


def cmd_gatectl(args: argparse.Namespace) -> int:
    if args.action != "status" and not args.name:
        _say(f"gatectl {args.action}: which load? give its name")
        return EXIT_FAILED
    return _control(_socket(args), args.action, args.name, patience=args.connect_timeout)


def _control(socket_path: str, op: str, name: str | None, *, quiet_unknown: bool = False, patience: float = 5.0) -> int:
    import json

    from nodeguard.gate.wire import BlockingGateClient, ConnectionLost, GateError, GateUnavailable

    try:
        client = BlockingGateClient.connect(socket_path, patience)
    except GateUnavailable as exc:
        _say(f"gate unavailable: {exc}")
        return EXIT_UNAVAILABLE
    try:
        response = client.request(op, name=name)
    except GateError as exc:
        if quiet_unknown and exc.code == "unknown_load":
            return EXIT_OK
        _say(f"{op} {name or ''}: {exc.message}".replace("  ", " "))
        return EXIT_FAILED
    except ConnectionLost as exc:
        _say(str(exc))
        return EXIT_UNAVAILABLE
    finally:
        client.close()
    if op == "status":
        print(json.dumps(response.get("gate", response.get("load")), indent=2))
    elif not quiet_unknown:
        load = response["load"]
        print(f"{load['name']}: {load['state']} ({load['reason']})")
    return EXIT_OK
