"""The gate's config section, its dependency graph, its state file and the OCI hook's mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeguard.atomic_file import write_atomic
from nodeguard.config import parse_document
from nodeguard.errors import ConfigError
from nodeguard.gate import store
from nodeguard.gate.graph import find_cycle
from nodeguard.gate.oci import HookInputError, hook_action
from nodeguard.gate.readiness import TcpProbe
from nodeguard.gate.states import Load, LoadSpec, LoadState


def test_gate_config_errors_name_their_path_and_value() -> None:
    """Bad keys in the gate section are reported with their JSON path and the value given."""
    with pytest.raises(ConfigError) as caught:
        parse_document(
            {"global": {"gate": {"maxStarting": 0, "socketMode": "999", "socket": "relative.sock", "speed": 1}}}
        )
    assert sorted(caught.value.problems) == [
        "global.gate.maxStarting: Input should be greater than or equal to 1, got 0",
        'global.gate.socket: expected an absolute path, got "relative.sock"',
        'global.gate.socketMode: expected an octal mode like "0660", got "999"',
        "global.gate.speed: unknown key, got 1",
    ]


def test_min_rate_above_max_rate_is_refused() -> None:
    """minRate greater than maxRate cannot both hold, so the config is refused."""
    with pytest.raises(ConfigError) as caught:
        parse_document({"global": {"gate": {"minRate": 5, "maxRate": 1}}})
    assert caught.value.problems[0].startswith("global.gate: minRate (5.0) must not exceed maxRate (1.0)")


def test_find_cycle_names_the_whole_path() -> None:
    """The cycle a new dependency closes is returned from the new load back to itself; an acyclic one gives None."""
    edges = {"b": ["c"], "c": ["d"], "d": []}
    assert find_cycle("d", ["b"], lambda n: edges.get(n, [])) == ["d", "b", "c", "d"]
    assert find_cycle("e", ["b"], lambda n: edges.get(n, [])) is None


def _load(name: str, state: LoadState) -> Load:
    probe = TcpProbe(type="tcp", address="127.0.0.1:80")
    spec = LoadSpec(
        name=name, depends_on=("x",), readiness=probe, priority=3, start_timeout=9.0, uid=7, gid=8, semaphore="prep"
    )
    return Load(spec=spec, seq=4, state=state, reason="r", submitted_at=1.0, admitted_at=2.0, deadline=11.0)


def test_state_file_round_trips_admitted_loads_of_this_boot_only(tmp_path: Path) -> None:
    """Starting and ready loads are written and read back; pending ones are not; another boot's file restores nothing."""
    path = str(tmp_path / store.STATE_FILE)
    loads = [_load("a", LoadState.STARTING), _load("b", LoadState.READY), _load("c", LoadState.PENDING)]
    write_atomic(path, store.encode(loads, "boot-1"))
    back = store.read(path, "boot-1")
    assert [(load.name, load.state, load.spec, load.deadline) for load in back.loads] == [
        (load.name, load.state, load.spec, load.deadline) for load in loads[:2]
    ]
    assert all(load.restored for load in back.loads)
    other = store.read(path, "boot-2")
    assert other.loads == [] and other.other_boot


def test_an_unreadable_state_file_is_set_aside_not_deleted(tmp_path: Path) -> None:
    """A corrupt state file is renamed aside and reported; nothing is restored from it."""
    path = tmp_path / store.STATE_FILE
    path.write_text("{not json")
    back = store.read(str(path), "boot")
    assert back.loads == [] and back.set_aside is not None and back.problems
    assert Path(back.set_aside).read_text() == "{not json" and not path.exists()


def test_oci_hook_maps_annotations_to_a_detached_submit() -> None:
    """createRuntime state becomes a detached submit with the annotated name, dependencies and probe; poststop releases."""
    state = {
        "id": "c0ffee",
        "status": "creating",
        "annotations": {
            "nodeguard.io/after": "db, cache",
            "nodeguard.io/ready-tcp": "10.0.0.5:5432",
            "nodeguard.io/priority": "5",
            "nodeguard.io/semaphore": "prepare",
        },
    }
    action = hook_action(state)
    assert action.kind == "admit" and action.name == "oci-c0ffee"
    assert action.submit == {
        "name": "oci-c0ffee",
        "dependsOn": ["db", "cache"],
        "readiness": {"type": "tcp", "address": "10.0.0.5:5432"},
        "detach": True,
        "priority": 5,
        "semaphore": "prepare",
    }
    assert hook_action({**state, "status": "stopped"}).kind == "release"
    with pytest.raises(HookInputError, match=r"nodeguard\.io/priority"):
        hook_action({**state, "annotations": {"nodeguard.io/priority": "high"}})
    with pytest.raises(HookInputError, match="one readiness check"):
        hook_action({**state, "annotations": {"nodeguard.io/ready-tcp": "h:1", "nodeguard.io/ready-http": "http://h/"}})
