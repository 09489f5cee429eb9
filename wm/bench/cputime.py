"""CPU time of a node's whole process tree, from ``/proc`` (psutil is no dependency of
WorkManager's; the kernel's counters are all this needs)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from wm.engine import child_pids

#: Clock ticks per second of ``/proc/<pid>/stat``'s times.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User and system time of ``pid`` and of its children it has reaped (a pool process
    replaced, a sandbox that ended), in seconds; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # after the command's name: state, ppid, … utime (11), stime, cutime, cstime (14)
    return sum(int(ticks) for ticks in fields[11:15]) / CLOCK_TICKS


def tree_cpu_s(roots: Iterable[int]) -> float:
    """CPU seconds spent so far by each root and every process under it, living or reaped
    (a living process's reaped children are in its own counters, never counted twice)."""
    total, waiting = 0.0, list(roots)
    while waiting:
        pid = waiting.pop()
        total += process_cpu_s(pid)
        waiting.extend(child_pids(pid))
    return total
