"""``nodeguard gate --name N [...] -- COMMAND``: a command run once admitted, its start seen through, then released.

The one gate client that runs and watches a command, over asyncio (a load's
whole start, through a daemon restart: ``LoadSession``). The blocking clients
(``admit``, ``oci-hook``, ``gatectl``) and the options live in ``commands.py``.
"""

from __future__ import annotations

import argparse

from nodeguard.gate.submission import EXIT_FAILED, EXIT_UNAVAILABLE, admission, say, socket_path_of, submit_fields

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Awaitable
    from typing import Any

    from nodeguard.gate.connection import GateClient


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
                    say(f"{self.name} is {load['state']}: {load['reason']}")
                    return dict(load)
                except ConnectionLost:
                    await self._drop()
                    reattach = True
                    lost_at = lost_at if lost_at is not None else time.monotonic()
                except TimeoutError:
                    await self._drop()
                    why = f"the daemon was away longer than {fence:g}s: its cluster slot may be used elsewhere"
                    say(f"{self.name}: {why}")
                    return {"state": "failed", "reason": why, "fenced": True}
                except (GateError, GateUnavailable) as exc:
                    say(f"{self.name}: {exc}")
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


async def run_gated(args: argparse.Namespace, command: list[str]) -> int:
    """``nodeguard gate``: admitted, run ``command``, see its start through, release; its exit status."""
    import asyncio
    import os
    import signal

    from nodeguard.gate.connection import GateError, GateUnavailable
    from nodeguard.gate.oci import HookInputError

    try:
        fields = submit_fields(args, detach=False)
    except HookInputError as exc:
        say(str(exc))
        return EXIT_FAILED
    session = LoadSession(socket_path_of(args), fields, args.connect_timeout)
    gated = True
    try:
        load = await session.admit()
    except GateError as exc:
        say(f"gate refused {args.name}: {exc.message}")
        await session._drop()
        return EXIT_FAILED
    except GateUnavailable as exc:
        if args.if_unavailable == "fail":
            say(f"gate unavailable ({exc}); not starting {args.name}")
            return EXIT_UNAVAILABLE
        say(f"gate unavailable ({exc}); starting {args.name} ungated")
        gated, load = False, {"state": "ready"}
    if load["state"] == "failed":
        say(f"{args.name} was not admitted: {load['reason']}")
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
        say(f"cannot run {command[0]}: {exc.strerror}")
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
        if not follower.done() and notified is not None and notified.is_set():
            # READY=1 came, then the command ended before the daemon answered (it may be restarting): the daemon
            # hears of the readiness, within the patience, before the slot is released.
            await asyncio.wait({follower}, timeout=session.patience)
        ended = follower.result() if follower.done() and not follower.cancelled() else None
        if ended is not None and ended["state"] == "failed" and not exited.done() and not args.keep_on_failure:
            # A start that failed (never ready, or its cluster slot taken back) must not go on starting.
            say(f"stopping {args.name} and what it started: its start failed ({ended['reason']})")
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
