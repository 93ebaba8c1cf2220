"""This process's cgroups, for the limits a container or a batch job sets: memory (what a
load may allocate, limits.py) and CPU quota (how many threads the pool runs, pool.py).

A limit may sit on the process's own cgroup or on any above it (a batch scheduler's job
cgroup, with unlimited step and task cgroups below it and an unlimited root above), so
:func:`dirs` gives the whole way up, own first. The process's path comes from
``/proc/self/cgroup``, the hierarchy's mount point and root from ``/proc/self/mountinfo``;
where the path is not under the mount (a namespaced view, whose root is the container's
cgroup), the mount's root stands for it. Linux only: elsewhere there is nothing to read.
"""

from __future__ import annotations

import math
import os

PROC_CGROUP, PROC_MOUNTINFO = "/proc/self/cgroup", "/proc/self/mountinfo"


def dirs(controller: str) -> list[tuple[str, int]]:
    """``(directory, version)`` of this process's cgroup and each one above it, up to the
    mount point: in the v1 hierarchy that holds ``controller`` and in v2 (version 1 or 2)."""
    paths = {}
    try:
        with open(PROC_CGROUP) as f:
            for line in f:
                num, controllers, path = line.rstrip("\n").split(":", 2)
                if num == "0" and controllers == "":
                    paths[2] = path
                elif controller in controllers.split(","):
                    paths[1] = path
    except (OSError, ValueError):
        return []
    out = []
    for version, point, root in _mounts(controller):
        path = paths.get(version)
        if path is None:
            continue
        rel = os.path.relpath(path, root) if path.startswith(root) else "."
        at = os.path.normpath(os.path.join(point, rel))
        if not os.path.isdir(at):          # a namespaced view: this cgroup is the mount's root
            at = point
        while True:
            out.append((at, version))
            if at == point or not at.startswith(point):
                break
            at = os.path.dirname(at)
    return out


def _mounts(controller: str) -> list[tuple[int, str, str]]:
    """``(version, mount point, root within the hierarchy)`` of the cgroup2 mount and of the
    v1 mount of ``controller`` (else where they usually are)."""
    found = []
    try:
        with open(PROC_MOUNTINFO) as f:
            for line in f:
                fields = line.split()
                dash = fields.index("-")
                fstype, options = fields[dash + 1], fields[-1].split(",")
                if fstype == "cgroup2" or (fstype == "cgroup" and controller in options):
                    found.append((2 if fstype == "cgroup2" else 1,
                                  fields[4].replace("\\040", " "), fields[3]))
    except (OSError, ValueError, IndexError):
        return [(2, "/sys/fs/cgroup", "/"), (1, f"/sys/fs/cgroup/{controller}", "/")]
    return found


def read_int(path: str) -> int | None:
    """The first number in ``path``; None where it is "max", missing or unreadable."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_quota() -> int | None:
    """The fewest whole CPUs that a CPU quota of this process's cgroups allows (v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), or None for none."""
    found = []
    for d, version in dirs("cpu"):
        if version == 2:
            try:
                with open(os.path.join(d, "cpu.max")) as f:
                    quota, period = f.read().split()[:2]
                quota, period = (None if quota == "max" else int(quota)), int(period)
            except (OSError, ValueError):
                continue
        else:
            quota = read_int(os.path.join(d, "cpu.cfs_quota_us"))
            period = read_int(os.path.join(d, "cpu.cfs_period_us"))
        if quota is not None and quota > 0 and period:
            found.append(max(1, math.ceil(quota / period)))
    return min(found) if found else None
