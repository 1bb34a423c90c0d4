"""A simulated broker and cluster for the pure protocol (nodeguard.coordination.semaphore).

The broker keeps retained messages, sessions and pending wills; each connected
node has a delivery queue the test may deliver from in any order, drop from or
duplicate. Time is a number the test advances; the only timing rule the model
enforces is the one the protocol relies on: a will is published no earlier than
``WILL_DELAY`` after the last packet of the connection, and ``LEASE`` is shorter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nodeguard.coordination.semaphore import WILL_GRACE, Cluster, Effects, Gone, Ledger, Node, Saved, Status

LEASE = 10.0
WILL_DELAY = 12.0

Message = Ledger | Status | Gone


@dataclass
class SimNode:
    name: str
    node: Node | None = None  # None: the process is down
    saved: Saved | None = None
    connected: bool = False
    conn_epoch: int = 0
    last_packet: float = 0.0  # when the broker last heard from the current/last connection
    held: dict[str, set[str]] = field(default_factory=dict)
    loads: int = 0


class Violation(AssertionError):
    pass


class Sim:
    def __init__(self, members: list[str], caps: dict[str, int]) -> None:
        self.cluster = Cluster(tuple(members), caps)
        self.now = 0.0
        self.nodes = {m: SimNode(m, held={s: set() for s in caps}) for m in members}
        self.retained: dict[tuple[str, str], Message] = {}
        self.queues: dict[str, list[Message]] = {m: [] for m in members}
        self.sessions: set[str] = set()
        self.wills: dict[str, int] = {}  # node -> epoch of a will that may fire
        self.max_held: dict[str, int] = dict.fromkeys(caps, 0)
        self.admissions = 0
        self.handoffs: list[float] = []
        self.log: list[str] = []

    # --- bookkeeping --------------------------------------------------------------------

    def _apply(self, sim: SimNode, fx: Effects) -> None:
        for a in fx.admitted:
            assert a.load not in sim.held[a.sem]
            sim.held[a.sem].add(a.load)
            self.admissions += 1
        for r in fx.revoked:
            sim.held[r.sem].discard(r.load)
        self.check()

    def check(self) -> None:
        for sem, cap in self.cluster.caps.items():
            total = sum(len(s.held[sem]) for s in self.nodes.values())
            self.max_held[sem] = max(self.max_held[sem], total)
            if total > cap:
                raise Violation(f"{sem}: {total} held > cap {cap}\n" + "\n".join(self.log[-40:]))
        for s in self.nodes.values():
            if s.node is None:
                continue
            for sem in self.cluster.caps:
                assert s.held[sem] == s.node.held[sem], (s.name, sem)
                if s.node.state is not None and not s.node.fenced:
                    assert len(s.node.held[sem]) <= s.node.state.allot[sem], (s.name, sem)

    def _deliver_to(self, name: str, msg: Message) -> None:
        sim = self.nodes[name]
        node = sim.node
        assert node is not None
        if isinstance(msg, Ledger):
            fx = node.on_ledger(msg, self.now)
        elif isinstance(msg, Status):
            fx = node.on_status(msg, self.now)
        else:
            fx = node.on_gone(msg, self.now)
        self._apply(sim, fx)

    def _publish(self, sim: SimNode, kind: str, msg: Message) -> None:
        self.retained[(kind, sim.name)] = msg
        for other, q in self.queues.items():
            if self.nodes[other].connected:
                q.append(msg)
        sim.last_packet = self.now
        node = sim.node
        assert node is not None
        self._apply(sim, node.lease_renewed(self.now, node.conn, self.now))

    # --- actions ------------------------------------------------------------------------

    def advance(self, dt: float, *, stalled: str | None = None) -> None:
        """Time passes; connected nodes heartbeat (renew their lease), except one whose PUBACKs stall."""
        self.now += dt
        for sim in self.nodes.values():
            node = sim.node
            if node is None:
                continue
            if sim.connected and sim.name != stalled:
                sim.last_packet = self.now
                self._apply(sim, node.lease_renewed(self.now, node.conn, self.now))
            self._apply(sim, node.tick(self.now))

    def request(self, name: str, sem: str) -> str | None:
        sim = self.nodes[name]
        if sim.node is None:
            return None
        sim.loads += 1
        load = f"{name}-{sim.loads}"
        self._apply(sim, sim.node.request(sem, load, self.now))
        return load

    def release(self, name: str, sem: str, pick: int) -> None:
        sim = self.nodes[name]
        if sim.node is None:
            return
        loads = sorted(sim.held[sem]) or sorted(sim.node.waiting[sem])
        if not loads:
            return
        load = loads[pick % len(loads)]
        sim.held[sem].discard(load)
        self._apply(sim, sim.node.withdraw(sem, load, self.now))

    def persist(self, name: str) -> None:
        sim = self.nodes[name]
        if sim.node is not None:
            sim.saved = sim.node.snapshot()

    def flush(self, name: str) -> None:
        """What the service's I/O loop does: persist, publish ledger and status, do reads."""
        sim = self.nodes[name]
        node = sim.node
        if node is None:
            return
        sim.saved = node.snapshot()
        if not sim.connected:
            return
        if node.wants_reconnect:
            node.wants_reconnect = False
            self.disconnect(name)
            return
        if node.wants_sync:  # a barrier: what was queued for it before now arrives first
            node.wants_sync = False
            self.deliver_all(name)
            self._apply(sim, node.synced(self.now))
            sim.saved = node.snapshot()
        if node.may_publish_ledger and sim.saved is not None and (node.wants_ledger or node.ledger_stale):
            node.wants_ledger = node.ledger_stale = False
            self._publish(sim, "ledger", sim.saved.ledger(name))
        if node.wants_status:
            node.wants_status = False
            self._publish(sim, "status", node.status())
        for other in sorted(node.take_reads()):
            retained = self.retained.get(("ledger", other))
            assert retained is None or isinstance(retained, Ledger)
            self._apply(sim, node.read_done(other, retained, node.conn, self.now))

    def deliver(self, name: str, index: int, mode: str = "deliver") -> None:
        q = self.queues[name]
        if not q or self.nodes[name].node is None:
            return
        msg = q[index % len(q)]
        if mode != "duplicate":
            q.remove(msg)
        if mode != "drop":
            self._deliver_to(name, msg)

    def deliver_all(self, name: str) -> None:
        while self.queues[name] and self.nodes[name].node is not None:
            self._deliver_to(name, self.queues[name].pop(0))

    def disconnect(self, name: str) -> None:
        """The connection breaks (a cut, or the broker drops it)."""
        sim = self.nodes[name]
        if not sim.connected:
            return
        sim.connected = False
        self.queues[name].clear()
        self.wills[name] = sim.conn_epoch
        if sim.node is not None:
            self._apply(sim, sim.node.disconnected(self.now))

    def crash(self, name: str) -> None:
        sim = self.nodes[name]
        if sim.node is None:
            return
        self.disconnect(name)
        sim.node = None
        for held in sim.held.values():
            held.clear()

    def fire_will(self, name: str, *, wait: bool = False) -> bool:
        """Publish the pending will of ``name`` (``wait``: first let time pass until it may)."""
        sim = self.nodes[name]
        epoch = self.wills.get(name)
        if epoch is None or sim.connected:
            return False
        if wait and self.now < sim.last_packet + WILL_DELAY:
            self.advance(sim.last_packet + WILL_DELAY - self.now)
        if self.now < sim.last_packet + WILL_DELAY:
            return False
        del self.wills[name]
        gone = Gone(name, epoch)
        self.retained[("gone", name)] = gone
        for other, q in self.queues.items():
            if self.nodes[other].connected:
                q.append(gone)
        self.log.append(f"{self.now:.1f} will {name}@{epoch}")
        return True

    def expire_session(self, name: str) -> None:
        if name not in self.wills and not self.nodes[name].connected:
            self.sessions.discard(name)

    def restart_broker(self, *, fire_wills: bool = False) -> None:
        """The broker restarts without persistence; stopped gracefully, mosquitto first publishes every pending
        will, which the nodes still connected receive (their own included)."""
        if fire_wills:
            wills = [Gone(name, sim.conn_epoch) for name, sim in self.nodes.items() if sim.connected]
            wills += [Gone(name, epoch) for name, epoch in self.wills.items() if not self.nodes[name].connected]
            for name, sim in self.nodes.items():
                if sim.connected and sim.node is not None:
                    for gone in wills:
                        self._deliver_to(name, gone)
            for name in self.nodes:  # what the nodes do before the connections close: publish, read, barriers
                self.flush(name)
            self.log.append(f"{self.now:.1f} broker shutdown fired wills {[(g.node, g.epoch) for g in wills]}")
        for name in self.nodes:
            self.disconnect(name)
        self.retained.clear()
        self.sessions.clear()
        self.wills.clear()
        self.log.append(f"{self.now:.1f} broker restart")

    def connect(self, name: str) -> None:
        sim = self.nodes[name]
        if sim.connected:
            return
        if sim.node is None:
            sim.node = Node(name, self.cluster, sim.saved, lease_seconds=LEASE, status_ttl=1e9)
        node = sim.node
        epoch = node.begin_connect(int(self.now * 1000) + 1)
        sim.saved = node.snapshot()  # persisted before connecting
        present = name in self.sessions
        self.wills.pop(name, None)  # a takeover of the session cancels a pending will
        self.sessions.add(name)
        sim.connected, sim.conn_epoch = True, epoch
        self.queues[name] = []
        self.log.append(f"{self.now:.1f} connect {name}@{epoch} session={present}")
        self._apply(sim, node.connected(self.now, present))
        sim.last_packet = self.now
        self._apply(sim, node.lease_renewed(self.now, node.conn, self.now))  # the first heartbeat
        for (kind, _), msg in sorted(self.retained.items(), key=lambda kv: kv[0]):
            del kind
            self._deliver_to(name, msg)
        self._apply(sim, node.synced(self.now))

    def pump(self) -> None:
        """One round of every connected node publishing and every queue delivered in order."""
        for name in self.nodes:
            self.flush(name)
        for name in self.nodes:
            self.deliver_all(name)

    # --- driving to quiescence ----------------------------------------------------------------

    def settle(self, rounds: int = 30) -> None:
        """Everyone connected and alive, every message delivered in order, until nothing moves (time passes
        only for the heirs' will grace)."""
        for _ in range(rounds):
            for name in self.nodes:
                self.connect(name)
            for name in self.nodes:
                self.flush(name)
            moved = False
            for name, q in self.queues.items():
                while q:
                    moved = True
                    self._deliver_to(name, q.pop(0))
            if not moved:
                due = [s.node.next_read_at for s in self.nodes.values() if s.node is not None]
                if min(due, default=math.inf) == math.inf:
                    return
                self.advance(WILL_GRACE)
