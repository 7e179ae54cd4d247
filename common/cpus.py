"""The cores a process may actually use: its affinity mask, capped by its cgroup's CPU quota.

A CPU process may be confined to fewer cores than the machine has: an affinity mask
(`taskset`, `docker --cpuset-cpus`) or a cgroup CPU quota (`docker --cpus`, a pod's CPU
limit). Threads past that only queue behind each other.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus() -> int:
    """The cores this process may run on: its affinity mask, capped by its cgroup's CPU quota (rounded up)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else max(1, cpus)


def cgroup_cpu_quota(root: Path = _CGROUP_ROOT, membership: str | None = None) -> float | None:
    """CPUs' worth of time this process's cgroups allow it (the least along its path), None without a quota.

    cgroup v2 (`cpu.max`: "QUOTA PERIOD" or "max PERIOD") along the path in /proc/self/cgroup;
    cgroup v1 (`cpu.cfs_quota_us`, -1 for none, over `cpu.cfs_period_us`) in the cpu controller's folder.
    """
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    quotas: list[float] = []
    for line in membership.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: every folder from the process's cgroup up to the root
            folder = root / path.lstrip("/")
            while True:
                quotas += _quota(folder / "cpu.max")
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):
            for folder in (root / "cpu" / path.lstrip("/"), root / "cpu,cpuacct" / path.lstrip("/"), root / "cpu"):
                quotas += _quota_v1(folder)
    return min(quotas) if quotas else None


def _quota(cpu_max: Path) -> list[float]:
    try:
        quota, period = cpu_max.read_text().split()
    except (OSError, ValueError):
        return []
    return [] if quota == "max" else [int(quota) / int(period)]


def _quota_v1(folder: Path) -> list[float]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return [] if quota <= 0 or period <= 0 else [quota / period]
