"""The start gate end to end: the real daemon, real clients (`nodeguard gate`, `admit`, `oci-hook`), real servers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.gate import SLOW_SERVER, Gate, Session, output, running
from tests.support.poll import wait_until
from tests.support.ports import free_port
from tests.support.processes import alive
from tests.support.records import max_overlap, read_records

SERVERS = 20
# index -> the indices it depends on
DEPENDS = {4: [0, 1], 9: [4], 13: [9, 2], 17: [13], 18: [17, 5]}


def test_twenty_servers_two_starting_at_most_in_dependency_order(tmp_path: Path) -> None:
    """20 real servers started through `nodeguard gate` with maxStarting=2 and TCP/HTTP probes: at most 2 are ever between start and listening, all become ready, and each starts only after its dependencies listen."""
    log = tmp_path / "servers.log"
    with running(tmp_path, {"maxStarting": 2, "maxStartingPerCore": None}) as gate:
        for i in range(SERVERS):
            name, port, kind = f"s{i}", free_port(), ("http" if i % 2 else "tcp")
            ready = f"http://127.0.0.1:{port}/" if kind == "http" else f"127.0.0.1:{port}"
            after = ",".join(f"s{d}" for d in DEPENDS.get(i, []))
            if after:  # a dependency must be known when its dependent is submitted
                for dep in DEPENDS[i]:
                    wait_until(lambda dep=dep: gate.load(f"s{dep}"), 30, f"s{dep} to be submitted")
            gate.client(
                "gate", "--name", name, *(["--after", after] if after else []),
                f"--ready-{kind}", ready, "--ready-period", "0.05",
                "--", sys.executable, SLOW_SERVER, name, str(port), "0.3", str(log), kind,
            )  # fmt: skip
        wait_until(
            lambda: (counts := gate.status()["counts"])["ready"] == SERVERS or counts["failed"],
            90,
            "all servers ready",
        )
        status = gate.status()
    assert status["counts"]["ready"] == SERVERS, status["loads"]
    records = read_records(log)
    assert sorted(records) == sorted(f"s{i}" for i in range(SERVERS))
    intervals = [(r["start"], r["ready"]) for r in records.values()]
    assert max_overlap(intervals) == 2  # never more than maxStarting, and the second slot was used
    for i, deps in DEPENDS.items():
        for dep in deps:
            assert records[f"s{i}"]["start"] > records[f"s{dep}"]["ready"], (i, dep)


def test_min_rate_admits_while_cpu_is_over_the_limit(tmp_path: Path) -> None:
    """With CPU over maxCPU a load is held; with minRate set it is admitted anyway, and so are the next ones."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with running(tmp_path, {"maxCPU": 1, "minRate": 0}) as gate:
            wait_until(lambda: (gate.status()["signals"]["cpuPercent"] or 0) > 1, 20, "a CPU sample over 1%")
            session = Session(gate.socket)
            held = session.request({"op": "submit", "name": "held", "detach": True})
            assert held["load"]["state"] == "pending"
            assert gate.load("held")["reason"].startswith("held: maxCPU")  # type: ignore[index]

            gate.reconfigure({"maxCPU": 1, "minRate": 5})
            admitted = gate.wait_state("held", "ready")
            assert admitted["reason"] == "ready: no readiness check"
            for name in ("next-1", "next-2"):
                assert session.request({"op": "submit", "name": name, "detach": True})["ok"]
                gate.wait_state(name, "ready")
            status = gate.status()
            assert status["signals"]["cpuPercent"] > 1
            assert status["counters"]["admitted_by_min_rate"] == 3
            session.close()
    finally:
        burner.kill()
        burner.wait()


def test_a_start_never_ready_fails_after_its_timeout_and_frees_its_slot(tmp_path: Path) -> None:
    """A load whose probe never succeeds fails after startTimeout with the reason recorded, and the load held behind it is admitted."""
    closed = free_port()
    with running(tmp_path, {"maxStarting": 1, "minRate": 0}) as gate:
        first = gate.client("admit", "--name", "never", "--ready-tcp", f"127.0.0.1:{closed}", "--start-timeout", "1.5")
        assert output(first)[0] == 0
        second = gate.client("admit", "--name", "behind")
        held = gate.wait_state("behind", "pending")
        assert held["reason"].startswith("held: maxStarting")
        code, text = output(second)
        assert code == 0, text
        failed = gate.load("never")
        assert failed is not None and failed["state"] == "failed"
        assert failed["reason"].startswith("not ready within 1.5s; last probe failed")
        assert gate.status()["counters"]["timed_out"] == 1


