"""Churn under load against a real mosquitto: nodes join and are drained while loads flow, and the cap holds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.coordination.harness import LoadAuditor, NodeProcess
from tests.support.broker import Broker
from tests.support.cluster import WireAuditor, coordination_config, stop_together
from tests.support.poll import wait_until

CAP = 4
SEM = "prepare"
FIRST = [f"n{i}" for i in range(10)]
SEEDS = FIRST[:3]
JOINERS = ["j0", "j1", "j2"]
DRAINED = ["n0", "n4", "n8"]  # n0 is the first seed: it holds the mint, which its drain hands to its heir


class Flow:
    """Every live node asks for two short loads every half second, from a thread, until stopped."""

    def __init__(self, nodes: dict[str, NodeProcess]) -> None:
        self.nodes = nodes
        self.live: set[str] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(0.5):
            with self.lock:
                live = sorted(self.live)
            for name in live:
                self.nodes[name].burst(2, 0.1, SEM)

    def add(self, name: str) -> None:
        with self.lock:
            self.live.add(name)

    def remove(self, name: str) -> None:
        with self.lock:
            self.live.discard(name)


def test_nodes_join_and_drain_under_load_and_the_cap_holds(broker: Broker, tmp_path: Path) -> None:
    """Ten nodes (three seeds) run loads against cap 4 while three nodes join and three are drained, the bank among
    them: the sum held never exceeds the cap (loads' own reports and the ledgers on the wire), every load on a node
    that stays is admitted, the drained hand their allotment on before they leave, and afterwards the cap is reached
    again with every slot accounted for."""
    wire = WireAuditor(broker.port, {SEM: CAP})
    nodes: dict[str, NodeProcess] = {}

    def start(name: str) -> NodeProcess:
        config = coordination_config(broker.port, SEEDS, {SEM: CAP}, tmp_path / "state" / name)
        nodes[name] = NodeProcess(name, config, tmp_path).start()
        return nodes[name]

    def logs() -> str:
        return "\n".join(n.log_tail(15) for n in nodes.values())

    def admitting(name: str) -> None:
        nodes[name].wait_admitting(detail=logs)

    flow = Flow(nodes)
    try:
        for name in FIRST:
            start(name)
        for name in FIRST:
            admitting(name)
            flow.add(name)
        flow.thread.start()
        churn_started = time.monotonic()
        progress = LoadAuditor(list(nodes.values()))

        def flowing(more: int) -> None:
            """Wait until ``more`` loads have finished from now on: the churn happens while loads flow."""
            target = len(progress.done(SEM)) + more
            wait_until(lambda: len(progress.done(SEM)) >= target, 20, f"{more} more loads done", detail=logs)

        flowing(15)
        for joiner, drained in zip(JOINERS, DRAINED, strict=True):
            progress.nodes = list(nodes.values())
            start(joiner)
            flow.remove(drained)
            nodes[drained].terminate()  # SIGTERM: its loads end, it drains and leaves
            admitting(joiner)
            flow.add(joiner)
            wait_until(lambda d=drained: nodes[d].proc.poll() is not None, 15, f"{drained} leaving", detail=logs)  # type: ignore[union-attr]
            flowing(15)
        flow.stopped.set()
        flow.thread.join(5)
        churn_seconds = time.monotonic() - churn_started
        live = [n for n in nodes if n not in DRAINED]
        loads = LoadAuditor(list(nodes.values()))

        def stayed_done() -> bool:
            requested = {e["load"] for n in live for e in nodes[n].snapshot() if e["ev"] == "request"}
            return requested <= loads.done(SEM)

        wait_until(stayed_done, 30, "every load of the nodes that stayed done", detail=logs)
        assert loads.max_held(SEM) <= CAP, logs()
        assert not wire.violations, wire.violations[0]
        assert not wire.malformed, wire.malformed[:3]
        assert len(loads.done(SEM)) >= 60  # loads flowed all through the churn
        for name in DRAINED:
            text = nodes[name].stderr_path.read_text()
            assert '"event": "drained"' in text and '"state": "left"' in text, nodes[name].log_tail(30)
            assert nodes[name].proc.returncode == 0  # type: ignore[union-attr]

        # Every slot is back in some live node's allotment, and the members are seen as they are.
        def accounted() -> bool:
            sems = [nodes[n].status()["semaphores"][SEM] for n in live]
            return sum(s["allotment"] for s in sems) == CAP and not any(s["grantsOut"] for s in sems)

        wait_until(accounted, 15, "all slots in live allotments", detail=logs)

        def census_right() -> bool:
            members = nodes[JOINERS[-1]].status()["members"]
            joined = {n for n, m in members.items() if m["state"] == "joined"}
            return joined == set(live) and all(members.get(n, {"state": "left"})["state"] == "left" for n in DRAINED)

        wait_until(census_right, 10, "the census: joiners joined, drained left", detail=lambda: str(
            nodes[JOINERS[-1]].status()["members"]))  # fmt: skip

        # The cap is reached again: long loads on every live node fill it.
        after = time.monotonic()
        for name in live:
            nodes[name].burst(1, 1.5, SEM)
        wait_until(lambda: loads.max_held(SEM, since=after) == CAP, 15, "the cap reached again", detail=logs)
        wait_until(stayed_done, 30, "the last loads done", detail=logs)
        assert loads.max_held(SEM) <= CAP and not wire.violations
        assert churn_seconds < 45
    finally:
        flow.stopped.set()
        stop_together(nodes.values())
        wire.close()
