"""The single writer: path checks, dry run, and counting kernel refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.errors import ActuationRefused, CgroupGone


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "cg"
    (root / "kubepods/pod1").mkdir(parents=True)
    (root / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/cpu.max").write_text("max 100000\n")
    os.symlink(tmp_path / "outside", root / "sneaky")
    return root


@pytest.mark.parametrize(
    "workload_id",
    ["../outside", "kubepods/../../outside", "/etc", "sneaky", "", ".", "kubepods/pod1/../../../outside", "a\x00b"],
)
def test_refuses_paths_outside_the_root(tree: Path, workload_id: str) -> None:
    """Names that resolve outside the cgroup root (via .., absolute paths, symlinks) are refused and counted."""
    writer = CgroupWriter(str(tree))
    with pytest.raises(ActuationRefused):
        writer.write(workload_id, "cpu.max", "1000 100000")
    assert writer.counters.refused == 1
    assert (tree.parent / "outside/cpu.max").read_text() == "max 100000\n"


def test_refuses_files_it_does_not_own(tree: Path) -> None:
    """Files off the allow-list (the registered levers' and eviction's) are refused."""
    writer = CgroupWriter(str(tree))
    for name in ("cgroup.procs", "memory.max", "../cpu.max", "cpu.max/../x"):
        with pytest.raises(ActuationRefused):
            writer.write("kubepods/pod1", name, "1")


def test_writes_inside_and_dry_run_only_logs(tree: Path) -> None:
    """A write inside the root lands; in dry run nothing changes but it is counted."""
    writer = CgroupWriter(str(tree))
    writer.write("kubepods/pod1", "cpu.max", "20000 100000")
    assert (tree / "kubepods/pod1/cpu.max").read_text() == "20000 100000"
    dry = CgroupWriter(str(tree), dry_run=True)
    dry.write("kubepods/pod1", "cpu.max", "max 100000")
    assert (tree / "kubepods/pod1/cpu.max").read_text() == "20000 100000"
    assert (dry.counters.dry_run_writes, dry.counters.writes) == (1, 0)


def test_a_workload_that_left_is_cgroup_gone(tree: Path) -> None:
    """Writing to a removed cgroup raises CgroupGone and counts ENOENT."""
    writer = CgroupWriter(str(tree))
    with pytest.raises(CgroupGone):
        writer.write("kubepods/pod2", "cpu.max", "1000 100000")
    assert writer.counters.errors["ENOENT"] == 1


@pytest.mark.parametrize("workload_id", ["../outside", "sneaky", "kubepods/pod1/../../../outside"])
def test_memory_high_is_on_the_allow_list_with_the_same_path_checks(tree: Path, workload_id: str) -> None:
    """memory.high (the memory lever's file) is written inside the root, and refused where the path leaves it."""
    (tree.parent / "outside/memory.high").write_text("max\n")
    (tree / "kubepods/pod1/memory.high").write_text("max\n")
    writer = CgroupWriter(str(tree))
    writer.write("kubepods/pod1", "memory.high", "1048576")
    assert (tree / "kubepods/pod1/memory.high").read_text() == "1048576"
    with pytest.raises(ActuationRefused):
        writer.write(workload_id, "memory.high", "4096")
    assert (tree.parent / "outside/memory.high").read_text() == "max\n"
    for other in ("memory.max", "memory.low", "memory.min"):  # the OOM killer's limit and protection stay kubelet's
        with pytest.raises(ActuationRefused):
            writer.write("kubepods/pod1", other, "4096")


# Writes each file named after the root in turn, printing what problem() says after each.
REFUSED = """
import sys
from nodeguard.actuators.cgroup_writer import CgroupWriter
writer = CgroupWriter(sys.argv[1])
for name in sys.argv[2:]:
    try:
        writer.write("kubepods/pod1", name, "1")
    except OSError:
        pass
    print(writer.problem())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="takes root's override of file permissions away with setpriv: needs root and setpriv",
)
def test_a_write_refused_for_want_of_permission_names_the_file_not_a_lever(tree: Path) -> None:
    """A weight, memory.high or quota write refused with EACCES makes problem() name the errno and that file, alike."""
    names = ("cpu.weight", "memory.high", "cpu.max")
    for name in names:
        (tree / "kubepods/pod1" / name).write_text("100\n")
        os.chown(tree / "kubepods/pod1" / name, 65534, 65534)  # delegated to another user
    without_override = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--", sys.executable]
    result = subprocess.run(
        [*without_override, "-c", REFUSED, str(tree), *names], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    root = os.path.realpath(tree)
    assert result.stdout.splitlines() == [
        f"cgroup writes refused: EACCES (Permission denied) writing {root}/kubepods/pod1/{name}" for name in names
    ]
