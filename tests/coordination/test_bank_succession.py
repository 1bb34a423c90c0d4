"""A bank killed while its heir is down, or together with it, against a real mosquitto: the next member of the bank's
succession takes over the bank's slots and the mint, and the heir and the bank, back, take nothing twice (I16)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.coordination.harness import LoadAuditor, start_nodes
from tests.support.broker import Broker
from tests.support.cluster import TIMINGS, WireAuditor, stop_together
from tests.support.poll import wait_until

CAP = 3
SEM = "prepare"
NAMES = ["s0", "s1", "s2", "s3", "s4"]
WILL = float(TIMINGS["willDelaySeconds"])
LEASE = float(TIMINGS["leaseSeconds"])


@pytest.mark.parametrize("together", [False, True])
def test_the_next_in_the_banks_succession_takes_over_when_bank_and_heir_are_down(
    broker: Broker, tmp_path: Path, together: bool
) -> None:
    """The bank holds every slot; its heir is killed (its will out first, or at the same moment as the bank's kill),
    then the bank: with neither back, loads waiting elsewhere start within the bound of I16 (the will delay and one
    lease after the bank's kill), the cap holds on the loads' own records and on the wire, and once both are back the
    cap is reached again exactly, with one bank."""
    wire = WireAuditor(broker.port, {SEM: CAP})
    nodes = start_nodes(broker.port, NAMES, ["s0"], {SEM: CAP}, tmp_path)

    def logs() -> str:
        return "\n".join(n.log_tail(20) for n in nodes.values())

    try:
        for node in nodes.values():
            node.wait_admitting(detail=logs)
        bank = nodes["s0"]  # the only seed: the mint and every slot at genesis
        # The heir is the first member joined after the bank when it chose (kept while it stays joined), then the next.
        wait_until(lambda: len(bank.status()["succession"]) == 3, 20, "the bank's succession", detail=logs)
        heir_name, next_name = bank.status()["succession"][:2]
        bank.burst(CAP, 60.0, SEM)
        wait_until(lambda: bank.count("hold") == CAP, 10, "the bank holding every slot", detail=logs)
        heir = nodes[heir_name]
        heir.kill()
        if not together:
            wait_until(
                lambda: any(w.startswith(f"{heir_name}@") for w in wire.wills), WILL + 5, "the heir's will", detail=logs
            )
        bank.kill()
        killed = time.monotonic()
        live = [node for name, node in nodes.items() if name not in ("s0", heir_name)]
        for node in live:
            node.burst(2, 0.3, SEM)
        loads = LoadAuditor(live)
        wait_until(lambda: len(loads.done(SEM)) == 6, WILL + LEASE + 20, "the live nodes' loads done", detail=logs)
        first = min(start for start, _, _ in loads.intervals(SEM))
        assert first - killed <= WILL + LEASE, (first - killed, logs())
        assert nodes[next_name].status()["bank"] == next_name  # the next in the succession holds the mint
        assert LoadAuditor([bank, *live]).max_held(SEM) <= CAP
        assert not wire.violations and not wire.malformed, (wire.violations[:1], wire.malformed[:1])

        heir.start()
        bank.start()
        for node in (heir, bank):
            wait_until(lambda node=node: node.count("started") >= 2, 10, f"{node.name} restarting", detail=logs)
            wait_until(lambda node=node: node.status()["admitting"], 20, f"{node.name} admitting", detail=logs)
        everyone = list(nodes.values())

        def accounted() -> bool:
            sems = [n.status()["semaphores"][SEM] for n in everyone]
            return sum(s["allotment"] for s in sems) == CAP and not any(s["grantsOut"] for s in sems)

        wait_until(accounted, 15, "every slot in one live allotment", detail=logs)
        assert {n.status()["bank"] for n in everyone} == {next_name}
        after = time.monotonic()
        for node in everyone:
            node.burst(2, 0.6, SEM)
        audit = LoadAuditor(everyone)
        wait_until(lambda: len(audit.done(SEM)) == 6 + 10, 30, "every load done", detail=logs)
        assert audit.max_held(SEM) <= CAP and audit.max_held(SEM, since=after) == CAP
        assert not wire.violations and not wire.malformed, (wire.violations[:1], wire.malformed[:1])
        assert wire.max_total[SEM] == CAP
    finally:
        stop_together(nodes.values())
        wire.close()
