"""What the OCI hook says when the gate is unavailable: the message, the container's name, the exit status,
and the client errors it is built from (real unix sockets, no daemon)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.gate import hook_errors as he
from nodeguard.gate.connection import GateClient, GateUnavailable
from tests.support.gate import REPO

CONTAINER_ID = "0123456789abcdef" * 4
SOCKET = "/run/nodeguard/gate.sock"
# What podman's getOCIRuntimeError and define.ExitCode look for (case-insensitive): a message with one of these
# is reported as "a command that was not found" (exit 127) or a permission error, cut down to the matching line.
PODMAN_WORDS = re.compile(
    r"permission denied|operation not permitted|executable file not found in|no such file|not found|open executable",
    re.IGNORECASE,
)
CRIO_LABELS = {
    "io.kubernetes.container.name": "web",
    "io.kubernetes.pod.name": "web-7d9f",
    "io.kubernetes.pod.namespace": "shop",
}
CONTAINERD_ANNOTATIONS = {
    "io.kubernetes.cri.container-name": "db",
    "io.kubernetes.cri.sandbox-name": "db-0",
    "io.kubernetes.cri.sandbox-namespace": "data",
}


def message(cause: str, fail_open: bool = False) -> str:
    return he.unavailable_message('container "web" (id 0123456789ab)', cause, SOCKET, 30, fail_open=fail_open, uid=1000)


def storage(tmp_path: Path, entries: object) -> str:
    """A containers/storage tree with ``containers.json`` holding ``entries``; the bundle path of CONTAINER_ID."""
    bundle = tmp_path / "overlay-containers" / CONTAINER_ID / "userdata"
    bundle.mkdir(parents=True)
    (tmp_path / "overlay-containers" / "containers.json").write_text(json.dumps(entries))
    return str(bundle)


# --- naming the container ---------------------------------------------------------------


def test_a_cri_o_container_is_named_by_kubelets_labels_with_its_short_id() -> None:
    """CRI-O's annotations (kubelet's labels) name the container, its pod and namespace, and the 12-hex id."""
    assert he.container_label(CRIO_LABELS, CONTAINER_ID) == 'container "web" of pod shop/web-7d9f (id 0123456789ab)'


def test_a_containerd_container_is_named_by_the_cri_plugins_annotations() -> None:
    """containerd's CRI annotations name the container and its pod when kubelet's labels are absent."""
    assert (
        he.container_label(CONTAINERD_ANNOTATIONS, CONTAINER_ID) == 'container "db" of pod data/db-0 (id 0123456789ab)'
    )


def test_a_pod_without_a_namespace_is_named_alone() -> None:
    """Without a namespace annotation the pod's name stands alone."""
    annotations = {"io.kubernetes.container.name": "web", "io.kubernetes.pod.name": "web-7d9f"}
    assert he.container_label(annotations, CONTAINER_ID) == 'container "web" of pod web-7d9f (id 0123456789ab)'


def test_a_podman_container_is_named_by_the_runtimes_stored_name() -> None:
    """Without Kubernetes annotations the name the runtime stored names the container."""
    assert he.container_label({}, CONTAINER_ID, "backup-1") == 'container "backup-1" (id 0123456789ab)'


def test_without_a_name_the_gate_load_or_the_short_id_names_the_container() -> None:
    """With no name at all, the message falls back to the short id, and to the load's name when annotated."""
    assert he.container_label({"nodeguard.io/name": "web"}, CONTAINER_ID) == 'container 0123456789ab (gate load "web")'
    assert he.container_label({}, CONTAINER_ID) == "container 0123456789ab"


def test_the_stored_name_is_read_from_the_storages_container_list_beside_the_bundle(tmp_path: Path) -> None:
    """containers.json two levels above the bundle gives the container's first name, matched by its id."""
    bundle = storage(tmp_path, [{"id": "f" * 64, "names": ["other"]}, {"id": CONTAINER_ID, "names": ["web", "x"]}])
    assert he.stored_name(bundle, CONTAINER_ID) == "web"
    assert he.stored_name(bundle + "/", CONTAINER_ID) == "web"


@pytest.mark.parametrize(
    "entries",
    [[{"id": "f" * 64, "names": ["other"]}], [{"id": CONTAINER_ID, "names": []}], {"id": CONTAINER_ID}, "junk"],
)
def test_no_stored_name_when_the_list_does_not_name_the_container(tmp_path: Path, entries: object) -> None:
    """A list without the id, an entry without names, or a list of another shape gives no name."""
    assert he.stored_name(storage(tmp_path, entries), CONTAINER_ID) is None


