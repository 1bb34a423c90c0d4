"""Payload codecs, the config section and the on-disk state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from nodeguard.config_base import format_errors
from nodeguard.coordination.records import (
    Census,
    Copy,
    Gone,
    Grant,
    Lost,
    Member,
    MemberState,
    MemberView,
    NodeStatus,
    SemStatus,
    SlotLedger,
    Want,
)
from nodeguard.coordination.semaphore import Cluster
from nodeguard.coordination.settings import CoordinationSettings
from nodeguard.coordination.store import StateStore
from nodeguard.coordination.topics import (
    Malformed,
    Topics,
    UnknownVersion,
    decode_census,
    decode_gone,
    decode_inbox,
    decode_ledger,
    decode_member,
    decode_status,
    encode_census,
    encode_copy,
    encode_gone,
    encode_ledger,
    encode_member,
    encode_status,
    encode_want,
)

LEDGER = SlotLedger(
    node="n1",
    seq=12,
    epoch=99,
    heir="n2",
    allot={"prepare": 2},
    grants=(
        Grant(id=5, sem="prepare", to="n2", epoch=7, n=1, seq=11),
        Grant(id=6, sem="", to="n3", epoch=8, n=0, seq=12, mint={"prepare": 8}),
    ),
    applied={"n0": frozenset({3, 4})},
    adopted={"n0": 9},
    lost=(Lost(seq=4, allot={"prepare": 1}, heir="n0", mint={"prepare": 8}),),
    leaving=True,
)


def test_ledger_status_and_will_round_trip() -> None:
    """What a node publishes decodes to exactly what it meant."""
    assert decode_ledger(encode_ledger(LEDGER), "n1") == LEDGER
    status = NodeStatus("n1", 99, 3, True, "online", {"prepare": SemStatus(2, 1, 4, 17)}, {"n0": 9}, "0.1.0", 1234)
    assert decode_status(encode_status(status), "n1") == status
    assert decode_gone(encode_gone(Gone("n1", 99)), "n1") == Gone("n1", 99)
    copy = Copy(LEDGER, ask=True, queue={"prepare": 3})
    assert decode_inbox(encode_copy(copy)) == copy
    want = Want("n4", 17, {"prepare": 2})
    assert decode_inbox(encode_want(want)) == want
    member = Member("n1", 99, MemberState.LEAVING, "n2")
    assert decode_member(encode_member(member), "n1") == member
    census = Census(
        "n1", 99, {"prepare": 8}, {"prepare": 6}, {"n2": MemberView(MemberState.GONE, "n3", {"prepare": 1}, 7)}, 4
    )
    assert decode_census(encode_census(census)) == census


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xfe",
        b"[1, 2]",
        b'{"v": 1, "kind": "ledger", "node": "n1"}',
        b'{"v": 1, "kind": "status", "node": "n1", "seq": 1}',
        json.dumps({**json.loads(encode_ledger(LEDGER)), "seq": -1}).encode(),
        json.dumps({**json.loads(encode_ledger(LEDGER)), "seq": True}).encode(),
        json.dumps({**json.loads(encode_ledger(LEDGER)), "node": "n2"}).encode(),
        json.dumps({**json.loads(encode_ledger(LEDGER)), "grants": [{"id": 1}]}).encode(),
        json.dumps({**json.loads(encode_ledger(LEDGER)), "allot": {"a/b": 1}}).encode(),
        b"[" * 100_000,
    ],
)
def test_malformed_payloads_raise_malformed_only(payload: bytes) -> None:
    """Broken, truncated, mistyped or impersonating payloads are reported as Malformed, never as a crash."""
    with pytest.raises(Malformed):
        decode_ledger(payload, "n1")


@pytest.mark.parametrize(
    "payload",
    [
        b'{"v": 2, "kind": "copy", "node": "n1", "ledger": {"node": "n2"}}',  # a copy of someone else's ledger
        b'{"v": 2, "kind": "want", "node": "n1", "epoch": 1, "sems": {"p": -1}}',
        b'{"v": 2, "kind": "status", "node": "n1"}',
        b'{"v": 2, "kind": "want", "node": "a/b", "epoch": 1, "sems": {}}',
    ],
)
def test_malformed_inbox_messages_raise_malformed_only(payload: bytes) -> None:
    """Copies of another node's ledger, negative demands, foreign kinds and bad names in an inbox are Malformed."""
    with pytest.raises(Malformed):
        decode_inbox(payload)


