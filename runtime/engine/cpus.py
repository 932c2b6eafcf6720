"""The cores this process may use: its CPU affinity, and the quota of its CPU cgroup.

A container capped by a CPU quota (``docker run --cpus 2``, a Kubernetes CPU limit) still sees every
core of the host in its affinity and in ``os.cpu_count()``; ONNX Runtime's default thread pool and
``encode``'s lanes sized by those oversubscribe the quota, and the kernel throttles the process.
"""

from __future__ import annotations

import math
import os


def cpu_count() -> int:
    """Cores this process may run on: its affinity (which a container or Ray may narrow), at most
    its CPU cgroup's quota rounded up."""
    cores, quota = _affinity(), cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_quota() -> int | None:
    """Cores the CPU cgroup's quota allows (v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, v2
    ``cpu.max``), rounded up: the smallest over the process's cgroup and the ones above it (a v2 quota
    set on a parent slice or pod binds its children; a container whose ``/proc/self/cgroup`` names the
    host's path sees its own group at the mount's root). None where there is none or it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2
            roots, files = ["/sys/fs/cgroup"], ("cpu.max", None)
        elif "cpu" in controllers.split(","):
            roots, files = ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"], ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        steps = [p for p in path.strip("/").split("/") if p]
        for root in roots:
            for depth in range(len(steps), -1, -1):  # the group, then each one above it, up to the mount's root
                quota = _read_quota(os.path.join(root, *steps[:depth]), *files)
                if quota is not None:
                    found.append(quota)
    return min(found) if found else None


def _read_quota(folder: str, quota_file: str, period_file: str | None) -> int | None:
    try:
        with open(os.path.join(folder, quota_file)) as f:
            text = f.read().split()
        if period_file is not None:
            with open(os.path.join(folder, period_file)) as f:
                text = [text[0], f.read().strip()]
    except (OSError, IndexError):
        return None
    if len(text) == 2 and text[0].lstrip("-").isdigit() and text[1].isdigit() and int(text[0]) > 0 < int(text[1]):
        return math.ceil(int(text[0]) / int(text[1]))
    return None


def quota_threads() -> int:
    """Intra-op threads where a CPU quota caps the process below the cores it sees (ONNX Runtime
    sizes its default pool by the host's cores): the quota's cores; else 0 (ONNX Runtime's choice)."""
    quota = cpu_quota()
    return max(1, quota) if quota is not None and quota < _affinity() else 0
