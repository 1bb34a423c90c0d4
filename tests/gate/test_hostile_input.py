"""The gate against hostile and careless clients: a real GateService on a real unix socket.

Deep nesting, floods of connections, clients that never read, random bytes:
each gets a structured answer or a clean refusal, and the gate keeps serving.
"""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gate.served import ServedGate, connect, exchange, ping, served
from tests.support.poll import wait_until

# json.loads parses up to ~1000 levels less the stack in use; json.dumps of the value in an error
# reply, called deeper down, failed for the last few of them: every depth near the limit is tried.
DEPTHS = range(900, 1000)


def nested(depth: int, leaf: object = 0) -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


def test_deeply_nested_values_get_an_error_and_the_gate_keeps_serving(tmp_path: Path) -> None:
    """A request nesting ~1000 levels deep in any value is answered `invalid`, and the gate answers the next request."""
    places = [
        '{{"op":"submit","id":{i},"name":"a","readiness":{deep}}}',
        '{{"op":"submit","id":{i},"name":{deep}}}',
        '{{"op":"submit","id":{i},"name":"a","dependsOn":{deep}}}',
        '{{"op":"ping","id":{i},"extra":{deep}}}',
        '{{"op":{deep},"id":{i}}}',
        '{{"op":"wait","id":{i},"name":"a","until":{deep}}}',
    ]
    requests = [place.format(i=i, deep=nested(depth)) for depth in DEPTHS for i, place in enumerate(places)]
    requests.append('{"op":"submit","name":"a","readiness":' + '{"type":"exec","command":' * 300 + "1" + "}" * 301)
    with served(tmp_path) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        answers = exchange(gate.socket, "\n".join(requests).encode() + b'\n{"op":"ping","id":"after"}\n')
        assert len(answers) == len(requests) + 1, answers[-3:]
        for answer in answers[:-1]:
            assert answer["ok"] is False and answer["error"]["code"] == "invalid", answer
            assert len(answer["error"]["message"]) < 2000
        assert answers[-1] == {"id": "after", "ok": True}
        assert ping(gate.socket) and gate.serving()
        assert gate.call(lambda: gate.gate.counters["malformed"]) == len(requests)


def test_connections_past_the_cap_are_told_busy_and_closed(tmp_path: Path) -> None:
    """With maxConnections open, one more gets a `busy` JSON error line and is closed; once one leaves, it is served."""
    with served(tmp_path, maxConnections=3) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        held = [connect(gate.socket) for _ in range(3)]
        wait_until(lambda: gate.call(lambda: len(gate.gate._connections)) == 3, 10, "three connections served")
        extra = connect(gate.socket)
        line = extra.makefile("rb").readline()
        refusal = json.loads(line)
        assert refusal["ok"] is False and refusal["error"]["code"] == "busy", refusal
        assert "maxConnections" in refusal["error"]["message"]
        assert extra.recv(1) == b""  # closed after the line
        extra.close()
        held.pop().close()
        wait_until(lambda: ping(gate.socket), 10, "a connection served again")
        assert gate.call(lambda: gate.gate.counters["busy"]) >= 1
        for sock in held:
            sock.close()


def test_a_client_that_never_reads_is_not_read_either(tmp_path: Path) -> None:
    """A client sending requests without reading the answers stops being read (not dropped); its unsent answers stay bounded."""
    with served(tmp_path) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        flood = connect(gate.socket)
        flood.setblocking(False)
        chunk = b'{"op":"status"}\n' * 256
        sent, deadline = 0, time.monotonic() + 30
        while True:
            try:
                sent += flood.send(chunk)
            except BlockingIOError:
                _, writable, _ = select.select([], [flood], [], 1.0)
                if not writable:
                    break  # nothing read for a whole second: the gate stopped reading this client
            except (BrokenPipeError, ConnectionResetError):
                raise AssertionError(f"the gate dropped the client after {sent} bytes") from None
            assert time.monotonic() < deadline, f"the gate kept reading a client that never reads ({sent} bytes)"

        def unsent() -> int:
            return max((c.unsent() for c in gate.gate._connections), default=0)

        assert 0 < gate.call(unsent) < 512 * 1024
        assert ping(gate.socket)
        flood.close()


def test_a_bug_in_one_request_is_reported_and_the_gate_goes_on(tmp_path: Path) -> None:
    """A request whose handling raises gets an `internal` error; the same connection and the gate keep working."""
    with served(tmp_path) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        original = gate.gate.status

        def broken() -> dict[str, object]:
            raise RuntimeError("injected fault")

        gate.call(lambda: setattr(gate.gate, "status", broken))
        answers = exchange(gate.socket, b'{"op":"status","id":1}\n{"op":"ping","id":2}\n')
        gate.call(lambda: setattr(gate.gate, "status", original))
        assert answers[0]["error"]["code"] == "internal" and answers[1] == {"id": 2, "ok": True}
        assert gate.serving()


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
OPS = st.sampled_from(["submit", "wait", "ready", "release", "cancel", "attach", "status", "ping", "bogus"])
REQUESTS = st.dictionaries(
    st.sampled_from(
        [
            "op",
            "id",
            "name",
            "dependsOn",
            "readiness",
            "priority",
            "startTimeoutSeconds",
            "detach",
            "semaphore",
            "until",
            "x",
        ]
    ),
    JSON_VALUES,
    max_size=6,
).flatmap(lambda fields: OPS.map(lambda op: {"op": op, **fields} if "op" not in fields else fields))
LINES = st.one_of(
    st.binary(max_size=300),  # random bytes, newlines and invalid UTF-8 included
    REQUESTS.map(lambda request: json.dumps(request).encode()),
    st.integers(900, 990).map(lambda depth: f'{{"op":"submit","name":"x","readiness":{nested(depth)}}}'.encode()),
    st.integers(64 * 1024, 200 * 1024).map(lambda size: b'{"op":"ping","id":"' + b"x" * size + b'"}'),
)


def test_fuzz_the_line_protocol(tmp_path: Path) -> None:
    """Random bytes, random JSON, deep nesting and overlong lines never stop the gate: it answers a valid request after each batch."""
    with served(tmp_path) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        _fuzz(gate)


def _fuzz(gate: ServedGate) -> None:
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(LINES, min_size=1, max_size=6))
    def batch(lines: list[bytes]) -> None:
        with connect(gate.socket) as sock:
            try:
                sock.sendall(b"\n".join(lines) + b"\n")
                sock.shutdown(socket.SHUT_WR)
                data = b""
                while chunk := sock.recv(1 << 16):
                    data += chunk
            except (BrokenPipeError, ConnectionResetError):
                data = b""  # an overlong line ends the connection, possibly while we still send
        for line in data.splitlines():
            answer = json.loads(line)  # every answer is one JSON object per line
            assert isinstance(answer, dict) and answer["ok"] in (True, False)
            if answer["ok"] is False:
                assert answer["error"]["code"] != "internal", answer
        assert ping(gate.socket), "the gate stopped answering"

    batch()
    assert gate.serving() and gate.call(gate.gate.problem) is None
