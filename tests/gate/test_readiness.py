"""Readiness probes against real processes and sockets: exec (as the submitting user), HTTP GET, TCP connect."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from nodeguard.gate.readiness import ExecProbe, HttpProbe, TcpProbe, probe_once, wait_until_ready
from tests.support.poll import wait_until_async
from tests.support.ports import free_port
from tests.support.processes import alive


class Status404(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404 if self.path == "/missing" else 200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def http_server() -> Iterator[int]:
    server = http.server.HTTPServer(("127.0.0.1", 0), Status404)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


async def test_exec_probe_runs_as_the_submitting_user_not_as_root() -> None:
    """An exec probe submitted by uid 4242 runs as uid 4242: a check for that uid succeeds, one for root fails."""
    as_4242 = ExecProbe(type="exec", command=["sh", "-c", 'test "$(id -u)" = 4242'])
    as_root = ExecProbe(type="exec", command=["sh", "-c", 'test "$(id -u)" = 0'])
    assert await probe_once(as_4242, 4242, 4242) == (True, "exit status 0")
    assert await probe_once(as_root, 4242, 4242) == (False, "exit status 1")


async def test_exec_probe_past_its_timeout_fails_and_is_killed(tmp_path: Path) -> None:
    """A probe command still running at its timeout counts as failed and its process group is killed."""
    marker, pids = tmp_path / "survived", tmp_path / "pids"
    # The shell and its child would live on past the timeout, and the shell then leave a marker.
    script = f"echo $$ > {pids}; sleep 5 & echo $! >> {pids}; wait; touch {marker}"
    probe = ExecProbe(type="exec", command=["sh", "-c", script], timeout_seconds=0.2)
    assert await probe_once(probe, 0, 0) == (False, "timed out after 0.2s")
    for pid in (int(line) for line in pids.read_text().split()):
        await wait_until_async(lambda pid=pid: not alive(pid), 2, f"probe process {pid} killed")
    assert not marker.exists()


async def test_http_probe_needs_a_2xx_or_3xx_answer() -> None:
    """GET answering 200 is ready, 404 is not, and nothing listening is not."""
    with http_server() as port:
        ok = HttpProbe(type="http", url=f"http://127.0.0.1:{port}/healthz")
        missing = HttpProbe(type="http", url=f"http://127.0.0.1:{port}/missing")
        assert await probe_once(ok, 0, 0) == (True, "HTTP 200")
        assert await probe_once(missing, 0, 0) == (False, "HTTP 404")
    closed = HttpProbe(type="http", url=f"http://127.0.0.1:{free_port()}/")
    assert (await probe_once(closed, 0, 0))[0] is False


async def test_success_threshold_counts_consecutive_successes() -> None:
    """With successThreshold 3 the load is ready only after three successful probes in a row."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        probe = TcpProbe(
            type="tcp", address=f"127.0.0.1:{listener.getsockname()[1]}", period_seconds=0.05, success_threshold=3
        )
        seen: list[str] = []
        await asyncio.wait_for(wait_until_ready(probe, 0, 0, seen.append), 10)
    assert seen == ["ok: connected"] * 3
