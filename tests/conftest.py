"""Suite-wide pytest hooks."""

from __future__ import annotations

import compileall
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile nodeguard's and the tests' bytecode once, as an installed package has it.

    The suite starts hundreds of nodeguard processes (daemons, the OCI hook,
    gate clients). From a fresh checkout with PYTHONDONTWRITEBYTECODE set, as
    on CI, each of them would compile every module it imports (about 0.3 s
    here, 40 times that in the emulated VM, which reads this tree).
    """
    from tests.kernel.vm import IN_VM

    if IN_VM:
        return  # the host compiled it before the VM booted; the guest's writes would be lost anyway
    for tree in ("nodeguard", "tests", "bench"):  # py_compile writes even under PYTHONDONTWRITEBYTECODE
        assert compileall.compile_dir(REPO_ROOT / tree, quiet=1), f"{tree}/ does not compile"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``kernel``-marked tests where the kernel cannot honour them."""
    if _pure_cgroup2_with_cpu():
        return
    skip = pytest.mark.skip(reason=KERNEL_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("kernel") is not None:
            item.add_marker(skip)


@pytest.fixture
def hybrid_v2_mount() -> Path:
    """The cgroup2 mount of a hybrid host (v1 cpu beside it); skips elsewhere."""
    from tests.support import cgroups as rc

    reason = rc.why_no_v2_of("hybrid")
    if reason:
        pytest.skip(reason)
    mount = rc.v2_mount()
    assert mount is not None
    return mount
