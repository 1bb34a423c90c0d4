"""The start gate with a real runtime: podman (runc) runs the shipped OCI hook at createRuntime and poststop.

Every container is started by ``podman run`` with ``--hooks-dir`` holding
``packaging/oci-hooks.d/nodeguard.json`` (its command pointed at this
project's nodeguard and at the test daemon's socket) and the
``nodeguard.io/*`` annotations. The containers record when they start and
when the gate's readiness probe first reached them (``gated/server.sh``), in a
host directory bind-mounted into each, so the checks rest on the containers'
own records.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.containers import runtime
from tests.containers.pods import GATED, read_records
from tests.containers.runtime import Podman
from tests.support.gate import Gate, running
from tests.support.poll import wait_until
from tests.support.ports import free_port
from tests.support.records import max_overlap


@dataclass
class GatedRuntime:
    """podman with the shipped hook against one test daemon (or none), and the containers it starts."""

    podman: Podman
    image: str
    records: Path
    names: list[str]
    prefix: str = field(default_factory=lambda: f"ngtest-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    launches: list[subprocess.Popen[str]] = field(default_factory=list)

    def container(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def launch(
        self, name: str, delay: float, port: int | None = None, annotations: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """``podman run -d`` of a gated server container; it returns once the hook has let the container start."""
        port = port or free_port()
        notes = {
            "nodeguard.io/gate": "true",
            "nodeguard.io/name": name,
            "nodeguard.io/ready-http": f"http://127.0.0.1:{port}/cgi-bin/ready",
            **(annotations or {}),
        }
        options = [arg for key, value in notes.items() for arg in ("--annotation", f"{key}={value}")]
        options += ["--volume", f"{self.records}:/records", "--volume", f"{GATED}:/gate:ro"]
        container = self.container(name)
        self.names.append(container)
        args = self.podman.run_args(
            container, self.image, ["sh", "/gate/server.sh", name, str(port), str(delay)], options
        )
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.launches.append(proc)
        return proc

    def record_of(self, name: str) -> dict[str, float]:
        return read_records(self.records).get(name, {})

    def finish(self) -> None:
        """Wait for every ``podman run`` (their hooks are gone), killing one that still hangs."""
        for proc in self.launches:
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


@contextlib.contextmanager
def gated_runtime(
    tmp_path: Path,
    podman: Podman,
    image: str,
    socket: Path,
    *,
    hook_args: Sequence[str] = (),
    hook_timeout: int | None = None,
) -> Iterator[GatedRuntime]:
    hooks = tmp_path / "hooks"
    runtime.install_hook(hooks, socket, hook_args, hook_timeout)
    records = tmp_path / "records"
    records.mkdir()
    with runtime.containers(podman) as names:
        gated = GatedRuntime(podman.with_hooks(hooks), image, records, names)
        try:
            yield gated
        finally:
            runtime.kill_hooks(socket)
            gated.finish()
            gated.podman.remove(*names)


def launched(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """The container id ``podman run -d`` printed; fails with its output if it failed."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"podman run exited {proc.returncode}: {err}"
    return out.strip().splitlines()[-1]


def gate_config(**limits: Any) -> dict[str, Any]:
    return {"maxStarting": 2, "maxStartingPerCore": None, "startTimeoutSeconds": 60, **limits}


@contextlib.contextmanager
def gate_and_podman(tmp_path: Path, podman: Podman, image: str, **limits: Any) -> Iterator[tuple[Gate, GatedRuntime]]:
    """A test daemon's gate with these limits, and podman gated by it."""
    with (
        running(tmp_path, gate_config(**limits)) as gate,
        gated_runtime(tmp_path, podman, image, Path(gate.socket)) as gated,
    ):
        yield gate, gated


CONTAINERS = 12


def test_twelve_containers_started_at_once_never_more_than_two_starting(
    tmp_path: Path, podman: Podman, busybox_image: str
) -> None:
    """12 containers started at once with maxStarting 2: their own records never show more than 2 starting, all get ready."""
    with gate_and_podman(tmp_path, podman, busybox_image, maxStarting=2) as (gate, gated):
        procs = [gated.launch(f"web{i}", delay=0.5) for i in range(CONTAINERS)]
        for proc in procs:
            launched(proc)
        for i in range(CONTAINERS):
            gate.wait_state(f"web{i}", "ready", timeout=60)

        def all_ready() -> dict[str, dict[str, float]] | None:
            found = read_records(gated.records)
            return found if sum("ready" in r for r in found.values()) == CONTAINERS else None

        records = wait_until(all_ready, 10, "every container's ready record")
        intervals = [(r["start"], r["ready"]) for r in records.values()]
        assert all(start < ready for start, ready in intervals), records
        peak = max_overlap(intervals)
        assert peak <= 2, f"{peak} containers starting at once: {sorted(intervals)}"
        counters = gate.status()["counters"]
        assert counters["admitted"] == CONTAINERS and counters["ready"] == CONTAINERS, counters