def test_the_socket_refuses_a_uid_that_is_not_allowed(tmp_path: Path) -> None:
    """A peer with an allowed uid is served; one with another uid reaches the socket but gets an `unauthorised` error and changes nothing."""
    # Outside pytest's private tmp so that other uids can reach it, and 0750 like the
    # ledger's /run/nodeguard: the daemon makes it searchable for a socket open to others.
    public = Path(tempfile.mkdtemp(prefix="nodeguard-gate-"))
    public.chmod(0o750)
    try:
        with running(tmp_path, {"socketMode": "0666", "allowedUids": [4242]}, socket_dir=public) as gate:
            allowed = as_uid(4242, gate.socket, {"op": "submit", "name": "from-4242", "detach": True})
            refused = as_uid(4343, gate.socket, {"op": "submit", "name": "from-4343", "detach": True})
            assert allowed["ok"], allowed
            assert refused["ok"] is False and refused["error"]["code"] == "unauthorised", refused
            assert "uid 4343" in refused["error"]["message"]
            status = gate.status()
            assert [load["name"] for load in status["loads"]] == ["from-4242"]
            assert status["counters"]["unauthorised"] == 1
            [warning] = [e for e in gate.daemon.events() if e.get("event") == "gate: refused a peer"]
            assert warning["uid"] == 4343 and warning["command"].startswith("python"), "the peer named in the log"
    finally:
        for leftover in public.iterdir():
            leftover.unlink()
        public.rmdir()


