"""Discovery of containers that containerd (runc shim, cgroupfs) runs in kubepods-shaped cgroups.

``ctr run --cgroup`` is given the path the CRI plugin would give each: a bare
id in a cgroupfs-driver pod (``kubepods/besteffort/pod<uid>/<id>``), and
``cri-containerd-<id>.scope`` in a systemd-driver pod's slice
(``kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice``).
Without systemd on this host runc's cgroupfs driver creates those
systemd-named directories itself: the names are the systemd driver's, the
cgroups and the processes in them are real.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers import runtime
from tests.containers.pods import snapshot
from tests.support import cgroups as rc
from tests.support.poll import wait_until

NAMESPACE = "nodeguard-test"


class Containerd:
    """A containerd of the test's own (own root, state and socket; no CRI plugin) and ``ctr`` against it."""

    def __init__(self, workdir: Path) -> None:
        self.state = runtime.RUN_STATE / f"containerd-{os.getpid()}-{secrets.token_hex(4)}"
        self.socket = self.state / "containerd.sock"
        self.config = workdir / "containerd.toml"
        self.config.write_text(
            "version = 2\n"
            f'root = "{runtime.CACHE / "containerd"}"\n'
            f'state = "{self.state / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.socket}"\n'
            f'[ttrpc]\n  address = "{self.socket}.ttrpc"\n'
        )
        self.log = workdir / "containerd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Containerd:
        self.state.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(["containerd", "--config", str(self.config)], stdout=log, stderr=log)
        wait_until(lambda: self.ctr_result("version").returncode == 0, 20, "containerd answering")
        return self

    def ctr_result(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    def ctr(self, *args: str) -> str:
        result = self.ctr_result(*args)
        if result.returncode != 0:
            raise runtime.CommandFailed(["ctr", *args], result)
        return result.stdout

    def run(self, cid: str, cgroup: str, rootfs: Path, *command: str) -> None:
        self.ctr("run", "--detach", "--rootfs", "--read-only", "--env", "PATH=/bin", "--cgroup", f"/{cgroup}",
                 str(rootfs), cid, *command)  # fmt: skip

    def tasks(self) -> dict[str, int]:
        """Running tasks: container id -> pid."""
        rows = [line.split() for line in self.ctr("task", "ls").splitlines()[1:]]
        return {row[0]: int(row[1]) for row in rows if len(row) >= 2}

    def remove(self, cid: str) -> None:
        self.ctr_result("task", "delete", "--force", cid)  # kills it first
        self.ctr_result("container", "delete", cid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            for leftover in sorted(self.state.rglob("*"), key=lambda p: -len(p.parts)):
                leftover.rmdir() if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()
            self.state.rmdir()


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[Containerd]:
    reason = runtime.why_no_containers()
    if reason:
        pytest.skip(reason)
    runtime.require("containerd")
    runtime.require("ctr")
    daemon = Containerd(tmp_path).start()
    try:
        yield daemon
    finally:
        daemon.stop()


def test_containerd_containers_in_both_drivers_pod_layouts_are_found(tmp_path: Path, containerd: Containerd) -> None:
    """A pod of each kubelet driver with a container containerd runs in it: both pods found, each with its container."""
    rootfs = runtime.busybox_rootfs()
    parent = rc.unique_name()
    uid = str(uuid.uuid4())
    bare_id, scope_id = secrets.token_hex(32), secrets.token_hex(32)
    cgroupfs_pod = f"{parent}/kubepods/besteffort/pod{uid}"
    systemd_pod = (
        f"{parent}/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    )
    started: list[str] = []
    try:
        containerd.run(bare_id, f"{cgroupfs_pod}/{bare_id}", rootfs, "sleep", "3600")
        started.append(bare_id)
        containerd.run(scope_id, f"{systemd_pod}/cri-containerd-{scope_id}.scope", rootfs, "sleep", "3600")
        started.append(scope_id)
        tops = [f"{parent}/kubepods", f"{parent}/kubepods.slice"]
        config = {"global": {"sensing": {"kubepodsPaths": tops}, "http": {"enabled": False}}}
        found = {w["workload"]["id"]: w["workload"] for w in snapshot(config, tmp_path)["workloads"]}
        assert set(found) == {cgroupfs_pod, systemd_pod}, sorted(found)
        for pod, cid, runtime_name in ((cgroupfs_pod, bare_id, ""), (systemd_pod, scope_id, "containerd")):
            workload = found[pod]
            assert (workload["pod_uid"], workload["qos_class"]) == (uid, "BestEffort")
            [container] = workload["containers"]
            assert (container["id"], container["runtime"], container["sandbox"]) == (cid, runtime_name, False)
        # The containers' processes are in those cgroups: containerd and runc put them there.
        tasks = containerd.tasks()
        for cid, path in (
            (bare_id, f"{cgroupfs_pod}/{bare_id}"),
            (scope_id, f"{systemd_pod}/cri-containerd-{scope_id}.scope"),
        ):
            assert f":/{path}\n" in Path(f"/proc/{tasks[cid]}/cgroup").read_text(), path
    finally:
        for cid in started:
            containerd.remove(cid)
        runtime.remove_everywhere(parent)