def test_after_annotation_holds_a_container_until_the_one_it_names_is_ready(
    tmp_path: Path, podman: Podman, busybox_image: str
) -> None:
    """nodeguard.io/after: refused while the gate does not know the name; once it does, held until that one is ready."""
    with gate_and_podman(tmp_path, podman, busybox_image, maxStarting=4) as (gate, gated):
        early = gated.launch("app-early", delay=0, annotations={"nodeguard.io/name": "app", "nodeguard.io/after": "db"})
        out, err = early.communicate(timeout=60)
        assert early.returncode != 0, out
        assert "dependsOn names 'db', which is not a known load" in err, err
        assert gated.record_of("app") == {}
        db = gated.launch("db", delay=1.5)
        gate.wait_state("db", "starting")
        app = gated.launch("app", delay=0, annotations={"nodeguard.io/after": "db"})
        assert gate.wait_state("app", "blocked")["reason"] == "waiting for db"
        launched(db)
        launched(app)
        gate.wait_state("app", "ready", timeout=30)
        db_record, app_record = gated.record_of("db"), gated.record_of("app")
        assert app_record["start"] > db_record["ready"], (db_record, app_record)


def test_a_container_killed_while_starting_frees_its_slot_at_poststop(
    tmp_path: Path, podman: Podman, busybox_image: str
) -> None:
    """A container killed before it is ready gives its slot back (poststop hook), and the next one starts."""
    with gate_and_podman(tmp_path, podman, busybox_image, maxStarting=1) as (gate, gated):
        launched(gated.launch("stuck", delay=3600))  # never serves
        gate.wait_state("stuck", "starting")
        nxt = gated.launch("next", delay=0)
        gate.wait_state("next", "pending")
        assert "start" not in gated.record_of("next")
        killed_at = time.time()
        podman("kill", gated.container("stuck"))
        launched(nxt)
        wait_until(lambda: gate.load("stuck") is None, 20, "the killed container's load released")
        started = wait_until(lambda: gated.record_of("next").get("start"), 10, "the next container's start record")
        assert started > killed_at
        gate.wait_state("next", "ready", timeout=30)


def test_a_container_never_ready_fails_after_its_start_timeout_and_frees_its_slot(
    tmp_path: Path, podman: Podman, busybox_image: str
) -> None:
    """A container whose probe never succeeds fails after nodeguard.io/start-timeout; the next one starts; it runs on."""
    with gate_and_podman(tmp_path, podman, busybox_image, maxStarting=1) as (gate, gated):
        launched(gated.launch("stuck", delay=3600, annotations={"nodeguard.io/start-timeout": "2"}))
        admitted = gate.wait_state("stuck", "starting")
        launched(gated.launch("next", delay=0))
        failed = gate.wait_state("stuck", "failed", timeout=20)
        assert "not ready" in failed["reason"], failed
        next_start = wait_until(lambda: gated.record_of("next").get("start"), 10, "the next container's start record")
        stuck_start = gated.record_of("stuck")["start"]
        assert next_start > stuck_start + 1.5, (stuck_start, next_start)  # not before the 2 s timeout
        assert admitted["timeoutInSeconds"] <= 2
        gate.wait_state("next", "ready", timeout=30)
        # The gate frees the slot; it does not stop the container.
        assert podman("inspect", "--format", "{{.State.Running}}", gated.container("stuck")) == "true"


@pytest.mark.parametrize(
    ("mode", "hook_args"),
    [("refuse", ["--connect-timeout", "2"]), ("fail-open", ["--connect-timeout", "2", "--if-unavailable", "admit"])],
)
def test_with_the_daemon_down_the_runtime_refuses_or_starts_ungated(
    tmp_path: Path, podman: Podman, busybox_image: str, mode: str, hook_args: list[str]
) -> None:
    """No daemon: the shipped hook makes the runtime refuse the container after --connect-timeout; fail-open starts it."""
    socket = tmp_path / "run" / "gate.sock"  # nothing listens there
    with gated_runtime(tmp_path, podman, busybox_image, socket, hook_args=hook_args) as gated:
        started = time.monotonic()
        proc = gated.launch("web", delay=0)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - started
        if mode == "refuse":
            assert proc.returncode != 0, out
            assert "hook" in err and "exit status 75" in err, err
            assert gated.record_of("web") == {}, "the container must not have run"
        else:
            assert proc.returncode == 0, err
            wait_until(lambda: "start" in gated.record_of("web"), 10, "the ungated container's start record")
        assert elapsed < 20, elapsed  # the connect timeout (2 s), not the hook's (900 s)


