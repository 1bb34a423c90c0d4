"""The weight lever: cgroup v1 ``cpu.shares`` and v2 ``cpu.weight``/``cpu.idle``, through the single writer.

The protected_cpu_stall objective's first lever (bench/protect.py): a group's
weight lowered to the kernel's least keeps it from delaying a protected
workload's wake-ups, and still gives it every cycle nobody else wants.
kubelet sets the QoS tiers' weights itself (and rewrites them as pods come
and go): a value found in place of nodeguard's is taken as the new original
and nodeguard's is asserted again.

On v2 ``cpu.idle`` (IDLE, 0, where the kernel has it: 5.15+) holds a group
back further than any weight (an idle group yields to a waking task at
once), but setting it makes every later weight write to the group fail with
EINVAL: kubelet's rewrite of a QoS tier (fatal at its start), of a Burstable
pod on an in-place resize, systemd's on ``daemon-reload``. So the lever's
strongest hold is the least weight (v1 ``cpu.shares`` 2, v2 ``cpu.weight``
1), and IDLE only where the policy asks for it on a group no owner writes a
weight to again (a BestEffort pod: kubelet writes its weight once, when it
creates it). Unsetting cpu.idle resets the weight to 100: a weight goes back
by clearing cpu.idle, then writing it.

Its canonical text is the weight as a decimal number, "0" for IDLE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeguard.actuators.levers.base import Version, Write, Writer, refusal, writes_back
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.model.levers import CPU_WEIGHT
from nodeguard.model.snapshot import WorkloadUsage


@dataclass(frozen=True, slots=True)
class WeightFile:
    name: str
    least: int
    most: int


V1_SHARES = WeightFile("cpu.shares", 2, 262144)
V2_WEIGHT = WeightFile("cpu.weight", 1, 10000)
IDLE = 0  # v2: cpu.idle set
IDLE_FILE = "cpu.idle"


class WeightLever:
    """A group's CPU weight, lowered to the kernel's least so it yields to a protected workload at once."""

    terms = CPU_WEIGHT
    name = CPU_WEIGHT.name
    noun = CPU_WEIGHT.noun

    def __init__(self, writer: Writer, version: str) -> None:
        self.writer = writer
        self.version: Version = "v2" if version == "v2" else "v1"
        self.file = V2_WEIGHT if version == "v2" else V1_SHARES
        # v2: whether the kernel has cpu.idle; None until a group's files have said.
        self.has_idle: bool | None = None if version == "v2" else False

    @property
    def least(self) -> int:
        """The value a lowered group gets: IDLE where the kernel has cpu.idle (known after the first read)."""
        return IDLE if self.has_idle else self.file.least

    def least_for(self, group: str) -> int:
        """``least``, asking the group's files first whether the kernel has cpu.idle, when not known yet."""
        if self.has_idle is None:
            self._idle(group)
        return self.least

    def file_of_value(self, value: int) -> str:
        """The file that holds ``value``: cpu.idle for IDLE, else the weight's."""
        return IDLE_FILE if value == IDLE and self.version == "v2" else self.file.name

    @staticmethod
    def files(version: str) -> frozenset[str]:
        return frozenset({V2_WEIGHT.name, IDLE_FILE} if version == "v2" else {V1_SHARES.name})

    @staticmethod
    def check(value: str) -> str:
        number = int(value)  # ValueError for anything else
        if number != IDLE and not V2_WEIGHT.least <= number <= V1_SHARES.most:
            raise ValueError(f"weight {number} out of range")
        return str(number)

    def read(self, group: str) -> str:
        return str(self.weight(group))

    def weight(self, group: str) -> int:
        """The group's weight, IDLE while its cpu.idle is set."""
        idle = self._idle(group)
        if idle:
            return IDLE
        return self._read_weight(group)

    def plan(self, group: str, target: str, originals: Mapping[str, str]) -> tuple[str, list[Write]]:
        current = self.read(group)
        return current, writes_back(current, target, group)

    def perform(self, writes: Sequence[Write], **context: object) -> None:
        for write in writes:  # one group: a weight has no hierarchy order to keep
            value = int(write.after)
            try:
                self.write(write.path, value, **context)
            except (OSError, ActuationRefused) as exc:
                raise refusal(write.path, self.file_of_value(value), exc) from None

    def restricts(self, value: str, than: str) -> bool:
        return int(value) < int(than)

    def strongest(self, group: str) -> str:
        """The least weight the kernel takes a weight write on: never cpu.idle, which makes every later weight
        write to the group fail (EINVAL), kubelet's and systemd's included."""
        return str(self.file.least)

    def resolve(self, group: str, target: str) -> str:
        """IDLE where the kernel has cpu.idle (asking the group's files when not known yet), else the least
        weight; any other weight as it is."""
        if int(target) != IDLE:
            return target
        try:
            return str(self.least_for(group))
        except (CgroupGone, OSError, ActuationRefused, ParseError):
            return str(self.file.least)

    def seen(self, usage: WorkloadUsage) -> str | None:
        return None  # snapshots do not read weights

    def shown(self, value: str) -> str:
        return "idle" if int(value) == IDLE and self.version == "v2" else value

    def number(self, value: str) -> float | None:
        return float(value)

    @property
    def main_file(self) -> str:
        return self.file.name

    def file_of(self, write: Write) -> str:
        return self.file_of_value(int(write.after))

    def write(self, group: str, value: int, **context: object) -> None:
        if value == IDLE:
            self.writer.write(group, IDLE_FILE, "1", **context)
            return
        if not self._idle(group):
            self.writer.write(group, self.file.name, str(value), **context)
            return
        self.writer.write(group, IDLE_FILE, "0", **context)  # the kernel resets the weight to 100 here
        try:
            self.writer.write(group, self.file.name, str(value), **context)
        except OSError:
            # Idle again, so the group still reads as nodeguard's and its ledger record is kept for a retry (not
            # left at 100, which a restore would take for someone else's value and forget).
            self.writer.write(group, IDLE_FILE, "1", **context)
            raise

    def _idle(self, group: str) -> bool:
        """Whether the group's cpu.idle is set (never, where the kernel has no cpu.idle)."""
        if self.has_idle is False:
            return False
        try:
            idle = self.writer.read(group, IDLE_FILE)
        except CgroupGone:
            # The group is gone (its weight's read or write will say so) or the kernel has no cpu.idle.
            if self.has_idle is None and self.writer.exists(group):
                self.has_idle = False
            return False
        self.has_idle = True
        return idle == "1"

    def _read_weight(self, group: str) -> int:
        text = self.writer.read(group, self.file.name)
        try:
            value = int(text)
        except ValueError:
            raise ParseError(f"{self.file.name} of {group}: not a number: {text!r}") from None
        if not self.file.least <= value <= self.file.most:
            raise ParseError(f"{self.file.name} of {group}: {value} out of range")
        return value