def test_unknown_version_is_its_own_error() -> None:
    """A payload of another protocol version is told apart from a malformed one."""
    with pytest.raises(UnknownVersion):
        decode_ledger(json.dumps({**json.loads(encode_ledger(LEDGER)), "v": 3}).encode(), "n1")


def test_topics_parse_only_this_clusters_levels() -> None:
    """Topics of another cluster, unknown kinds and wildcard-like names are not ours."""
    topics = Topics("prod")
    assert topics.parse(topics.ledger("n1")) == ("ledger", "n1")
    assert topics.parse("nodeguard/dev/ledger/n1") is None
    assert topics.parse("nodeguard/prod/other/n1") is None
    assert topics.parse("nodeguard/prod/ledger/n1/x") is None
    assert topics.parse(topics.census) == ("census", "")
    assert topics.parse(topics.inbox("n1")) == ("inbox", "n1")


def _errors(data: dict[str, object]) -> list[str]:
    with pytest.raises(ValidationError) as info:
        CoordinationSettings.model_validate(data)
    return format_errors(info.value)


def test_lease_must_end_before_the_will_can_fire() -> None:
    """A lease that could outlive the will delay is rejected, naming leaseSeconds."""
    errors = _errors({"willDelaySeconds": 10, "leaseSeconds": 9.5})
    assert len(errors) == 1 and errors[0].startswith("leaseSeconds: must end before the will can fire")


def test_settings_errors_name_their_keys() -> None:
    """Bad names, half a client certificate and two password sources are each reported at their key."""
    errors = _errors(
        {
            "cluster": "a/b",
            "nodes": ["n1", "n1"],
            "seeds": ["a b"],
            "semaphores": {"prepare": -1},
            "broker": {"tls": {"certFile": "/c"}, "passwordFile": "/p", "passwordEnv": "X", "port": 0},
        }
    )
    keys = sorted(e.split(":")[0] for e in errors)
    assert keys == [
        "broker.passwordEnv",
        "broker.port",
        "broker.tls",
        "cluster",
        "nodes",
        "seeds",
        "semaphores.prepare",
    ]


def test_enabled_needs_seeds_and_semaphores_and_nodes_are_optional() -> None:
    """Turning coordination on without seeds (or nodes) or caps is an error; seeds alone suffice; the default is off."""
    assert CoordinationSettings().enabled is False
    assert any("needs seeds (or nodes) and semaphores" in e for e in _errors({"enabled": True}))
    settings = CoordinationSettings.model_validate({"enabled": True, "seeds": ["a"], "semaphores": {"p": 1}})
    assert settings.nodes == [] and settings.genesis_seeds == ["a"]
    older = CoordinationSettings.model_validate({"enabled": True, "nodes": ["b", "a"], "semaphores": {"p": 1}})
    assert older.genesis_seeds == ["b", "a"]


def test_state_store_round_trips_and_sets_a_corrupt_file_aside(tmp_path: Path) -> None:
    """The saved state reads back equal; a corrupt file is moved aside and reads as no state."""
    store = StateStore(tmp_path / "state.json", "n0")
    saved = Cluster(("n0", "n1"), {"prepare": 3}).genesis("n0", 42)
    saved.heir = "n1"
    saved.leaving = True
    saved.grants[7] = Grant(7, "prepare", "n0", 3, 1, 2)
    saved.applied["n0"] = {1, 2}
    saved.lost.append(Lost(3, {"prepare": 1}, "n1", {"prepare": 3}))
    store.save(saved)
    saved.leaving = False  # a new process is a member again
    assert store.load() == saved
    store.path.write_text("{not json")
    assert store.load() is None
    assert not store.path.exists() and len(list(tmp_path.glob("state.json.corrupt-*"))) == 1
