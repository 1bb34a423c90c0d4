"""Memory throttles are seen like CPU ones: ``nodeguard plan``, the decision trace, /metrics and Events."""

from __future__ import annotations

from prometheus_client import generate_latest

from nodeguard.actuators.cgroup_writer import CgroupWriter, WriteCounters
from nodeguard.actuators.changes import Done
from nodeguard.actuators.ledger import LeverRecord
from nodeguard.actuators.levers.memory_high import MemoryHighLever
from nodeguard.config import Settings
from nodeguard.daemon import DaemonView, memory_objectives
from nodeguard.kubernetes.events import describe_change, event_kind
from nodeguard.model.levers import MEMORY_HIGH
from nodeguard.policy.holds import HeldMemory
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from nodeguard.policy.trace import plan_to_data
from nodeguard.surfaces.metrics import Metrics
from nodeguard.surfaces.render import render_plan
from tests.policy.builders import GiB, at, mem, mem_throttle, settings, snapshot


def test_plan_and_trace_show_the_memory_high_change() -> None:
    """The rendered plan and its JSON trace name memory.high with the value before and after."""
    p = plan(at(14 * GiB, mem("big", 4 * GiB)), GuardState(), settings(mem_throttle()))
    [action] = plan_to_data(p)["actions"]
    assert (action["kind"], action["lever"], action["previous"], action["original"]) == (
        "memory_throttle", "memory.high", "max", "max",
    )  # fmt: skip
    assert action["memory_high"] == p.state.held(HeldMemory)["big"].high
    text = render_plan(p)
    assert "memory_throttle" in text
    assert f"memory.high max -> {action['memory_high'] >> 20}Mi" in text
    assert plan_to_data(p)["state"]["memory"]["big"]["memory_high"] == action["memory_high"]


def test_metrics_export_the_held_memory_high_and_its_original() -> None:
    """/metrics has each memory-throttled workload's memory.high and its original (-1 for max), from the ledger."""
    record = LeverRecord(original="max", applied=str(GiB), lever=MEMORY_HIGH.name, group="kp/a",
                         cgroup_version="v2", reason="memory_total_usage", changed_at=1.0)  # fmt: skip
    lever = MemoryHighLever(CgroupWriter("/nonexistent"), "v2")
    view = DaemonView(None, snapshot(), GuardState(), {}, 0, WriteCounters(), 0, 1, 0, {}, {}, {}, {},
                      levers={lever.name: lever}, records={lever.name: {"kp/a": record}})  # fmt: skip
    text = generate_latest(Metrics(lambda: view).registry).decode()
    assert "nodeguard_memory_throttled_workloads 1.0" in text
    assert 'nodeguard_memory_high_bytes{workload="kp/a"} 1.073741824e+09' in text
    assert 'nodeguard_memory_high_original_bytes{workload="kp/a"} -1.0' in text


def test_events_name_the_memory_lever_and_its_values() -> None:
    """A memory.high change becomes a NodeguardMemoryThrottled Event whose message carries both values in MiB."""
    p = plan(at(14 * GiB, mem("big", 4 * GiB)), GuardState(), settings(mem_throttle()))
    [change] = p.changes
    lever = MemoryHighLever(CgroupWriter("/nonexistent"), "v2")
    assert change.target is not None
    done = Done(change, "max", change.target, 0, True, (lever.shown("max"), lever.shown(change.target)))
    assert event_kind(done).reason == "NodeguardMemoryThrottled"
    message = describe_change(done)
    assert "memory.high max ->" in message and "MiB" in message


def test_only_memory_objectives_make_the_daemon_read_memory_high_and_pressure() -> None:
    """Memory throttle and protected_memory_stall objectives need the workloads' memory files; CPU and evict do not."""
    cpu = {"metric": "cpu_total_usage", "action": "throttle", "threshold": 1.5, "restoreBelow": 1.0}
    evict = {"metric": "memory_total_utilization", "action": "evict", "threshold": "95%"}
    stall = {"metric": "protected_memory_stall", "action": "throttle", "threshold": "5%", "restoreBelow": "1%"}
    throttle = {"metric": "memory_total_utilization", "action": "throttle", "threshold": "90%", "restoreBelow": "80%"}

    def needs(*objectives: dict[str, object]) -> bool:
        return memory_objectives(Settings.model_validate({"guard": {"objectives": list(objectives)}}))

    assert not needs(cpu, evict)
    assert needs(cpu, stall) and needs(throttle) and needs(evict, throttle)
