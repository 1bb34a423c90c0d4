"""A rollout exposes nothing: a successor waits for the node, the old daemon hands its holds over when it stops, and
a stop with no successor still gives everything back; every race between the two.

Real ``nodeguard run`` processes on this host's cgroup v1 (test_protect_e2e's
kubelet-shaped node: six Burstable burners harming a Guaranteed pod, so the
daemon holds the Burstable tier's weight down). Every daemon keeps the same
ledger, each in a directory of its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

from nodeguard.actuators.ledger import Ledger
from nodeguard.successor_start import Starting, read_note
from tests.containers.runtime import wait_for_the_node
from tests.integration.crashes import held, settled
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.endpoints import get
from tests.support.node import SLEEPER_SHARE, SLOW, ShapedNode, protect_config, protected_node
from tests.support.ports import free_port

WAITING = "waiting to take the node over when the nodeguard that holds it stops"
HANDED = "handed every hold over to the successor"
ADOPTED = "adopted the predecessor's holds"


@pytest.fixture
def node() -> Iterator[ShapedNode]:
    """The burners harm the Guaranteed pod for the whole test: a daemon that stops holding exposes it."""
    with protected_node(rc.v1_cpu_hierarchy()) as shaped:
        shaped.start(burners=6, important_share=SLEEPER_SHARE)
        yield shaped


class Daemons:
    """Every daemon a test starts on one ledger; each killed at the end if it still runs."""

    def __init__(self, node: ShapedNode, home: Path) -> None:
        self.node, self.home = node, home
        self.ledger = home / "run/ledger.json"
        self.started: list[DaemonProcess] = []

    def config(self, listen: str | None = None, **actuation: Any) -> dict[str, Any]:
        """The protection daemon, its weight hold far longer than any test: only a stop gives the weight back."""
        config = protect_config(self.node, self.ledger, weightHoldSeconds=600)
        config["global"]["actuation"].update(actuation)
        if listen is not None:
            config["global"]["http"] = {"listen": listen}
        return config

    def start(self, listen: str | None = None, **actuation: Any) -> DaemonProcess:
        workdir = self.home / f"d{len(self.started)}"
        workdir.mkdir()
        daemon = DaemonProcess(self.config(listen, **actuation), workdir).start()
        self.started.append(daemon)
        return daemon

    def holding(self, **actuation: Any) -> DaemonProcess:
        """A daemon that holds the Burstable tier's weight down, in the ledger and the kernel, its write settled
        (started again if another run's nodeguard on this shared host took the node first)."""
        for _ in range(3):
            wait_for_the_node(self.node.hierarchy.writable)
            daemon = self.start(**actuation)
            if came_up(daemon):
                break
        tier = self.tier
        # The kernel is written between the ledger's pending save and its settled one: wait for the latter too.
        daemon.wait_for(lambda: tier in held(self.ledger)["cpu.weight"] and settled(self.ledger)
                        and self.node.hierarchy.weight(tier) != self.node.weights[tier],
                        30 * SLOW, "the tier's weight held")  # fmt: skip
        return daemon

    def successor(self, listen: str | None = None, **actuation: Any) -> DaemonProcess:
        """A daemon that found the node held and waits for it."""
        daemon = self.start(listen, **actuation)
        daemon.wait_for(lambda: logged(daemon, WAITING), 30 * SLOW, "the successor waiting")
        return daemon

    @property
    def tier(self) -> str:
        return f"{self.node.parent}/kubepods/burstable"

    def lowered(self) -> int:
        return self.node.hierarchy.weight(self.tier)

    def kill_all(self) -> None:
        for daemon in self.started:
            daemon.kill()


@pytest.fixture
def daemons(node: ShapedNode, tmp_path: Path) -> Iterator[Daemons]:
    found = Daemons(node, tmp_path)
    try:
        yield found
    finally:
        found.kill_all()


def came_up(daemon: DaemonProcess) -> bool:
    """Whether the daemon got to run; False when it exited first (refused: another nodeguard had the node)."""
    deadline = time.monotonic() + 30 * SLOW
    while not logged(daemon, "nodeguard running"):
        assert daemon.proc is not None and time.monotonic() < deadline, daemon.log_path.read_text()[-2000:]
        if daemon.proc.poll() is not None:
            return False
        time.sleep(0.2)
    return True


def can_lock(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def logged(daemon: DaemonProcess, event: str) -> bool:
    return any(e.get("event") == event for e in daemon.events())


def events(daemon: DaemonProcess) -> list[str]:
    return [str(e.get("event")) for e in daemon.events()]


def stop(daemon: DaemonProcess, signum: signal.Signals = signal.SIGTERM) -> int:
    daemon.signal(signum)
    return daemon.wait(timeout=30 * SLOW)


def nothing_left(daemons: Daemons) -> None:
    """Every weight and limit at its original, the ledger empty, no handover note."""
    assert not daemons.node.changed(), f"left {sorted(daemons.node.changed())}"
    assert not Ledger.load(str(daemons.ledger)), "the ledger still holds"
    assert not Path(f"{daemons.ledger}.handover").exists()
    assert not Path(f"{daemons.ledger}.starting").exists(), "a successor's note for room"


class Sampler:
    """A thread reading one cgroup's weight every few milliseconds: what the protected pod ran against."""

    def __init__(self, read: Any) -> None:
        self.read = read
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.seen.add(self.read())

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# --- the handover ---------------------------------------------------------------------------------------


def test_a_successor_waits_not_ready_and_adopts_the_holds_when_the_old_daemon_stops(daemons: Daemons) -> None:
    """The successor waits (one log line; /readyz 503 naming the holder's pid, /healthz 200, /readyz?successor
    200); SIGTERM to the old daemon hands over: the tier's weight never goes back, not for a moment, and the
    successor has the hold in its state before its first tick. Stopped with no successor, it gives everything
    back."""
    old = daemons.holding()
    lowered = daemons.lowered()
    listen = f"127.0.0.1:{free_port()}"
    new = daemons.successor(listen)
    assert old.proc is not None and new.proc is not None
    # It asked for room before its start cost anything, and the old daemon made it (nodeguard.successor_start).
    assert read_note(str(daemons.ledger)) == Starting(new.proc.pid, ANY, room=True)
    making = [e for e in old.events() if e.get("event") == "making room for a starting successor"]
    assert [e["pid"] for e in making] == [new.proc.pid], making
    time.sleep(2.0)  # waiting a while: it says so once, not on every look at the lock
    assert events(new).count(WAITING) == 1 and "tick" not in events(new)
    assert not can_lock(Path(f"{daemons.ledger}.successor")), "a successor that says it waits holds its place"
    code, body = get(f"http://{listen}/readyz")
    assert code == 503 and f"pid {old.proc.pid}" in body and "waiting for the node lock" in body, body
    assert get(f"http://{listen}/healthz")[0] == 200
    code, body = get(f"http://{listen}/readyz?successor")
    assert code == 200 and f"pid {old.proc.pid}" in body, body
    status = json.loads(get(f"http://{listen}/status")[1])
    assert "waiting for the node lock" in status["health"]["guard"]

    with Sampler(daemons.lowered) as sampler:
        assert stop(old) == 0
        new.wait_for(lambda: "tick" in events(new), 20 * SLOW, "the successor's first tick")
        ticks = len(new.ticks())
        new.wait_for(lambda: len(new.ticks()) >= ticks + 4, 20 * SLOW, "four more ticks")
    assert sampler.seen == {lowered}, f"the tier's weight went through {sampler.seen}"
    assert HANDED in events(old) and "restored every lever on exit" not in events(old)
    said = events(new)
    assert said.index(ADOPTED) < said.index("tick"), said
    record = next(e for e in new.events() if e.get("event") == ADOPTED)
    assert record["predecessor"] == old.proc.pid and record["cpu.weight"] == 1, record
    code, body = get(f"http://{listen}/readyz")
    assert code == 200, body
    assert daemons.tier in json.loads(get(f"http://{listen}/status")[1])["held"]["cpu.weight"]

    assert stop(new) == 0
    assert "restored every lever on exit" in events(new)
    nothing_left(daemons)


def test_two_successors_queue_and_each_takes_over_in_turn(daemons: Daemons) -> None:
    """A second successor waits behind the first: the old daemon hands over to the first, the first to the second,
    and the second, stopped with nobody waiting, gives everything back."""
    old = daemons.holding()
    lowered = daemons.lowered()
    first = daemons.successor()
    second = daemons.successor()
    with Sampler(daemons.lowered) as sampler:
        assert stop(old) == 0
        first.wait_for(lambda: "tick" in events(first), 20 * SLOW, "the first successor's first tick")
        assert "tick" not in events(second), "the second still waits"
        assert stop(first) == 0
        second.wait_for(lambda: "tick" in events(second), 20 * SLOW, "the second successor's first tick")
    assert sampler.seen == {lowered}, f"the tier's weight went through {sampler.seen}"
    assert HANDED in events(old) and HANDED in events(first)
    assert ADOPTED in events(first) and ADOPTED in events(second)
    assert stop(second) == 0
    nothing_left(daemons)


# --- a successor that goes away ------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_successor_stopped_while_waiting_touches_nothing(daemons: Daemons, signum: signal.Signals) -> None:
    """A successor stopped (0, having touched nothing) or killed while it waits leaves no mark: the old daemon
    keeps guarding, and its own stop then gives everything back."""
    old = daemons.holding()
    lowered, ledger = daemons.lowered(), daemons.ledger.read_bytes()
    new = daemons.successor()
    code = stop(new, signum)
    assert code == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
    if signum == signal.SIGTERM:
        assert "stopped while waiting for the node; touched nothing" in events(new)
    assert daemons.lowered() == lowered and daemons.ledger.read_bytes() == ledger
    ticks = len(old.ticks())
    old.wait_for(lambda: len(old.ticks()) >= ticks + 2, 10 * SLOW, "the old daemon ticking on")
    assert stop(old) == 0
    assert "restored every lever on exit" in events(old) and HANDED not in events(old)
    nothing_left(daemons)


@pytest.mark.parametrize("then", ["killed", "continued"])
def test_a_successor_frozen_during_the_handover(daemons: Daemons, then: str) -> None:
    """The successor frozen (SIGSTOP) when the old daemon stops: the old one hands over and waits for it. Killed
    then, it never took the node: the old daemon takes it back and gives everything back. Continued, it takes
    the node over and the old daemon exits."""
    old = daemons.holding()
    lowered = daemons.lowered()
    new = daemons.successor()
    assert new.proc is not None and old.proc is not None
    new.signal(signal.SIGSTOP)
    try:
        old.signal(signal.SIGTERM)
        note = Path(f"{daemons.ledger}.handover")
        old.wait_for(note.exists, 10 * SLOW, "the handover note")
        time.sleep(0.5)
        assert old.proc.poll() is None, "the old daemon waits for its successor"
        assert daemons.lowered() == lowered
        if then == "killed":
            new.signal(signal.SIGKILL)
        else:
            new.signal(signal.SIGCONT)
        assert old.wait(timeout=30 * SLOW) == 0
    finally:
        new.signal(signal.SIGCONT)
    if then == "killed":
        assert "the successor went away before taking the node; giving back" in events(old)
        assert "restored every lever on exit" in events(old)
        nothing_left(daemons)
    else:
        assert HANDED in events(old)
        new.wait_for(lambda: "tick" in events(new), 20 * SLOW, "the successor's first tick")
        assert ADOPTED in events(new) and daemons.lowered() == lowered
        assert stop(new) == 0
        nothing_left(daemons)


@pytest.mark.parametrize("first", ["successor", "old"])
def test_an_uninstall_during_a_rollout_gives_everything_back(daemons: Daemons, first: str) -> None:
    """Both daemons stopped at once (deleting the DaemonSet in the middle of a rollout), in either order: both
    exit 0 and nothing is left held."""
    old = daemons.holding()
    new = daemons.successor()
    pair = [new, old] if first == "successor" else [old, new]
    for daemon in pair:
        daemon.signal(signal.SIGTERM)
    assert [daemon.wait(timeout=30 * SLOW) for daemon in pair] == [0, 0]
    nothing_left(daemons)


# --- the old daemon that goes away -----------------------------------------------------------------------


@pytest.mark.parametrize("on_start", ["restore", "adopt"])
def test_the_old_daemon_killed_while_a_successor_waits_is_a_crash(daemons: Daemons, on_start: str) -> None:
    """SIGKILL leaves the ledger with no handover: the waiting successor takes the node and does as onStart says
    with it, before its first tick, as any start after a crash."""
    old = daemons.holding()
    new = daemons.successor(onStart=on_start)
    assert stop(old, signal.SIGKILL) == -signal.SIGKILL
    new.wait_for(lambda: "tick" in events(new), 20 * SLOW, "the successor's first tick")
    said = events(new)
    expected = "restored the ledger's records" if on_start == "restore" else "re-adopted the ledger's records"
    assert expected in said and said.index(expected) < said.index("tick") and ADOPTED not in said, said
    assert stop(new) == 0
    nothing_left(daemons)


def test_readyz_successor_passes_only_a_daemon_that_waits_to_take_over() -> None:
    """``/readyz?successor`` is 200 while the daemon waits for the node; otherwise it is /readyz, problems and all."""
    from prometheus_client import CollectorRegistry

    from nodeguard.surfaces.http import HttpServer

    health: dict[str, str | None] = {"guard": "no successful tick yet", "gate": None}
    waiting: list[str | None] = ["waiting for the node lock: pid 1 (nodeguard run) holds it"]
    server = HttpServer(CollectorRegistry(), lambda: health, dict, lambda: waiting[0])
    assert server.route("GET", "/readyz").status == 503
    response = server.route("GET", "/readyz?successor")
    assert response.status == 200 and b"pid 1 (nodeguard run) holds it" in response.body
    waiting[0] = None
    response = server.route("GET", "/readyz?successor")
    assert response.status == 503 and b"guard: no successful tick yet" in response.body
    health["guard"] = None
    assert server.route("GET", "/readyz?successor").status == 200
