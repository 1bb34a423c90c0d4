"""What the benchmarks share, and the one module of bench/ that imports from tests/.

The tests' support (real cgroups, workloads and the probe, the daemon as a child process, a kubelet-shaped node,
the gate, a broker, the coordination config, free ports) and the QEMU VM the kernel benchmarks run in are
imported here and nowhere else in bench/.
"""

from __future__ import annotations

import signal
import sys

from tests.containers.runtime import wait_for_the_node
from tests.kernel.vm import IN_VM, run_in_vm, vm_available
from tests.support import cgroups as rc
from tests.support.broker import Broker
from tests.support.cluster import coordination_config
from tests.support.daemon import DaemonProcess
from tests.support.gate import Gate
from tests.support.node import kubelet_node
from tests.support.ports import free_port
from tests.support.workloads import (
    CPU_UNITS,
    p99,
    p99_windows,
    probe_iterations,
    probe_lateness,
    start_duty_cycle,
    start_probe,
)

__all__ = [
    "CPU_UNITS",
    "IN_VM",
    "Broker",
    "DaemonProcess",
    "Gate",
    "coordination_config",
    "free_port",
    "kubelet_node",
    "p99",
    "p99_windows",
    "probe_iterations",
    "probe_lateness",
    "rc",
    "run_in_vm",
    "start_duty_cycle",
    "start_probe",
    "stop_cleanly_on_sigterm",
    "vm_available",
    "wait_for_the_node",
]


def stop_cleanly_on_sigterm() -> None:
    """SIGTERM raises SystemExit in a bench, so its with-blocks stop its processes and remove its cgroups."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