@pytest.mark.parametrize("kind", ["missing", "refused"])
def test_with_the_daemon_down_podman_names_the_container_and_the_socket(
    tmp_path: Path, podman: Podman, busybox_image: str, kind: str
) -> None:
    """No daemon (no socket, or one left behind): podman's error names the container and the socket, says the
    daemon is not running and how to fail open, and is not podman's "command that was not found"."""
    gate_socket = tmp_path / "run" / "gate.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if kind == "refused":  # bound and never listening: what a daemon that died leaves
        gate_socket.parent.mkdir(parents=True)
        stale.bind(str(gate_socket))
    try:
        with gated_runtime(tmp_path, podman, busybox_image, gate_socket, hook_args=["--connect-timeout", "2"]) as gated:
            proc = gated.launch("web", delay=0)
            out, err = proc.communicate(timeout=60)
            print(f"podman run exited {proc.returncode}:\n{err}")
            assert gated.record_of("web") == {}, "the container must not have run"
    finally:
        stale.close()
    assert proc.returncode == 126, (proc.returncode, out, err)  # podman's status for a failed create, not 127
    assert "command that was not found" not in err, err
    assert "exit status 75" in err and f'nodeguard: container "{gated.container("web")}" (id ' in err, err
    why = f"no gate socket at {gate_socket}" if kind == "missing" else f"the gate socket {gate_socket} refuses"
    assert why in err and "the nodeguard daemon is not running" in err, err
    assert '"systemctl status nodeguard"' in err and '"--if-unavailable", "admit"' in err, err


def test_a_stopped_daemon_is_reported_as_not_answering_before_the_hooks_timeout(
    tmp_path: Path, podman: Podman, busybox_image: str
) -> None:
    """A daemon that accepts but never answers (stopped): the hook gives up after --connect-timeout, and podman's
    error names the container and says the daemon did not answer."""
    with (
        running(tmp_path, gate_config()) as gate,
        gated_runtime(
            tmp_path, podman, busybox_image, Path(gate.socket), hook_args=["--connect-timeout", "2"], hook_timeout=60
        ) as gated,
    ):
        proc, out, err, elapsed = launch_with_the_daemon_stopped(gate, gated)
        print(f"podman run exited {proc.returncode} after {elapsed:.1f} s:\n{err}")
        assert gated.record_of("web") == {}, "the container must not have run"
    assert proc.returncode == 126, (proc.returncode, out, err)
    assert f'nodeguard: container "{gated.container("web")}" (id ' in err, err
    assert f"accepted a connection on {gate.socket} but did not answer in 2 s" in err, err
    assert elapsed < 30, elapsed  # the connect timeout (2 s), not the hook's (60 s)


def launch_with_the_daemon_stopped(gate: Any, gated: Any) -> tuple[subprocess.Popen[str], str, str, float]:
    """``podman run`` of "web" while the daemon is SIGSTOPped (it accepts, never answers): the process, its output
    and how long it took."""
    gate.daemon.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        proc = gated.launch("web", delay=0)
        out, err = proc.communicate(timeout=60)
        return proc, out, err, time.monotonic() - started
    finally:
        gate.daemon.signal(signal.SIGCONT)


def test_a_hung_daemon_cannot_hold_the_runtime_past_the_hooks_timeout(
    tmp_path: Path, podman: Podman, busybox_image: str
) -> None:
    """A daemon that accepts but never answers (stopped): runc kills the hook at its timeout and refuses the container."""
    with (
        running(tmp_path, gate_config()) as gate,
        gated_runtime(tmp_path, podman, busybox_image, Path(gate.socket), hook_timeout=3) as gated,
    ):
        proc, out, err, elapsed = launch_with_the_daemon_stopped(gate, gated)
        assert proc.returncode != 0, out
        assert "timeout" in err, err
        assert 3 <= elapsed < 30, elapsed
        assert gated.record_of("web") == {}, "the container must not have run"
