"""The constants that tune the guard's behaviour and are not settings, named once, each with why it is what it is.

What an operator may want to change is a setting (``policy.settings``); what
follows from the kernel or from the planner's own arithmetic is here.
"""

from __future__ import annotations

# A gap under one millicore (Kubernetes' smallest CPU unit) is closed: quotas
# are whole microseconds, and rounding must not touch one more workload.
CLOSED_CORES = 1e-3
# The kernel refuses a smaller CFS quota.
MIN_QUOTA_US = 1000
# Streaks are capped: a counter only needs to reach the largest triggerAfter/restoreAfter.
STREAK_CAP = 1000

# Protection (protected_cpu_stall).
# A lowered weight stays while the work under it waits for this many cores more than the node has idle.
CONTENDED_CORES = 0.1
# A candidate using less CPU than this does no harm to make room from: its group's weight is left alone.
ACTIVE_CANDIDATE_CORES = 0.01
# Idle CPU on the node past which no runnable work is held back by its weight.
IDLE_CORES = 0.1

# memory.high (policy.memory).
# Values are multiples of this: whole pages on 4, 16 and 64 KiB page kernels (the lever refuses others).
GRANULE = 64 << 10
# How far usage may sit above memory.high (the kernel charges in batches) and still count as reclaimed down to it.
OVER_SLACK = 1 << 20
# A workload using this share of its memory.high or more, and stalled on memory itself, is still held there by
# the kernel's reclaim: it wants the memory its hold keeps from the protected workloads.
PRESSING_SHARE = 0.95
# Seconds a hold stays after its workload last pressed against it (PSI's own shortest average is over 10 s): a
# stream's reclaim stalls come in bursts, and one tick without one does not mean it stopped.
PRESSED_SECONDS = 10.0

# The tick (nodeguard.guard_tick).
# Passes of one tick: each after the first plans again without the groups whose writes the kernel refused.
MAX_PASSES = 8
# A group whose write was refused is held back for guard.failedWriteBackoffSeconds, doubling per refusal in a
# row, up to this many times that.
LONGEST_HOLD_FACTOR = 20
