"""The gate's unix socket: binding it safely, peer credentials, and one task per connection.

Connections are tasks of the service's TaskGroup (not of asyncio's own
server), so stopping the service closes every one of them.

What a client can cost is bounded: at most ``gate.maxConnections`` at once
(one more is told ``busy`` and closed); a client's requests are not read while
more than ``HIGH_WATER`` bytes of its responses wait to be sent, so one that
never reads costs a fixed amount; running out of descriptors pauses accepting
briefly instead of ending the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import os
import pwd
import socket
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from nodeguard.errors import NodeguardError
from nodeguard.gate.protocol import MAX_LINE, encode, error
from nodeguard.gate.settings import GateSettings
from nodeguard.log import get_logger

log = get_logger("nodeguard.gate")

HIGH_WATER = 64 * 1024  # a client's requests are not read while this much of its responses is unsent
MAX_BUFFERED = 1 << 20  # responses it did not ask for meanwhile (wait results) past this: the client is dropped
# accept() failures that mean "not now" (no descriptor, no memory): pause, then accept again.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_PAUSE = (0.05, 1.0)  # first and longest pause


class SocketUnavailable(NodeguardError):
    """The gate cannot serve its socket (in use by a live daemon, or not creatable)."""


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid, gid)


def authorised(peer: Peer, settings: GateSettings) -> bool:
    """Root and the daemon's own user always may; others by uid, or by primary gid (SO_PEERCRED has no others)."""
    return peer.uid in (0, os.geteuid()) or peer.uid in settings.allowed_uids or peer.gid in settings.allowed_gids


class Connection:
    def __init__(self, writer: asyncio.StreamWriter, peer: Peer) -> None:
        self.writer = writer
        self.peer = peer
        self.closed = False
        self.waiting: set[str] = set()  # names this connection has a wait on
        self.waits = 0  # its waits not answered yet

    def send(self, message: dict[str, object]) -> None:
        if self.closed or self.writer.is_closing():  # the peer may have gone already
            return
        unsent = self.writer.transport.get_write_buffer_size()
        self.writer.write(encode(message))
        # One large response (a status of many loads) is fine; a pile of them is a client not reading.
        if unsent > HIGH_WATER and self.writer.transport.get_write_buffer_size() > MAX_BUFFERED:
            log.warning("gate client does not read its responses; dropping it", pid=self.peer.pid)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()

    def __repr__(self) -> str:
        return f"Connection(pid={self.peer.pid}, uid={self.peer.uid})"


def _account_id(value: int | str | None, lookup: Callable[[str], int]) -> int:
    if value is None:
        return -1  # chown: unchanged
    if isinstance(value, int):
        return value
    try:
        return lookup(value)
    except KeyError:
        raise SocketUnavailable(f"no such user or group {value!r} for the gate socket") from None


def _let_peers_through(directory: str, mode: int) -> None:
    """A socket open to others is useless in a directory they cannot enter (the ledger makes /run/nodeguard 0750).

    Adds search permission only (x, not r): nothing in the directory can be listed,
    and its files keep their own modes (the ledger and the gate state are 0600).
    """
    if not mode & 0o066:
        return
    current = stat.S_IMODE(os.stat(directory).st_mode)
    if current & 0o011 == 0o011:
        return
    try:
        os.chmod(directory, current | 0o011)
    except OSError as exc:
        log.warning("gate: peers other than root may not reach the socket", directory=directory, error=str(exc))
    else:
        log.info("gate: made the socket's directory searchable", directory=directory, mode=oct(current | 0o011))


def apply_ownership(path: str, settings: GateSettings) -> None:
    uid = _account_id(settings.socket_owner, lambda name: pwd.getpwnam(name).pw_uid)
    gid = _account_id(settings.socket_group, lambda name: grp.getgrnam(name).gr_gid)
    if (uid, gid) != (-1, -1):
        os.chown(path, uid, gid)
    os.chmod(path, settings.mode)
    _let_peers_through(os.path.dirname(path), settings.mode)