def test_no_stored_name_without_a_readable_list(tmp_path: Path) -> None:
    """A bundle with no containers.json above it (CRI-O's run root), unparsable JSON or no bundle gives no name."""
    assert he.stored_name(str(tmp_path / "a" / "b"), CONTAINER_ID) is None
    bundle = storage(tmp_path, [])
    (tmp_path / "overlay-containers" / "containers.json").write_text("{not json")
    assert he.stored_name(bundle, CONTAINER_ID) is None
    assert he.stored_name(None, CONTAINER_ID) is None
    assert he.stored_name("", CONTAINER_ID) is None


def test_describe_prefers_kubernetes_names_over_the_storage(tmp_path: Path) -> None:
    """An OCI state with Kubernetes annotations is named by them; without them, by the runtime's storage."""
    bundle = storage(tmp_path, [{"id": CONTAINER_ID, "names": ["k8s_web_web-7d9f_shop_uid_0"]}])
    state = {"id": CONTAINER_ID, "bundle": bundle, "annotations": CRIO_LABELS}
    assert he.describe(state) == 'container "web" of pod shop/web-7d9f (id 0123456789ab)'
    assert he.describe({**state, "annotations": {}}) == 'container "k8s_web_web-7d9f_shop_uid_0" (id 0123456789ab)'
    assert he.describe({"id": CONTAINER_ID, "annotations": "junk"}) == "container 0123456789ab"


# --- the message --------------------------------------------------------------------------


def test_a_missing_socket_says_the_daemon_is_not_running_what_to_check_and_how_to_fail_open() -> None:
    """No socket: the line names the container and the socket, says the daemon is not running, what to check and
    how to fail open."""
    line = message(he.MISSING)
    assert line.startswith('container "web" (id 0123456789ab) not started: no gate socket at /run/nodeguard/gate.sock')
    assert "(waited 30 s)" in line and "the nodeguard daemon is not running" in line
    assert '"systemctl status nodeguard"' in line and "DaemonSet" in line and '"nodeguard status"' in line
    assert '"--if-unavailable", "admit"' in line


def test_a_refusing_socket_says_the_daemon_left_it_behind() -> None:
    """A socket nobody listens on: the line says it refuses connections, left by a daemon that is gone."""
    line = message(he.REFUSED)
    assert "the gate socket /run/nodeguard/gate.sock refuses connections (for 30 s)" in line
    assert "not running" in line and "left the socket behind" in line


def test_a_daemon_that_does_not_answer_is_told_apart_from_one_not_running() -> None:
    """A connection never answered: the line says the daemon is not answering (stopped, hung or overloaded)."""
    line = message(he.NO_ANSWER)
    assert "accepted a connection on /run/nodeguard/gate.sock but did not answer in 30 s" in line
    assert "stopped, hung or overloaded" in line and "not running" not in line


def test_a_socket_this_user_may_not_use_names_the_uid_and_the_settings() -> None:
    """A socket whose mode or owner keeps the hook out: the line names the hook's uid and the socket settings."""
    line = message(he.DENIED)
    assert "this hook (uid 1000) may not connect to the gate socket /run/nodeguard/gate.sock" in line
    assert "gate.socketMode" in line


@pytest.mark.parametrize("cause", [he.MISSING, he.REFUSED, he.NO_ANSWER, he.DENIED, "other"])
def test_every_message_is_one_line_without_the_words_podman_misreads(cause: str) -> None:
    """Each message is one line, names the socket and never uses the words podman turns into "command not found"."""
    for line in (message(cause), message(cause, fail_open=True)):
        assert "\n" not in line and SOCKET in line
        assert not PODMAN_WORDS.search(line), line


def test_failing_open_says_the_container_starts_ungated() -> None:
    """With --if-unavailable admit the line says the container starts ungated, and gives no fail-open advice."""
    line = message(he.MISSING, fail_open=True)
    assert line.startswith('container "web" (id 0123456789ab) starts ungated (--if-unavailable admit): no gate socket')
    assert "to start containers ungated" not in line


def test_exit_statuses_are_tempfail_or_noperm_never_a_shells_126_or_127() -> None:
    """The hook exits 75 while the daemon is away, 77 when the socket keeps it out, 0 when failing open."""
    assert [he.exit_code(c) for c in (he.MISSING, he.REFUSED, he.NO_ANSWER, he.DENIED)] == [75, 75, 75, 77]
    state = {"id": CONTAINER_ID, "annotations": CRIO_LABELS}
    assert he.hook_unavailable(state, he.MISSING, SOCKET, 2.0, fail_open=False)[1] == 75
    line, code = he.hook_unavailable(state, he.MISSING, SOCKET, 2.0, fail_open=True)
    assert code == 0 and 'container "web" of pod shop/web-7d9f' in line


