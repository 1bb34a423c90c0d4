"""Host side of the kernel tests: boot one QEMU VM and run every ``kernel`` test in it."""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.kernel.vm import GUEST_OUT_DIR, REPO_ROOT, run_in_vm, vm_available

VM_TIMEOUT_S = 600


def _junit_totals(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {key: sum(int(suite.get(key, "0")) for suite in suites) for key in keys}


def _kernel_test_paths(session: pytest.Session) -> list[str]:
    # Python runs ~20 times slower under emulation, and collecting means importing
    # every test module, so the guest collects only the files holding this
    # session's kernel tests; the whole tree when there are none here (say, this
    # file run on its own).
    files = {str(item.path) for item in session.items if item.get_closest_marker("kernel") is not None}
    return sorted(files) or [str(REPO_ROOT / "tests")]


def test_kernel_tests_pass_inside_vm(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every ``kernel``-marked test runs and passes, none skipped, in a VM with a pure cgroup v2 kernel."""
    if os.environ.get("NODEGUARD_IN_VM") == "1":
        pytest.skip("already inside the kernel VM")
    if reason := vm_available():
        if os.environ.get("NODEGUARD_SKIP_VM") == "1":
            pytest.skip(reason)
        pytest.fail(f"cannot run the kernel tests: {reason} (NODEGUARD_SKIP_VM=1 skips this)")

    # sys.executable, not its resolved path: the venv's bin/python is what
    # selects the same site-packages inside the guest. Hypothesis's plugin
    # imports (and assertion-rewrites) all of hypothesis at the end of the run:
    # 10-30 s under emulation for nothing the kernel tests use.
    command = [
        sys.executable, "-m", "pytest", "-m", "kernel", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
        f"--junitxml={GUEST_OUT_DIR}/junit.xml", *_kernel_test_paths(request.session),
    ]  # fmt: skip
    result = run_in_vm(command, cwd=str(REPO_ROOT), out_dir=tmp_path, timeout=VM_TIMEOUT_S)

    assert result.exit_code == 0, f"kernel tests failed in the VM (exit code {result.exit_code}):\n{result.console}"
    junit = result.out_dir / "junit.xml"
    assert junit.is_file(), f"no junit report from the VM:\n{result.console}"
    totals = _junit_totals(junit)
    assert totals["tests"] > 0, f"no kernel tests ran in the VM:\n{result.console}"
    assert (totals["failures"], totals["errors"], totals["skipped"]) == (0, 0, 0), (
        f"kernel tests in the VM: {totals}:\n{result.console}"
    )
