"""A simulated broker and cluster for the pure protocol (nodeguard.coordination.semaphore).

The broker keeps retained messages (ledgers, membership records, the census, wills),
sessions and pending wills; each connected node has a delivery queue the test may
deliver from in any order, drop from or duplicate. Subscriptions are the service's:
every node its inbox, the wills and the bank record (its own retained ledger is read
when it connects; the census is only retained); the bank also every other node's ledger and membership record (MQTT v5
No Local). Time is a number the test advances; the only timing
rule the model enforces is the one the protocol relies on: a will is published no
earlier than ``WILL_DELAY`` after the last packet of the connection, and ``LEASE`` is
shorter. Nodes join (``connect`` of a new name), drain (``drain`` then ``depart``),
come back with their old state, and have their caps changed (``set_caps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nodeguard.coordination.records import Census, Copy, Gone, Member, SlotLedger, Want
from nodeguard.coordination.semaphore import WILL_GRACE, Cluster, Effects, ProtocolNode, Saved

LEASE = 10.0
WILL_DELAY = 12.0

Message = tuple[str, object]  # (kind, payload): ledger, copy, want, member, bank (record), gone


@dataclass
class SimNode:
    name: str
    cluster: Cluster
    node: ProtocolNode | None = None  # None: the process is down
    saved: Saved | None = None
    connected: bool = False
    bank_subscribed: bool = False
    conn_epoch: int = 0
    last_packet: float = 0.0  # when the broker last heard from the current/last connection
    held: dict[str, set[str]] = field(default_factory=dict)
    loads: int = 0


class Violation(AssertionError):
    pass


class Sim:
    def __init__(self, members: list[str], caps: dict[str, int], *, seeds: list[str] | None = None) -> None:
        self.seeds = tuple(seeds or members)
        self.caps = dict(caps)
        self.now = 0.0
        self.nodes: dict[str, SimNode] = {}
        self.retained: dict[tuple[str, str], object] = {}
        self.queues: dict[str, list[Message]] = {}
        self.sessions: set[str] = set()
        self.wills: dict[str, int] = {}  # node -> epoch of a will that may fire
        self.max_held: dict[str, int] = dict.fromkeys(caps, 0)
        self.bound: dict[str, int] = dict(caps)  # the largest cap ever configured
        self.admissions = 0
        self.log: list[str] = []
        self.departed: set[str] = set()  # drained and stopped: not brought back by settle()
        self.next_census = 0.0
        for name in members:
            self.add(name)

    def add(self, name: str) -> SimNode:
        """A node the cluster has not seen: it joins when it first connects."""
        sim = self.nodes.get(name)
        if sim is None:
            sim = self.nodes[name] = SimNode(name, Cluster(self.seeds, self.caps), held={s: set() for s in self.caps})
            self.queues[name] = []
        return sim

    # --- bookkeeping --------------------------------------------------------------------

    def _apply(self, sim: SimNode, fx: Effects) -> None:
        for r in fx.revoked:
            sim.held.setdefault(r.sem, set()).discard(r.load)
        for a in fx.admitted:
            assert a.load not in sim.held.setdefault(a.sem, set())
            sim.held[a.sem].add(a.load)
            self.admissions += 1
            self._check_admission(a.sem)
        self.check()

    def total(self, sem: str) -> int:
        return sum(len(s.held.get(sem, ())) for s in self.nodes.values())

    def _check_admission(self, sem: str) -> None:
        """I7: once every live node is configured with the same cap and has heard the bank's applied cap, no
        admission takes the sum above the configured cap."""
        live = [s for s in self.nodes.values() if s.node is not None]
        caps = {s.cluster.caps.get(sem, 0) for s in live}
        banks = [s.node for s in live if s.node is not None and s.node.is_bank]
        if not banks:
            return  # the mint in flight or in an estate: nobody knows the applied cap for sure
        applied = banks[0].applied_caps().get(sem, 0)
        heard = all(s.node is not None and s.node.applied_caps().get(sem, 0) == applied for s in live)
        if len(caps) == 1 and heard:
            (cap,) = caps
            total = self.total(sem)
            if total > cap:
                raise Violation(f"{sem}: an admission took the sum to {total} > cap {cap}\n" + self.trail())

    def check(self) -> None:
        for sem in self.caps:
            total = self.total(sem)
            self.max_held[sem] = max(self.max_held.get(sem, 0), total)
            if total > self.bound.get(sem, 0):
                raise Violation(f"{sem}: {total} held > cap {self.bound.get(sem)}\n" + self.trail())
        for s in self.nodes.values():
            if s.node is None:
                continue
            for sem in s.node.held:
                assert s.held.get(sem, set()) == s.node.held[sem], (s.name, sem)
                if s.node.state is not None and not s.node.fenced:
                    assert len(s.node.held[sem]) <= s.node.state.allot.get(sem, 0), (s.name, sem)

    def trail(self) -> str:
        return "\n".join(self.log[-40:])

    # --- the broker ---------------------------------------------------------------------

    def _subscribers(self, kind: str, about: str) -> list[str]:
        """Connected nodes that receive a message of ``kind`` about node ``about`` (or to it: inbox)."""
        out = []
        for name, sim in self.nodes.items():
            if not sim.connected:
                continue
            if (
                kind in ("gone", "bank")
                or (kind in ("copy", "want") and name == about)
                or (kind in ("ledger", "member") and sim.bank_subscribed and name != about)  # No Local
            ):
                out.append(name)
        return out

    def _route(self, kind: str, about: str, payload: object) -> None:
        for name in self._subscribers(kind, about):
            self.queues[name].append((kind, payload))

    def _deliver_to(self, name: str, msg: Message) -> None:
        sim = self.nodes[name]
        node = sim.node
        assert node is not None
        kind, payload = msg
        if kind == "ledger":
            assert isinstance(payload, SlotLedger)
            fx = node.on_ledger(payload, self.now)
        elif kind == "copy":
            assert isinstance(payload, Copy)
            fx = node.on_copy(payload, payload.ledger.node, self.now)
        elif kind == "want":
            assert isinstance(payload, Want)
            fx = node.on_want(payload, self.now)
        elif kind == "member":
            assert isinstance(payload, Member)
            fx = node.on_member(payload, self.now)
        elif kind == "bank":
            assert isinstance(payload, Census)
            fx = node.on_census(payload, self.now)
        else:
            assert isinstance(payload, Gone)
            fx = node.on_gone(payload, self.now)
        self._apply(sim, fx)

    def _sent(self, sim: SimNode) -> None:
        """A PUBACK: the broker heard from the node, its lease is renewed."""
        sim.last_packet = self.now
        node = sim.node
        assert node is not None
        self._apply(sim, node.lease_renewed(self.now, node.conn, self.now))

    def _publish(self, sim: SimNode, kind: str, about: str, payload: object, *, retain: bool) -> None:
        if retain:
            self.retained[(kind, about)] = payload
        self._route(kind, about, payload)
        self._sent(sim)

    def _resubscribe(self, sim: SimNode) -> None:
        """The bank subscribes to every ledger and membership record (and gets the retained ones)."""
        node = sim.node
        assert node is not None
        want = node.is_bank and node.phase.value == "online"
        if want == sim.bank_subscribed:
            return
        sim.bank_subscribed = want
        if want:
            for (kind, _), msg in sorted(self.retained.items(), key=lambda kv: kv[0]):
                if kind in ("ledger", "member"):
                    self.queues[sim.name].append((kind, msg))

    # --- actions ------------------------------------------------------------------------

    def advance(self, dt: float, *, stalled: str | None = None) -> None:
        """Time passes; connected nodes heartbeat (renew their lease), except one whose PUBACKs stall."""
        self.now += dt
        for sim in self.nodes.values():
            node = sim.node
            if node is None:
                continue
            if sim.connected and sim.name != stalled:
                self._sent(sim)
            self._apply(sim, node.tick(self.now))

    def request(self, name: str, sem: str) -> str | None:
        sim = self.nodes[name]
        if sim.node is None or sem not in sim.node.waiting:
            return None
        sim.loads += 1
        load = f"{name}-{sim.loads}"
        self._apply(sim, sim.node.request(sem, load, self.now))
        return load

    def release(self, name: str, sem: str, pick: int) -> None:
        sim = self.nodes[name]
        if sim.node is None:
            return
        loads = sorted(sim.held.get(sem, ())) or sorted(sim.node.waiting.get(sem, ()))
        if not loads:
            return
        load = loads[pick % len(loads)]
        sim.held.setdefault(sem, set()).discard(load)
        self._apply(sim, sim.node.withdraw(sem, load, self.now))

    def persist(self, name: str) -> None:
        sim = self.nodes[name]
        if sim.node is not None:
            sim.saved = sim.node.snapshot()

    def flush(self, name: str) -> None:
        """What the service's I/O loop does: persist, publish ledger, copies, demand, membership, census, reads."""
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
        online = node.phase.value == "online"
        saved = sim.saved
        if node.may_publish_ledger and saved is not None:
            ledger = saved.ledger(name)
            if online and (node.wants_ledger or node.ledger_stale):
                node.wants_ledger = node.ledger_stale = False
                self._publish(sim, "ledger", name, ledger, retain=True)
            hint = node.queue_hint() if node.is_bank else {}
            for peer, ask in sorted(node.take_copies().items()):
                if peer != name:
                    forward = node.forward_hint(peer) if node.is_bank else {}
                    self._publish(sim, "copy", peer, Copy(ledger, ask, hint, forward), retain=False)
        want = node.take_want(self.now)
        if want is not None:
            self._publish(sim, "want", want[0], want[1], retain=False)
        if node.wants_member and (online or node.leaving):
            self._publish(sim, "member", name, node.member(), retain=True)
        if online and node.is_bank and node.wants_census:
            record = node.take_census(full=False)
            if record is not None:
                self._publish(sim, "bank", "", record, retain=True)
        if online and node.is_bank and node.census_stale and self.now >= self.next_census:
            self.next_census = self.now + 1.0  # the service's census period; read on demand, nobody subscribes
            census = node.take_census(full=True)
            if census is not None:
                self.retained[("census", "")] = census
        if node.wants_status:
            node.wants_status = False
            self._sent(sim)
        self._resubscribe(sim)
        for other in sorted(node.take_reads()):
            retained = self.retained.get(("ledger", other))
            assert retained is None or isinstance(retained, SlotLedger)
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
        sim.connected = sim.bank_subscribed = False
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

    def drain(self, name: str) -> None:
        """SIGTERM: the node hands its free slots on (the service then waits for the acknowledgements)."""
        sim = self.nodes[name]
        if sim.node is None or sim.node.leaving:
            return
        self.log.append(f"{self.now:.1f} drain {name}")
        self._apply(sim, sim.node.drain(self.now))
        self.flush(name)

    def depart(self, name: str, *, force: bool = False) -> None:
        """The drained process stops (``force``: its drain timed out): its held slots are revoked, its membership
        says so, it leaves with the will."""
        sim = self.nodes[name]
        node = sim.node
        if node is None or not node.leaving or not (node.drained or force):
            return
        self.log.append(f"{self.now:.1f} depart {name} drained={node.drained}")
        if sim.connected:
            self._publish(sim, "member", name, node.member(), retain=True)
        self._apply(sim, node.stop(self.now))
        sim.saved = node.snapshot()
        self.crash(name)
        self.departed.add(name)

    def set_caps(self, name: str, caps: dict[str, int]) -> None:
        """A config reload on one node."""
        sim = self.nodes[name]
        sim.cluster = Cluster(self.seeds, caps)
        for sem, cap in caps.items():
            self.bound[sem] = max(self.bound.get(sem, 0), cap)
            self.max_held.setdefault(sem, 0)
        self.log.append(f"{self.now:.1f} caps {name} {caps}")
        if sim.node is not None:
            self._apply(sim, sim.node.reconfigure(sim.cluster, self.now))

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
        self._route("gone", name, gone)
        self.log.append(f"{self.now:.1f} will {name}@{epoch}")
        return True

    def expire_session(self, name: str) -> None:
        if name not in self.wills and not self.nodes[name].connected:
            self.sessions.discard(name)

    def restart_broker(self, *, fire_wills: bool = False, persistence: bool = False) -> None:
        """The broker restarts. Stopped gracefully, mosquitto first publishes every pending will, which the nodes
        still connected receive (their own included). Without persistence it forgets retained messages, sessions
        and pending wills; with it, it keeps them (the will delays run on)."""
        if fire_wills:
            wills = [Gone(name, sim.conn_epoch) for name, sim in self.nodes.items() if sim.connected]
            wills += [Gone(name, epoch) for name, epoch in self.wills.items() if not self.nodes[name].connected]
            for name, sim in self.nodes.items():
                if sim.connected and sim.node is not None:
                    for gone in wills:
                        self._deliver_to(name, ("gone", gone))
            for name in self.nodes:  # what the nodes do before the connections close: publish, read, barriers
                self.flush(name)
            for gone in wills:
                self.retained[("gone", gone.node)] = gone
                self.wills.pop(gone.node, None)
            self.log.append(f"{self.now:.1f} broker shutdown fired wills {[(g.node, g.epoch) for g in wills]}")
        for name in self.nodes:
            self.disconnect(name)
        if not persistence:
            self.retained.clear()
            self.sessions.clear()
            self.wills.clear()
        self.log.append(f"{self.now:.1f} broker restart persistence={persistence}")

    def connect(self, name: str) -> None:
        sim = self.add(name)
        if sim.connected:
            return
        self.departed.discard(name)
        if sim.node is None:
            sim.node = ProtocolNode(name, sim.cluster, sim.saved, lease_seconds=LEASE)
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
        self._sent(sim)  # the first heartbeat
        for (kind, about), msg in sorted(self.retained.items(), key=lambda kv: kv[0]):
            if kind in ("gone", "bank") or (kind == "ledger" and about == name):
                self._deliver_to(name, (kind, msg))
        self._apply(sim, node.synced(self.now))

    def pump(self) -> None:
        """One round of every connected node publishing and every queue delivered in order."""
        for name in list(self.nodes):
            self.flush(name)
        for name in list(self.nodes):
            self.deliver_all(name)

    # --- driving to quiescence ----------------------------------------------------------------

    def settle(self, rounds: int = 60, *, connect: bool = True) -> None:
        """Everyone connected and alive, every message delivered in order, until nothing moves (time passes
        for the heirs' will grace and the retries)."""
        idle = 0
        for _ in range(rounds):
            if connect:
                for name in self.nodes:
                    if name not in self.departed:
                        self.connect(name)
            for name in list(self.nodes):
                self.flush(name)
            moved = False
            for name, q in self.queues.items():
                while q and self.nodes[name].node is not None:
                    moved = True
                    self._deliver_to(name, q.pop(0))
            if moved:
                idle = 0
                continue
            idle += 1
            due = [s.node.next_read_at for s in self.nodes.values() if s.node is not None]
            if min(due, default=math.inf) < math.inf:
                self.advance(WILL_GRACE)
            elif idle <= 3:
                self.advance(1.0)  # retries, pending acknowledgements
            else:
                return