def test_the_message_module_imports_the_standard_library_only() -> None:
    """Importing nodeguard.gate.hook_errors loads no pydantic, structlog, rich or other nodeguard part."""
    code = (
        "import sys; import nodeguard.gate.hook_errors; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pydantic', 'structlog', 'rich', 'httpx', 'psutil') or m.startswith('nodeguard.') "
        "and m not in ('nodeguard.gate', 'nodeguard.gate.hook_errors'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == ""


# --- the causes, from the client's own errors ---------------------------------------------


def connect(path: Path, patience: float = 0.1) -> GateUnavailable:
    async def attempt() -> None:
        client = await GateClient.connect(str(path), patience)
        try:
            await client.request("submit", answer_within=0.3, name="x")
        finally:
            await client.close()

    with pytest.raises(GateUnavailable) as caught:
        asyncio.run(attempt())
    return caught.value


def test_the_client_tells_a_missing_socket_from_a_refusing_one(tmp_path: Path) -> None:
    """No file at the path is ``missing``; a socket file nobody listens on is ``refused``; both carry the path."""
    missing = connect(tmp_path / "gate.sock")
    assert (missing.cause, missing.path) == (he.MISSING, str(tmp_path / "gate.sock"))
    assert 0.05 <= missing.waited < 5
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))  # bound, never listening: what a dead daemon leaves
    try:
        refused = connect(tmp_path / "stale.sock")
    finally:
        stale.close()
    assert (refused.cause, refused.path) == (he.REFUSED, str(tmp_path / "stale.sock"))


@contextlib.contextmanager
def hung_socket(path: Path) -> Iterator[None]:
    """A socket that accepts connections and never answers: a stopped or hung daemon."""
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(path))
    hung.listen(8)
    try:
        yield
    finally:
        hung.close()


def test_the_client_gives_up_on_a_daemon_that_accepts_and_never_answers(tmp_path: Path) -> None:
    """A listening socket that never answers a request is ``no_answer`` after answer_within seconds."""
    with hung_socket(tmp_path / "hung.sock"):
        silent = connect(tmp_path / "hung.sock")
    assert (silent.cause, silent.waited) == (he.NO_ANSWER, 0.3)


# --- the hook as the runtime runs it ----------------------------------------------------------


def run_hook(socket_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``nodeguard oci-hook`` at createRuntime for a CRI-O container, as the runtime runs it."""
    state = {"ociVersion": "1.0.2", "id": CONTAINER_ID, "status": "creating", "bundle": "/nonexistent",
             "annotations": {"nodeguard.io/gate": "true", **CRIO_LABELS}}  # fmt: skip
    args = [sys.executable, "-m", "nodeguard", "oci-hook", "--socket", str(socket_path), "--connect-timeout", "0.3"]
    return subprocess.run(
        [*args, *extra], input=json.dumps(state), capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_the_hook_with_no_daemon_prints_one_line_naming_the_container_and_exits_75(tmp_path: Path) -> None:
    """`nodeguard oci-hook` with no socket writes one line naming the pod's container and the socket, and exits 75."""
    done = run_hook(tmp_path / "gate.sock")
    assert done.returncode == 75, done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert done.stderr.startswith('nodeguard: container "web" of pod shop/web-7d9f (id 0123456789ab) not started: ')
    assert f"no gate socket at {tmp_path / 'gate.sock'}" in done.stderr


def test_the_hook_says_a_hung_daemon_is_not_answering_and_fails_open_when_told(tmp_path: Path) -> None:
    """Against a socket that never answers the hook says so and exits 75; with --if-unavailable admit it exits 0."""
    with hung_socket(tmp_path / "hung.sock"):
        refused = run_hook(tmp_path / "hung.sock")
        admitted = run_hook(tmp_path / "hung.sock", "--if-unavailable", "admit")
    assert refused.returncode == 75, refused.stderr
    assert "but did not answer in 1 s" in refused.stderr, refused.stderr
    assert admitted.returncode == 0, admitted.stderr
    assert "starts ungated (--if-unavailable admit)" in admitted.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="connects as another uid")
def test_the_client_tells_a_socket_that_keeps_its_user_out() -> None:
    """A socket whose mode keeps the caller's uid out (EACCES) is ``denied`` at once, without retrying."""
    public = Path(tempfile.mkdtemp(prefix="nodeguard-hook-"))
    public.chmod(0o755)
    path = public / "gate.sock"
    served = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        served.bind(str(path))
        served.listen(8)
        path.chmod(0o600)
        cause, path_seen = connect_as(4343, path).split(" ", 1)
    finally:
        served.close()
        path.unlink(missing_ok=True)
        public.rmdir()
    assert (cause, path_seen) == (he.DENIED, str(path))


def connect_as(uid: int, path: Path) -> str:
    """The cause and path of GateUnavailable from a connect in a forked child running as ``uid``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, just the client
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                asyncio.run(GateClient.connect(str(path), 30))
                said = "connected -"
            except GateUnavailable as exc:
                said = f"{exc.cause} {exc.path}"
            os.write(write_end, said.encode())
        except BaseException as exc:  # report anything to the parent, never return into pytest
            os.write(write_end, f"child-error {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return data.decode()
