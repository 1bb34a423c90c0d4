"""The e2e tests' shared fixtures (the node shapes are in harness.py)."""

from __future__ import annotations

import pytest

from tests.support import cgroups as rc


@pytest.fixture(params=["v1", pytest.param("v2", marks=pytest.mark.kernel)])
def hierarchy(request: pytest.FixtureRequest) -> rc.Hierarchy:
    """This host's cgroup v1 cpu hierarchy, or (marked ``kernel``) the VM's pure cgroup v2 mount."""
    return rc.v1_cpu_hierarchy() if request.param == "v1" else rc.v2_cpu_hierarchy()
