"""The gate's unix socket: binding it safely, peer credentials, and one task per connection.

Connections are accepted by the service's own loop (not asyncio's server)
and kept in its set, so stopping the service closes every one of them.

What a client can cost is bounded: at most ``gate.maxConnections`` at once
(one more is told ``busy`` and closed); a client's requests are not read while
more than ``HIGH_WATER`` bytes of its responses wait to be sent, and reads take
at most ``RECEIVE_SIZE`` bytes, so one that never reads costs a fixed amount;
running out of descriptors pauses accepting briefly instead of ending the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
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

HIGH_WATER = 16 * 1024  # a client's requests are not read while this much of its responses is unsent
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
    command: str = ""  # the peer process's name at connection time, for logs ("" when it is gone already)


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid, gid, process_name(pid))


def load_psutil() -> None:
    """Import psutil (process_name's), ahead of the first client: a daemon without a gate never loads it."""
    import psutil  # noqa: F401


def process_name(pid: int) -> str:
    """The peer's process name, for logs; "" when it cannot be told (gone, or no descriptor left to look)."""
    import psutil

    try:
        return str(psutil.Process(pid).name())
    except (psutil.Error, OSError):
        return ""


def authorised(peer: Peer, settings: GateSettings) -> bool:
    """Root and the daemon's own user always may; others by uid, or by primary gid (SO_PEERCRED has no others)."""
    return peer.uid in (0, os.geteuid()) or peer.uid in settings.allowed_uids or peer.gid in settings.allowed_gids


class Connection:
    def __init__(self, transport: asyncio.Transport, peer: Peer) -> None:
        self.transport = transport
        self.peer = peer
        self.closed = False
        self.waiting: set[str] = set()  # names this connection has a wait on
        self.waits = 0  # its waits not answered yet

    def send(self, message: dict[str, object]) -> None:
        if self.closed or self.transport.is_closing():  # the peer may have gone already
            return
        unsent = self.transport.get_write_buffer_size()
        self.transport.write(encode(message))
        # One large response (a status of many loads) is fine; a pile of them is a client not reading.
        if unsent > HIGH_WATER and self.transport.get_write_buffer_size() > MAX_BUFFERED:
            log.warning(
                "gate client does not read its responses; dropping it", pid=self.peer.pid, command=self.peer.command
            )
            self.close(abort=True)

    def unsent(self) -> int:
        return self.transport.get_write_buffer_size()

    def close(self, abort: bool = False) -> None:
        """Close after sending what is buffered, or ``abort``: at once (a client that does not read would keep it)."""
        if not self.closed:
            self.closed = True
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

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


async def accept_loop(sock: socket.socket, handler: Handler, connections: set[Connection]) -> None:
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
            await loop.connect_accepted_socket(functools.partial(_ClientProtocol, peer, handler, connections), client)
        except OSError:
            client.close()


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


RECEIVE_SIZE = 16 * 1024
# What one client can hold in the daemon at most, besides the one answer being written: its unsent
# answers up to HIGH_WATER, one read's worth of requests not handled yet, a line not complete yet.
CLIENT_MEMORY = HIGH_WATER + RECEIVE_SIZE + MAX_LINE
# One receive buffer for every connection: each read is taken out of it before the next one comes.
_receive = bytearray(RECEIVE_SIZE)


class _ClientProtocol(asyncio.BufferedProtocol):
    """One client: lines in, handled one by one; back-pressure when its responses pile up.

    What a client costs is bounded: the part of a line not complete yet (at
    most MAX_LINE), lines received but not handled while its responses wait
    (at most one read, RECEIVE_SIZE), and its unsent responses (HIGH_WATER and
    the last one). While they wait, its socket is not read.
    """

    def __init__(self, peer: Peer, handler: Handler, connections: set[Connection]) -> None:
        self.peer = peer
        self.handler = handler
        self.connections = connections
        self.conn: Connection | None = None
        self._buffer = bytearray()  # received and not handled yet
        self._held = False  # the transport's write buffer is over HIGH_WATER
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.set_write_buffer_limits(high=HIGH_WATER)
        self.conn = Connection(transport, self.peer)
        self.connections.add(self.conn)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(_receive)

    def buffer_updated(self, nbytes: int) -> None:
        self._buffer += memoryview(_receive)[:nbytes]
        self._handle_lines()

    def eof_received(self) -> bool:
        self._eof = True
        self._handle_lines()
        return True  # half-closed: answers to what was sent still go out; _handle_lines closes when done

    def pause_writing(self) -> None:
        self._held = True
        assert self.conn is not None
        self.conn.transport.pause_reading()

    def resume_writing(self) -> None:
        self._held = False
        self._handle_lines()
        conn = self.conn
        if conn is not None and not self._held and not conn.closed and not self._eof:
            conn.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self.conn
        if conn is None:
            return
        conn.closed = True
        self.connections.discard(conn)
        self._buffer = bytearray()
        self.handler.closed(conn)

    def _handle_lines(self) -> None:
        conn = self.conn
        if conn is None:
            return
        buffer, start = self._buffer, 0
        while not conn.closed and not self._held:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            line = bytes(buffer[start : end + 1])
            start = end + 1
            if len(line) > MAX_LINE:
                self._overlong(conn)
                return
            self._line(conn, line)
        del buffer[:start]
        if conn.closed or self._held:
            return
        if len(buffer) > MAX_LINE:  # no way to find where the next request starts
            self._overlong(conn)
        elif self._eof:
            if buffer:  # a last line without its newline
                self._line(conn, bytes(buffer))
                buffer.clear()
            conn.close()

    def _line(self, conn: Connection, line: bytes) -> None:
        if not line.strip():
            return
        try:
            self.handler.line(conn, line)
        except Exception as exc:  # a bug in one request must not end the connection, nor the gate
            self.handler.failed(conn, exc)

    def _overlong(self, conn: Connection) -> None:
        self._buffer = bytearray()
        self.handler.overlong(conn)
        conn.close()
