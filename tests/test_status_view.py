"""The terminal view of `nodeguard status` renders what the daemon's /status reports."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from nodeguard.surfaces.status_view import render


def text(status: dict[str, Any]) -> str:
    console = Console(width=120, record=True, color_system=None)
    console.print(render(status))
    return console.export_text()


def test_semaphores_show_a_lost_broker_and_why_the_node_does_not_admit() -> None:
    """A node that lost the broker past its lease says so above its semaphores, with cap, allotment, held, waiting."""
    status = {
        "version": "0",
        "coordination": {
            "enabled": True,
            "connected": False,
            "outageSeconds": 42.4,
            "admitting": False,
            "fencedReason": "lease",
            "semaphores": {"prepare": {"cap": 8, "allotment": 3, "held": 0, "waiting": 5, "admitted": 17}},
        },
    }
    shown = text(status)
    assert "cluster semaphores (broker lost 42 s ago, not admitting: lease)" in shown
    row = next(line for line in shown.splitlines() if "prepare" in line)
    assert row.replace("│", " ").split() == ["prepare", "8", "3", "0", "5", "17"], row


def test_no_semaphore_table_without_coordination() -> None:
    """A daemon without coordination shows no semaphore table."""
    assert "cluster semaphores" not in text({"version": "0", "coordination": {"enabled": False}})


def test_members_show_their_state_heir_and_allotment() -> None:
    """The members table lists joined, leaving, left and gone members with their heir and allotment, marks the bank
    and this node."""
    status = {
        "version": "0",
        "coordination": {
            "enabled": True,
            "connected": True,
            "admitting": True,
            "node": "b",
            "bank": "a",
            "semaphores": {"prepare": {"cap": 4, "allotment": 1, "held": 1, "waiting": 0, "admitted": 3}},
            "members": {
                "a": {"state": "joined", "heir": "b", "allotment": {"prepare": 2}, "bank": True},
                "b": {"state": "joined", "heir": "c", "allotment": {"prepare": 1}},
                "c": {"state": "leaving", "heir": "a", "allotment": {"prepare": 1}},
                "d": {"state": "gone", "heir": "a", "allotment": {}},
            },
        },
    }
    shown = text(status)
    assert "cluster members (4; bank a)" in shown
    rows = {line.replace("│", " ").split()[0]: line.replace("│", " ").split() for line in shown.splitlines()
            if line.replace("│", " ").split()[:1] in (["a"], ["b"], ["c"], ["d"])}  # fmt: skip
    assert rows["a"] == ["a", "(bank)", "joined", "b", "2"]
    assert rows["b"] == ["b", "*", "joined", "c", "1"]
    assert rows["c"] == ["c", "leaving", "a", "1"]
    assert rows["d"] == ["d", "gone", "a", "0"]
