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
    ``cpu.max``), rounded up; None where there is no quota or it cannot be read."""
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
            pairs = [(f"/sys/fs/cgroup{path}/cpu.max", None)]
        elif "cpu" in controllers.split(","):
            pairs = [(f"{base}{path}/cpu.cfs_quota_us", f"{base}{path}/cpu.cfs_period_us")
                     for base in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")]
        else:
            continue
        for quota_file, period_file in pairs:
            try:
                with open(quota_file) as f:
                    text = f.read().split()
                if period_file is not None:
                    with open(period_file) as f:
                        text = [text[0], f.read().strip()]
            except (OSError, IndexError):
                continue
            if len(text) == 2 and text[0].lstrip("-").isdigit() and text[1].isdigit() and int(text[0]) > 0 < int(text[1]):
                found.append(math.ceil(int(text[0]) / int(text[1])))
            break
    return min(found) if found else None


def quota_threads() -> int:
    """Intra-op threads where a CPU quota caps the process below the cores it sees (ONNX Runtime
    sizes its default pool by the host's cores): the quota's cores; else 0 (ONNX Runtime's choice)."""
    quota = cpu_quota()
    return max(1, quota) if quota is not None and quota < _affinity() else 0
