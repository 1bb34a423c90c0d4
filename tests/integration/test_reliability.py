"""The real daemon under faults: descriptors running out, clients that never read, a gate that cannot serve,
quota writes refused, hostile config files at reload; and its JSON log, every line of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from nodeguard.surfaces.http import MAX_CONNECTIONS, HttpServer
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.endpoints import get
from tests.support.gate import Session
from tests.support.poll import wait_until_async
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def config(tmp: Path, **sections: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "sensing": {"kubepods": False, "tickSeconds": 0.2},
        "actuation": {"ledgerPath": str(tmp / "run/ledger.json")},
        "http": {"listen": f"127.0.0.1:{free_port()}"},
        "gate": {"socket": str(tmp / "run/gate.sock")},
    }
    for key, value in sections.items():
        settings[key] = {**settings.get(key, {}), **value}
    return {"global": settings}


class Running:
    """A started daemon, its endpoints, and its log checked line by line at the end."""

    def __init__(self, daemon: DaemonProcess, cfg: dict[str, Any]) -> None:
        self.daemon = daemon
        self.base = f"http://{cfg['global']['http']['listen']}"
        self.socket = str(cfg["global"]["gate"]["socket"])

    @property
    def pid(self) -> int:
        assert self.daemon.proc is not None
        return self.daemon.proc.pid

    def readyz(self) -> tuple[int, str]:
        try:
            return get(self.base + "/readyz")
        except OSError as exc:
            return 0, str(exc)

    def status(self) -> dict[str, Any]:
        return dict(json.loads(get(self.base + "/status")[1]))

    def ping(self) -> bool:
        try:
            session = Session(self.socket)
        except OSError:
            return False
        try:
            return bool(session.request({"op": "ping"})["ok"])
        except (OSError, AssertionError):
            return False
        finally:
            session.close()

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.daemon.events() if e.get("event") == event]

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


def every_line_is_json(daemon: DaemonProcess) -> list[dict[str, Any]]:
    lines = daemon.log_path.read_text().splitlines()
    assert lines
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line in the daemon's log: {line!r}") from None
    return parsed


def start(tmp: Path, cfg: dict[str, Any], wrapper: list[str] | None = None, ready: bool = True) -> Running:
    daemon = DaemonProcess(cfg, tmp, wrapper=wrapper or ())
    daemon.start()
    running = Running(daemon, cfg)
    if ready:
        daemon.wait_for(lambda: running.readyz()[0] == 200 and running.ping(), 30, "the daemon ready")
    return running


def stop(running: Running) -> None:
    running.daemon.signal(signal.SIGTERM)
    assert running.daemon.wait(20) == 0


@pytest.fixture
def cleanup() -> Iterator[list[Running]]:
    started: list[Running] = []
    yield started
    for running in started:
        running.daemon.kill()


def test_running_out_of_descriptors_pauses_the_gate_and_http_and_both_come_back(
    tmp_path: Path, cleanup: list[Running]
) -> None:
    """With every descriptor taken the gate and HTTP pause accepting (logged as JSON), then serve again once some are free."""
    limit = 96
    # soft < hard: the daemon raises its soft limit to the hard one (systemd and runtimes leave it at 1024).
    running = start(tmp_path, config(tmp_path), wrapper=["prlimit", f"--nofile={limit // 2}:{limit}", "--"])
    cleanup.append(running)
    held = []
    try:
        for _ in range(limit):  # more than the daemon has left: the kernel queues what it cannot accept
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(running.socket)
            held.append(sock)
        running.daemon.wait_for(
            lambda: running.logged("gate: cannot accept connections for now; pausing"), 15, "the gate pausing on EMFILE"
        )
        tcp = socket.create_connection(tuple(running.base.removeprefix("http://").split(":")))  # type: ignore[arg-type]
        held.append(tcp)
        running.daemon.wait_for(
            lambda: running.logged("socket.accept() out of system resource"),
            15,
            "asyncio's HTTP server pausing on EMFILE",
        )
    finally:
        for sock in held:
            sock.close()
    running.daemon.wait_for(running.ping, 15, "the gate serving again")
    running.daemon.wait_for(lambda: running.readyz()[0] == 200, 15, "/readyz again")
    assert running.status()["health"] == {"guard": None, "gate": None, "writer": None}
    limits = Path(f"/proc/{running.pid}/limits").read_text()
    assert any(
        line.startswith("Max open files") and line.split()[3:5] == [str(limit)] * 2 for line in limits.splitlines()
    ), limits
    stop(running)
    events = every_line_is_json(running.daemon)
    asyncio_error = next(e for e in events if e["event"] == "socket.accept() out of system resource")
    assert "Too many open files" in asyncio_error["exception"]  # its traceback, as text in the JSON line


def test_three_hundred_clients_that_never_read_cost_bounded_memory(tmp_path: Path, cleanup: list[Running]) -> None:
    """300 clients flooding status requests without reading the answers raise the daemon's peak RSS by tens of MiB at most."""
    running = start(tmp_path, config(tmp_path, http={"enabled": False}), ready=False)
    cleanup.append(running)
    running.daemon.wait_for(running.ping, 30, "the gate")
    session = Session(running.socket)
    for i in range(100):  # a status answer of ~30 KB: each unread one weighs
        assert session.request({"op": "submit", "name": f"load-{i}", "detach": True, "readiness": {"type": "notify"}})[
            "ok"
        ]
    session.close()
    before = running.rss_mib()
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(300)]
    for sock in clients:
        sock.connect(running.socket)
        sock.setblocking(False)
    flood = b'{"op":"status"}\n' * 64
    pending, dropped, deadline = list(clients), 0, time.monotonic() + 60
    while pending:  # send until the daemon stops reading every one of them
        assert time.monotonic() < deadline, "the daemon kept reading clients that never read"
        for sock in list(pending):
            try:
                while True:
                    sock.send(flood)
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                dropped += 1  # the daemon had buffered 1 MiB of answers for it first
                pending.remove(sock)
        _, pending, _ = select.select([], pending, [], 2.0)
    connected = running.rss_mib()
    assert running.ping()
    for sock in clients:
        sock.close()
    running.daemon.wait_for(lambda: running.descriptors() < 40, 20, "the connections closed")
    closed = running.rss_mib()
    peak = peak_rss_mib(running.pid)
    print(f"RSS MiB: before {before:.0f}, connected {connected:.0f}, closed {closed:.0f}, peak {peak:.0f}")
    assert dropped == 0
    assert peak - before < 64  # it was +310 MiB: ~1 MiB kept per client
    assert closed - before < 64
    stop(running)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_gate_that_cannot_serve_leaves_the_guard_running_and_readyz_says_so(
    tmp_path: Path, cleanup: list[Running]
) -> None:
    """A gate socket in a directory that cannot exist: the guard ticks, /readyz is 503 naming the gate, until it can serve."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the socket's directory should be")
    cfg = config(tmp_path, gate={"socket": str(blocker / "gate.sock")})
    running = start(tmp_path, cfg, ready=False)
    cleanup.append(running)
    running.daemon.wait_for(
        lambda: running.readyz()[0] == 503 and "gate:" in running.readyz()[1], 30, "/readyz reporting the gate"
    )
    ticks = running.status()["ticks"]
    running.daemon.wait_for(lambda: running.status()["ticks"] > ticks + 2, 10, "the guard ticking")
    health = running.status()["health"]
    assert health["guard"] is None and "cannot serve" in health["gate"] and "blocker" in health["gate"], health
    blocker.unlink()
    running.daemon.wait_for(lambda: running.readyz()[0] == 200, 30, "the gate serving once it can")
    assert running.ping()
    stop(running)
    every_line_is_json(running.daemon)


def test_quota_writes_refused_make_readyz_unready(tmp_path: Path, cleanup: list[Running]) -> None:
    """A daemon whose quota writes fail with EACCES (no CAP_DAC_OVERRIDE, a delegated cgroup) is not ready, and says why."""
    with rc.v1_cpu_group() as group:
        for directory in group.dirs:
            for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"):
                if (directory / name).exists():
                    os.chown(directory / name, 65534, 65534)  # delegated to another user
        busy = rc.start_busy(*group.dirs)
        try:
            cfg = config(
                tmp_path,
                sensing={"cgroupVersion": "v1", "discoverySeconds": 0.2},
                workloads={"groups": [{"match": group.name, "class": "BestEffort"}]},
                guard={
                    "objectives": [
                        {
                            "metric": "cpu_total_usage",
                            "action": "throttle",
                            "threshold": 0.3,
                            "restoreBelow": 0.1,
                            "triggerAfter": 1,
                        }
                    ]
                },
            )
            # Root without the capabilities that let it write other users' files.
            running = start(
                tmp_path,
                cfg,
                ready=False,
                wrapper=["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"],
            )
            cleanup.append(running)
            running.daemon.wait_for(lambda: "writer:" in running.readyz()[1], 30, "/readyz reporting refused writes")
            code, body = running.readyz()
            assert code == 503 and "EACCES" in body and group.name in body, body
            assert running.ping()  # the rest works
            stop(running)
        finally:
            rc.stop(busy)


def big_valid_config(cfg: dict[str, Any], rules: int) -> dict[str, Any]:
    rule = {
        "nodeSelector": {"matchLabels": {"nodeguard.test/never": "matches"}},
        "guard": {
            "objectives": [
                {"metric": "cpu_total_usage", "action": "throttle", "threshold": "80%", "restoreBelow": "60%"}
            ]
            * 5
        },
        "workloads": {"groups": [{"match": "system.slice/batch-*.service", "class": "BestEffort"}] * 5},
    }
    return {**cfg, "perNode": [rule] * rules}


def test_reload_reads_off_the_event_loop_and_refuses_fifos_and_giant_files(
    tmp_path: Path, cleanup: list[Running]
) -> None:
    """SIGHUP with a FIFO or a file over 4 MiB is refused at once; a large valid file reloads while ticks go on; SIGTERM ends a reload."""
    cfg = config(tmp_path, sensing={"tickSeconds": 0.1})
    running = start(tmp_path, cfg)
    cleanup.append(running)
    path = running.daemon.config_path
    good = path.read_text()

    path.unlink()
    os.mkfifo(path)
    running.daemon.signal(signal.SIGHUP)
    running.daemon.wait_for(
        lambda: any(
            "FIFO" in e.get("problem", "") for e in running.logged("reload rejected; keeping the running config")
        ),
        10,
        "the FIFO refused",
    )
    assert running.ping() and get(running.base + "/healthz")[0] == 200
    path.unlink()

    path.write_text(good + " " * (4 << 20))
    running.daemon.signal(signal.SIGHUP)
    running.daemon.wait_for(
        lambda: any(
            "more than" in e.get("problem", "") for e in running.logged("reload rejected; keeping the running config")
        ),
        10,
        "the giant file refused",
    )

    path.write_text(json.dumps(big_valid_config(cfg, 3500)))  # ~3 MiB: over a second to read and check
    running.daemon.signal(signal.SIGHUP)
    running.daemon.wait_for(lambda: running.logged("config reloaded"), 30, "the large file reloaded")
    events = running.daemon.events()
    began = max(i for i, e in enumerate(events) if e.get("event") == "reloading config")
    ended = next(i for i, e in enumerate(events) if e.get("event") == "config reloaded")
    ticks = [e for e in events[began:ended] if e.get("event") == "tick"]
    assert len(ticks) >= 2, "the event loop did not tick while the config was read and checked"

    running.daemon.signal(signal.SIGHUP)
    running.daemon.wait_for(lambda: len(running.logged("reloading config")) >= 2, 10, "a second reload begun")
    stop(running)  # SIGTERM in the middle of it
    every_line_is_json(running.daemon)


EDGE_CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    # name: (sections laid over the base config, the JSON paths check-config and run must both name; none: valid).
    # "HUGE" is written as 1e999, which JSON parsers read as infinity.
    "nul-bytes-in-paths": (
        {
            "actuation": {"ledgerPath": "/tmp/x\u0000y/ledger.json"},
            "gate": {"socket": "/tmp/gate\u0000.sock"},
            "sensing": {"cgroupRoot": "/sys/fs/cgroup\u0000", "procRoot": "/proc\u0000"},
            "coordination": {"stateDir": "/run/x\u0000"},
        },
        [
            "global.actuation.ledgerPath",
            "global.gate.socket",
            "global.sensing.cgroupRoot",
            "global.sensing.procRoot",
            "global.coordination.stateDir",
        ],
    ),
    "infinity-and-booleans-as-numbers": (
        {
            "guard": {"minQuotaCores": "HUGE"},
            "sensing": {"tickSeconds": True},
            "gate": {"allowedUids": [0, True], "maxStarting": False},
            "http": {"listen": "999.1.1.1:9466"},
        },
        [
            "global.guard.minQuotaCores",
            "global.sensing.tickSeconds",
            "global.gate.allowedUids[1]",
            "global.gate.maxStarting",
            "global.http.listen",
        ],
    ),
    "huge-values-and-a-directory-as-ledger": (
        {"gate": {"maxRate": "HUGE"}, "guard": {"minQuotaCores": 1e300}, "actuation": {"ledgerPath": "/"}},
        ["global.gate.maxRate", "global.guard.minQuotaCores", "global.actuation.ledgerPath"],
    ),
    "valid-unicode-path-and-booleans-where-booleans": (
        {
            "actuation": {"ledgerPath": "LEDGER/l\u00e9dger.json", "freezeBeforeEviction": False},
            "gate": {"maxStarting": 3},
        },
        [],
    ),
}


def test_check_config_and_run_agree_on_edge_cases(tmp_path: Path) -> None:
    """check-config accepts exactly the configs run starts with; both name the same path for the rest; run logs only JSON."""
    procs: dict[str, tuple[subprocess.Popen[bytes], DaemonProcess]] = {}
    for index, (name, (sections, _)) in enumerate(EDGE_CASES.items()):
        workdir = tmp_path / f"c{index}"  # short: the gate socket's path has at most 107 bytes
        workdir.mkdir()
        text = json.dumps(config(workdir, **sections)).replace("LEDGER", str(workdir)).replace('"HUGE"', "1e999")
        daemon = DaemonProcess({}, workdir, "--dry-run")
        daemon.config_path.write_text(text)
        check = subprocess.Popen(
            [sys.executable, "-m", "nodeguard", "check-config", str(daemon.config_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs[name] = (check, daemon.start())
    try:
        for name, (check, daemon) in procs.items():
            checked, _ = check.communicate(timeout=60)
            expected_paths = EDGE_CASES[name][1]
            if not expected_paths:
                assert check.returncode == 0, (name, checked)
                daemon.wait_for(
                    lambda d=daemon: any(e.get("event") == "tick" for e in d.events()),  # type: ignore[misc]
                    30,
                    f"{name}: a tick",
                )
                daemon.signal(signal.SIGTERM)
                assert daemon.wait(20) == 0, name
                every_line_is_json(daemon)
                continue
            assert check.returncode == 1, (name, checked)
            assert daemon.wait(60) == 1, name
            rejected = [e for e in every_line_is_json(daemon) if e.get("event") == "config rejected; not starting"]
            assert len(rejected) == 1, name
            by_check = sorted(line.strip() for line in checked.decode().splitlines()[1:])
            assert by_check == sorted(rejected[0]["problems"]), name  # the same problems, word for word
            for path in expected_paths:
                assert any(problem.startswith(f"{path}:") for problem in by_check), (name, path, by_check)
    finally:
        for _, daemon in procs.values():
            daemon.kill()


async def test_http_connections_past_the_cap_are_closed_and_it_serves_again() -> None:
    """With MAX_CONNECTIONS idle HTTP connections open, one more is closed unanswered; once they go, requests are served."""
    server = HttpServer(CollectorRegistry(), dict, dict)
    port = free_port()
    listening = await server.start(f"127.0.0.1:{port}")
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
    try:
        await wait_until_async(lambda: server.open >= MAX_CONNECTIONS, 10, f"{MAX_CONNECTIONS} connections open",
                               interval=0.01, detail=lambda: f"open: {server.open}")  # fmt: skip
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        try:
            answer = await asyncio.wait_for(reader.read(), 10)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" and server.refused == 1
        writer.close()
    finally:
        for _, idle_writer in idle:
            idle_writer.close()
    await wait_until_async(lambda: not server.open, 10, "every connection closed", interval=0.01,
                           detail=lambda: f"open: {server.open}")  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
    assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"\r\n\r\nok\n")
    writer.close()
    listening.close()