def as_uid(uid: int, path: str, request: dict[str, Any]) -> dict[str, Any]:
    """One request from a forked child running as ``uid``; its response."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, just the socket
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            answer = sock.makefile("rb").readline()
            os.write(write_end, answer)
        except BaseException as exc:  # report anything to the parent, never return into pytest
            os.write(write_end, json.dumps({"ok": None, "child_error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return dict(json.loads(data))


def test_cycles_and_bad_requests_are_refused_and_change_nothing(tmp_path: Path) -> None:
    """A cycle is refused naming it; malformed requests get structured errors, are counted, and leave the loads and the daemon as they were."""
    with running(tmp_path, {}) as gate:
        session = Session(gate.socket)
        assert session.request({"op": "submit", "name": "a", "readiness": {"type": "notify"}, "detach": True})["ok"]
        assert session.request({"op": "submit", "name": "b", "dependsOn": ["a"], "detach": True})["ok"]

        cycle = session.request({"op": "submit", "name": "a", "dependsOn": ["b"], "detach": True})
        assert cycle["error"] == {"code": "cycle", "message": "dependency cycle: a -> b -> a"}
        itself = session.request({"op": "submit", "name": "c", "dependsOn": ["c"]})
        assert itself["error"]["message"] == "dependency cycle: c -> c"
        unknown = session.request({"op": "submit", "name": "d", "dependsOn": ["nobody"]})
        assert unknown["error"]["code"] == "unknown_dependency"
        clustered = session.request({"op": "submit", "name": "e", "semaphore": "prepare"})
        assert clustered["error"]["code"] == "no_coordination", clustered  # coordination.enabled is false

        malformed: list[tuple[dict[str, Any] | bytes, str]] = [
            (b"not json", "not a JSON object"),
            ({"op": "launch"}, "op: expected one of"),
            ({"op": "submit", "name": "x", "colour": "red"}, "colour: unknown field"),
            ({"op": "submit", "name": "x", "priority": "high"}, "priority: Input should be a valid integer"),
            ({"op": "submit", "name": "n" * 254}, "name: a name has at most 253 characters"),
            ({"op": "submit", "name": "../etc"}, "name: a name must not contain path separators"),
            (
                {"op": "submit", "name": "x", "readiness": {"type": "tcp", "address": "nohost"}},
                "readiness.address: expected HOST:PORT",
            ),
            ({"op": "submit", "name": "x", "readiness": {"type": "ping"}}, "readiness"),
            ({"op": "submit", "name": "x", "semaphore": "a/b"}, "semaphore: String should match pattern"),
        ]
        for request, fragment in malformed:
            response = session.request(request)
            assert response["ok"] is False and response["error"]["code"] == "invalid", response
            assert fragment in response["error"]["message"], response
        assert session.request({"op": "ping", "id": 9}) == {"id": 9, "ok": True}
        status = gate.status()
        assert [(x["name"], x["state"], x["dependsOn"]) for x in status["loads"]] == [
            ("a", "starting", []),
            ("b", "blocked", ["a"]),
        ]
        assert status["counters"]["malformed"] == len(malformed)
        session.close()


def test_a_client_killed_while_starting_frees_its_slot(tmp_path: Path) -> None:
    """`nodeguard gate` killed (with its command) while its load is starting: the slot goes to the load waiting behind it."""
    closed = free_port()
    with running(tmp_path, {"maxStarting": 1, "minRate": 0}) as gate:
        victim = gate.client("gate", "--name", "victim", "--ready-tcp", f"127.0.0.1:{closed}", "--", "sleep", "60")
        gate.wait_state("victim", "starting")
        waiting = gate.client("admit", "--name", "waiting")
        gate.wait_state("waiting", "pending")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        code, text = output(waiting)
        assert code == 0, text
        assert gate.load("victim")["reason"] == "client disconnected"  # type: ignore[index]


def test_a_daemon_restart_keeps_the_slots_of_starting_loads(tmp_path: Path) -> None:
    """After the daemon is killed and restarted, a load that was starting still holds its slot until its probe succeeds."""
    port = free_port()
    gate = Gate(tmp_path, {"maxStarting": 1, "minRate": 0}).start()
    try:
        marker = tmp_path / "holder-runs"
        holder = gate.client(
            "gate", "--name", "holder", "--ready-tcp", f"127.0.0.1:{port}", "--ready-period", "0.1",
            "--", "sh", "-c", f"touch {marker}; exec sleep 60",
        )  # fmt: skip
        # Its command runs: the client was told it is admitted, so the admission is on disk.
        wait_until(marker.exists, 20, "the holder's command to run")
        gate.daemon.kill()  # SIGKILL: no chance to save anything at exit
        gate.daemon.start()
        gate.daemon.wait_for(gate._answers, 20, "the restarted gate")
        restored = gate.wait_state("holder", "starting")
        assert restored.get("restored") is True

        behind = gate.client("admit", "--name", "behind")
        assert gate.wait_state("behind", "pending")["reason"].startswith("held: maxStarting: 1 of 1")
        with socket.create_server(("127.0.0.1", port)):  # the holder becomes ready
            code, text = output(behind)
        assert code == 0, text
        assert gate.load("holder")["state"] == "ready"  # type: ignore[index]
        assert holder.poll() is None  # its command runs on, untouched by the restart
    finally:
        gate.stop()


def test_notify_readiness_and_exit_status_pass_through(tmp_path: Path) -> None:
    """`nodeguard gate --notify`: the command's READY=1 on $NOTIFY_SOCKET makes the load ready; its exit status is the client's."""
    notify = (
        "import os, socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
        "a = os.environ['NOTIFY_SOCKET']; s.sendto(b'READY=1', '\\0' + a[1:] if a[0] == '@' else a)"
    )
    with running(tmp_path, {}) as gate:
        proc = gate.client(
            "gate",
            "--name",
            "notified",
            "--notify",
            "--",
            "sh",
            "-c",
            f'{sys.executable} -c "{notify}"; sleep 0.5; exit 7',
        )
        code, text = output(proc)
        assert code == 7, text
        assert "notified is ready: ready: notified" in text
        assert gate.load("notified") is None  # released when the command exited
        assert gate.status()["counters"]["ready"] == 1


def test_oci_hook_admits_a_container_and_releases_it_at_poststop(tmp_path: Path) -> None:
    """`nodeguard oci-hook` admits the container named by its annotation at createRuntime and releases it at poststop."""
    annotations = {"nodeguard.io/name": "web"}
    state = {"ociVersion": "1.0.2", "id": "0123abcd", "pid": 4242, "bundle": "/b", "annotations": annotations}
    with running(tmp_path, {}) as gate:
        hook = gate.client("oci-hook", stdin=subprocess.PIPE)
        out, _ = hook.communicate(json.dumps({**state, "status": "creating"}).encode(), timeout=30)
        assert hook.returncode == 0, out
        load = gate.load("web")
        assert load is not None and load["state"] == "ready" and load["detached"] is True
        hook = gate.client("oci-hook", stdin=subprocess.PIPE)
        out, _ = hook.communicate(json.dumps({**state, "status": "stopped"}).encode(), timeout=30)
        assert hook.returncode == 0, out
        assert gate.load("web") is None


def test_a_failed_start_stops_the_command_and_everything_it_started(tmp_path: Path) -> None:
    """`nodeguard gate` whose start fails (never ready within startTimeout) stops its command and the processes
    the command started (psutil walks the tree); with --keep-on-failure the command goes on."""
    closed = free_port()
    pids = tmp_path / "pids"
    script = f"sleep 600 & echo $! >> {pids}; echo $$ >> {pids}; wait"
    with running(tmp_path, {"maxStarting": 4}) as gate:
        stopped = gate.client("gate", "--name", "hung", "--ready-tcp", f"127.0.0.1:{closed}", "--start-timeout", "1.5",
                              "--stop-grace", "2", "--", "sh", "-c", script)  # fmt: skip
        code, out = output(stopped)
        assert "stopping hung and what it started" in out, out
        assert code == 128 + signal.SIGTERM, out
        started = [int(line) for line in pids.read_text().split()]
        assert len(started) == 2
        for pid in started:
            wait_until(lambda pid=pid: not alive(pid), 10, f"pid {pid} stopped")
        kept = gate.client("gate", "--name", "kept", "--ready-tcp", f"127.0.0.1:{closed}", "--start-timeout", "1.5",
                           "--keep-on-failure", "--", "sh", "-c", "sleep 3; echo still-here")  # fmt: skip
        code, out = output(kept)
        assert code == 0 and "still-here" in out, out


def test_a_command_that_ends_while_the_daemon_is_down_releases_its_slot_once_it_is_back(tmp_path: Path) -> None:
    """`nodeguard gate` whose command ends while the daemon is down reconnects and releases: the restored load's
    slot goes to the next load at once, not at its start timeout."""
    closed = free_port()
    gate = Gate(tmp_path, {"maxStarting": 1, "minRate": 0, "startTimeoutSeconds": 300}).start()
    try:
        marker = tmp_path / "started"
        holder = gate.client(
            "gate", "--name", "holder", "--ready-tcp", f"127.0.0.1:{closed}",
            "--", "sh", "-c", f"echo $$ > {marker}; sleep 1.5",
        )  # fmt: skip
        pid = int(wait_until(lambda: marker.exists() and marker.read_text().strip(), 20, "the holder's command to run"))
        gate.daemon.kill()
        wait_until(lambda: not alive(pid), 10, "the command ended while nobody serves the gate")
        gate.daemon.start()
        gate.daemon.wait_for(gate._answers, 20, "the restarted gate")
        code, text = output(holder)
        assert code == 0, text
        wait_until(lambda: gate.load("holder") is None, 5, "the holder released")
        code, text = output(gate.client("admit", "--name", "next", "--connect-timeout", "5"))
        assert code == 0, text
    finally:
        gate.stop()


def test_a_restored_load_whose_client_is_gone_is_released_within_the_grace(tmp_path: Path) -> None:
    """A load restored after a restart whose client died meanwhile is released once the clients' grace is over
    (10 s without coordination), long before its start timeout."""
    closed = free_port()
    gate = Gate(tmp_path, {"maxStarting": 1, "minRate": 0, "startTimeoutSeconds": 300}).start()
    try:
        marker = tmp_path / "orphan-runs"
        orphan = gate.client(
            "gate", "--name", "orphan", "--ready-tcp", f"127.0.0.1:{closed}",
            "--", "sh", "-c", f"touch {marker}; exec sleep 60",
        )  # fmt: skip
        # Its command runs: the client was told it is admitted, so the admission is on disk (/status shows it
        # a moment before that).
        wait_until(marker.exists, 20, "the orphan's command to run")
        gate.daemon.kill()
        os.killpg(orphan.pid, signal.SIGKILL)
        orphan.wait()
        gate.daemon.start()
        gate.daemon.wait_for(gate._answers, 20, "the restarted gate")
        back = time.monotonic()
        assert gate.wait_state("orphan", "starting").get("restored") is True
        failed = gate.wait_state("orphan", "failed", timeout=20)
        assert "client did not come back" in failed["reason"]
        assert 6.0 <= time.monotonic() - back <= 20.0  # the grace is 10 s from serving again; the timeout is 300 s
    finally:
        gate.stop()
