"""Host side of the kernel tests: boot one QEMU VM and run every ``kernel`` test in it."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.kernel.vm import GUEST_OUT_DIR, IN_VM, REPO_ROOT, run_in_vm, vm_available

VM_TIMEOUT_S = 600


def _junit_name(node_id: str) -> tuple[str, str]:
    """(classname, name) of a node id in a junit report, as pytest writes them."""
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    names[0] = names[0].removesuffix(".py").replace("/", ".")
    return ".".join(names[:-1]), names[-1] + bracket + params


def _junit_outcomes(path: Path) -> dict[tuple[str, str], str]:
    """Each test case of a junit report by (classname, name): passed, failure, error or skipped."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = sorted({child.tag for child in case} & {"failure", "error", "skipped"})
        outcomes[(case.get("classname", ""), case.get("name", ""))] = kinds[0] if kinds else "passed"
    return outcomes


def _host_kernel_tests(session: pytest.Session) -> list[str]:
    """The node ids of the ``kernel`` tests this host session collected.

    When it collected none (this file run on its own), those of the whole tree.
    Python runs ~20 times slower under emulation and collecting means importing
    every test module, so the guest is handed these ids, not the tree.
    """
    ids = [item.nodeid for item in session.items if item.get_closest_marker("kernel") is not None]
    if ids:
        return ids
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "kernel", "-p", "no:cacheprovider", "tests"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=False,
    )  # fmt: skip
    ids = [line.strip() for line in listed.stdout.splitlines() if "::" in line]
    assert ids, f"no kernel tests collected on the host:\n{listed.stdout}{listed.stderr}"
    return ids


def _compile_for_the_guest(command: list[str]) -> None:
    """Write on the host the bytecode the guest would compile under emulation, once per VM run (about 25 s of it).

    The guest reads this checkout and the venv read-only and keeps what it
    writes in memory: nodeguard's and the tests' modules compiled here, and
    the test modules as pytest rewrites them (written by a collection with the
    guest's own options), are used by every guest process as long as their
    sources are unchanged. PYTHONDONTWRITEBYTECODE, if set, would stop both.
    """
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    compiled = subprocess.run([sys.executable, "-m", "compileall", "-q", "nodeguard", "tests"],
                              capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300, check=False)  # fmt: skip
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    collect = [arg for arg in command if not arg.startswith("--junitxml")]
    collected = subprocess.run([*collect, "--collect-only", "-q"],
                               capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300, check=False)  # fmt: skip
    assert collected.returncode == 0, collected.stdout + collected.stderr


def _slowest(junit: Path, count: int = 8) -> str:
    """The guest's slowest tests, for the log: where the VM's time budget goes."""
    cases = [(float(case.get("time", 0)), case.get("name", "")) for case in ET.parse(junit).getroot().iter("testcase")]
    return "; ".join(f"{name} {seconds:.0f} s" for seconds, name in sorted(cases, reverse=True)[:count])


def test_kernel_tests_pass_inside_vm(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every ``kernel`` test this host collected runs and passes in a VM with a pure cgroup v2 kernel: the same set."""
    if IN_VM:
        pytest.skip("already inside the kernel VM")
    if reason := vm_available():
        if os.environ.get("NODEGUARD_SKIP_VM") == "1":
            pytest.skip(reason)
        pytest.fail(f"cannot run the kernel tests: {reason} (NODEGUARD_SKIP_VM=1 skips this)")

    expected = _host_kernel_tests(request.session)
    # sys.executable, not its resolved path: the venv's bin/python is what
    # selects the same site-packages inside the guest. Hypothesis's plugin
    # imports (and assertion-rewrites) all of hypothesis at the end of the run:
    # 10-30 s under emulation for nothing the kernel tests use. A test stuck for
    # 200 s dumps every thread's stack to the console, which a VM timeout shows.
    command = [
        sys.executable, "-m", "pytest", "-m", "kernel", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
        "-o", "faulthandler_timeout=200",
        f"--junitxml={GUEST_OUT_DIR}/junit.xml", *expected,
    ]  # fmt: skip
    _compile_for_the_guest(command)
    result = run_in_vm(command, cwd=str(REPO_ROOT), out_dir=tmp_path, timeout=VM_TIMEOUT_S)

    assert result.exit_code == 0, f"kernel tests failed in the VM (exit code {result.exit_code}):\n{result.console}"
    junit = result.out_dir / "junit.xml"
    assert junit.is_file(), f"no junit report from the VM:\n{result.console}"
    outcomes = _junit_outcomes(junit)
    passed = [key for key, outcome in outcomes.items() if outcome == "passed"]
    not_passed = {node: outcomes.get(_junit_name(node), "not run") for node in expected}
    not_passed = {node: outcome for node, outcome in not_passed.items() if outcome != "passed"}
    assert not not_passed, f"of {len(expected)} kernel tests, {len(not_passed)} did not pass in the VM: {not_passed}"
    assert len(passed) == len(expected), f"{len(expected)} kernel tests collected here, {len(passed)} passed in the VM"
    print(
        f"{len(expected)} kernel tests collected here, {len(passed)} passed in the VM in {result.elapsed_s:.0f} s;"
        f" slowest: {_slowest(junit)}"
    )  # shown by pytest -rP


def test_junit_report_names_every_collected_test(tmp_path: Path) -> None:
    """The VM's junit report is matched to host node ids (parametrized ones too) by the names pytest writes there."""
    target = ["tests/sources/test_discovery.py", "-k", "cgroup_root_moves or kind_layout or crio"]
    common = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *target]
    listed = subprocess.run([*common, "--collect-only", "-q"], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=120, check=False)  # fmt: skip
    ids = [line.strip() for line in listed.stdout.splitlines() if "::" in line]
    assert any("[" in node for node in ids), listed.stdout
    report = tmp_path / "junit.xml"
    ran = subprocess.run([*common, f"--junitxml={report}", "-q"], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=300, check=False)  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    outcomes = _junit_outcomes(report)
    assert {_junit_name(node) for node in ids} == set(outcomes)
    assert set(outcomes.values()) <= {"passed", "skipped"}
