"""Suite-wide pytest hooks."""

from __future__ import annotations

from pathlib import Path

import pytest

CGROUP2_CONTROLLERS = Path("/sys/fs/cgroup/cgroup.controllers")
KERNEL_SKIP_REASON = (
    "needs a pure cgroup v2 hierarchy with the cpu controller; "
    "runs inside the QEMU VM via tests/kernel/test_vm_suite.py"
)


def _pure_cgroup2_with_cpu() -> bool:
    # On a hybrid or v1 host /sys/fs/cgroup is a tmpfs without this file; on a
    # v2 host whose cpu controller is bound to v1 the file lacks "cpu".
    try:
        return "cpu" in CGROUP2_CONTROLLERS.read_text().split()
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``kernel``-marked tests where the kernel cannot honour them."""
    if _pure_cgroup2_with_cpu():
        return
    skip = pytest.mark.skip(reason=KERNEL_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("kernel") is not None:
            item.add_marker(skip)
