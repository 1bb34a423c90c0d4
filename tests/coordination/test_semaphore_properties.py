"""Property tests of the protocol state machine: random interleavings, drops, duplicates, crashes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.coordination.sim import LEASE, WILL_DELAY, Sim

MEMBERS = ["a", "b", "c", "d"]
SEMS = {"prepare": 3, "backup": 1}

WEIGHTS = {
    "request": 8,
    "release": 3,
    "pump": 6,
    "deliver": 10,
    "deliver_all": 3,
    "drop": 1,
    "duplicate": 2,
    "flush": 8,
    "persist": 1,
    "tick": 2,
    "advance": 1,
    "stall": 1,
    "disconnect": 2,
    "connect": 2,
    "crash": 1,
    "will": 2,
    "expire": 1,
    "broker": 1,
}
ACTIONS = [kind for kind, weight in WEIGHTS.items() for _ in range(weight)]


def decode(data: bytes) -> list[tuple[str, int, int]]:
    """Three bytes an action (kind, node, argument): fast to generate, and shrinks well."""
    return [
        (ACTIONS[data[i] % len(ACTIONS)], data[i + 1] % len(MEMBERS), data[i + 2]) for i in range(0, len(data) - 2, 3)
    ]


def run(sim: Sim, steps: list[tuple[str, int, int]], *, broker_restarts: bool = True) -> None:
    sems = sorted(SEMS)
    for kind, who, arg in steps:
        name = MEMBERS[who]
        sem = sems[arg % len(sems)]
        if kind == "request":
            sim.request(name, sem)
        elif kind == "release":
            sim.release(name, sem, arg)
        elif kind in ("deliver", "drop", "duplicate"):
            sim.deliver(name, arg, kind)
        elif kind == "pump":
            sim.pump()
        elif kind == "deliver_all":
            sim.deliver_all(name)
        elif kind == "flush":
            sim.flush(name)
        elif kind == "persist":
            sim.persist(name)
        elif kind == "tick":
            sim.advance(0.5)
        elif kind in ("advance", "stall"):
            sim.advance([LEASE / 3, LEASE + 0.1, WILL_DELAY + 0.1][arg % 3], stalled=name if kind == "stall" else None)
        elif kind == "disconnect":
            sim.disconnect(name)
        elif kind == "connect":
            sim.connect(name)
        elif kind == "crash":
            sim.crash(name)
        elif kind == "will":
            sim.fire_will(name, wait=arg % 2 == 0)
        elif kind == "expire":
            sim.expire_session(name)
        elif kind == "broker" and broker_restarts and arg % 3 != 2:
            sim.restart_broker(fire_wills=arg % 3 == 1)


def boot() -> Sim:
    sim = Sim(MEMBERS, SEMS)
    sim.settle()
    return sim


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=300, max_size=600))
def test_sum_held_never_exceeds_cap(data: bytes) -> None:
    """Under any interleaving of loads, deliveries, drops, duplicates, cuts, crashes, wills and broker restarts (crashed, or stopped and firing every will), the cluster never holds more than the cap."""
    sim = boot()
    run(sim, decode(data))  # Sim.check() raises on the first step with more held than the cap


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=120, max_size=360))
def test_slots_come_back_once_everyone_is_back(data: bytes) -> None:
    """After any faults without a broker restart, once every node is back and messages flow, waiting loads are admitted up to the full cap."""
    sim = boot()
    run(sim, decode(data), broker_restarts=False)
    for name in MEMBERS:  # let every pending will fire, then everyone comes back
        sim.disconnect(name)
    sim.advance(WILL_DELAY + 1)
    for name in MEMBERS:
        sim.fire_will(name)
    sim.settle()
    for name in MEMBERS:
        for sem, cap in SEMS.items():
            while sim.nodes[name].held[sem]:
                sim.release(name, sem, 0)
            for _ in range(cap + 1):
                sim.request(name, sem)
    sim.settle()
    for sem, cap in SEMS.items():
        held = sum(len(n.held[sem]) for n in sim.nodes.values())
        assert held == cap, (sem, held, "\n".join(sim.log[-30:]))