@dataclass(frozen=True, slots=True)
class Listening:
    sock: socket.socket
    path: str
    inode: int  # of the socket file, to remove only our own at the end

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)


def bind(settings: GateSettings) -> Listening:
    """A listening socket at ``settings.socket``; a stale socket file is replaced, a live one refused."""
    path = settings.socket
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not stat.S_ISSOCK(existing.st_mode):
            raise SocketUnavailable(f"{path} exists and is not a socket; not touching it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # left behind by a daemon that died
        else:
            raise SocketUnavailable(f"{path} is served by another process (another nodeguard?)")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bind under a tight umask so the socket is never more open than asked, even briefly.
        old_umask = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        inode = os.lstat(path).st_ino
        apply_ownership(path, settings)
        sock.listen(512)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise SocketUnavailable(f"cannot serve {path}: {exc}") from None
    except SocketUnavailable:
        sock.close()
        raise
    return Listening(sock, path, inode)


class Handler(Protocol):
    def line(self, conn: Connection, line: bytes) -> None: ...

    def overlong(self, conn: Connection) -> None: ...

    def closed(self, conn: Connection) -> None: ...

    def max_connections(self) -> int: ...

    def busy(self, connections: int) -> None:
        """A client was turned away: ``connections`` are open already."""

    def accept_failed(self, exc: OSError) -> None:
        """accept() failed for want of resources; the loop pauses and tries again."""

    def failed(self, conn: Connection, exc: Exception) -> None:
        """Handling a line raised: a bug, reported; the connection and the gate go on."""


async def accept_loop(
    sock: socket.socket, group: asyncio.TaskGroup, handler: Handler, connections: set[Connection]
) -> None:
    loop = asyncio.get_running_loop()
    pause = ACCEPT_PAUSE[0]
    while True:
        try:
            client, _ = await loop.sock_accept(sock)
        except OSError as exc:
            if exc.errno in OUT_OF_RESOURCES:
                handler.accept_failed(exc)
                await asyncio.sleep(pause)
                pause = min(ACCEPT_PAUSE[1], pause * 2)
                continue
            if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):  # the client gave up: next one
                continue
            raise
        pause = ACCEPT_PAUSE[0]
        if len(connections) >= handler.max_connections():
            handler.busy(len(connections))
            _turn_away(client, len(connections))
            continue
        try:
            peer = peer_of(client)
            reader, writer = await asyncio.open_unix_connection(sock=client, limit=MAX_LINE)
        except OSError:
            client.close()
            continue
        writer.transport.set_write_buffer_limits(high=HIGH_WATER)
        conn = Connection(writer, peer)
        connections.add(conn)
        group.create_task(_serve(conn, reader, handler, connections), name=f"gate-client-{peer.pid}")


def _turn_away(client: socket.socket, open_now: int) -> None:
    """One JSON error line, without waiting for the client (it may not read), then close."""
    message = error(None, "busy", f"the gate serves {open_now} connections, its maximum (gate.maxConnections)")
    try:
        client.setblocking(False)
        client.send(encode(message))
    except OSError:
        pass
    finally:
        client.close()


async def _serve(
    conn: Connection, reader: asyncio.StreamReader, handler: Handler, connections: set[Connection]
) -> None:
    try:
        while not conn.closed:
            # Back-pressure: while the client leaves its responses unread, its requests stay unread too.
            await conn.writer.drain()
            try:
                line = await reader.readline()
            except ValueError:  # longer than MAX_LINE: no way to find where the next request starts
                handler.overlong(conn)
                break
            if not line:
                break
            if line.strip():
                try:
                    handler.line(conn, line)
                except Exception as exc:  # a bug in one request must not end the connection, nor the gate
                    handler.failed(conn, exc)
    except (ConnectionError, OSError):
        pass
    finally:
        connections.discard(conn)
        conn.close()
        handler.closed(conn)
