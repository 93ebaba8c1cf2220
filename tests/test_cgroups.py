"""The limits a container or a batch job sets, read from its cgroups (lcckpt/util/cgroups.py):
memory, which bounds what a load may allocate ("auto"), and CPU quota, which bounds the
pool's threads. The /proc files and cgroup directories are faked under tmp_path."""

import pytest

from lcckpt import limits
from lcckpt.util import cgroups, pool


def _cgroup_tree(tmp_path, monkeypatch, cgroup: str, mounts: list[str], dirs: dict) -> None:
    """/proc/self/cgroup, /proc/self/mountinfo and cgroup directories, faked under
    ``tmp_path``: ``dirs`` maps a directory below it to its files' contents."""
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text("".join(
        f"3{i} 23 0:2{i} {m.format(tmp=tmp_path)}\n" for i, m in enumerate(mounts)))
    for d, files in dirs.items():
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp_path / d / name).write_text(text)
    monkeypatch.setattr(cgroups, "PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(cgroups, "PROC_MOUNTINFO", str(tmp_path / "mountinfo"))


def _v1(limit, used, cache=0):
    return {"memory.limit_in_bytes": f"{limit}\n", "memory.usage_in_bytes": f"{used}\n",
            "memory.stat": f"cache 5\ntotal_inactive_file {cache}\n"}


_UNLIMITED = 9223372036854771712


def test_a_v1_job_cgroup_below_the_root_bounds_auto(tmp_path, monkeypatch):
    """A batch job's cgroup v1 (a scheduler's job, step and task levels): the limit sits
    on the job, below the hierarchy's unlimited root and above the process's own
    unlimited cgroup. Reading the root alone found no limit, and a load that could not
    fit was killed by the kernel instead of refused."""
    job = "m/slurm/uid_0/job_7"
    _cgroup_tree(tmp_path, monkeypatch,
                 "5:devices:/slurm\n4:memory:/slurm/uid_0/job_7/step_0\n0::/\n",
                 ["/ {tmp}/m rw - cgroup cgroup rw,memory", "/ {tmp}/c rw - cgroup cgroup rw,cpu"],
                 {"m": _v1(_UNLIMITED, 50 << 30), "m/slurm/uid_0": _v1(_UNLIMITED, 9 << 30),
                  job: _v1(1 << 30, 700 << 20, cache=100 << 20),
                  f"{job}/step_0": _v1(_UNLIMITED, 600 << 20),
                  "c/slurm/uid_0/job_7/step_0": _v1(1, 1)})    # not the memory controller
    assert limits._cgroup_left() == ((1 << 30) - (600 << 20), "the cgroup's memory limit")


def test_the_tightest_v2_limit_among_the_ancestors_bounds_auto(tmp_path, monkeypatch):
    v2 = lambda limit, used: {"memory.max": f"{limit}\n", "memory.current": f"{used}\n",
                              "memory.stat": "anon 1\ninactive_file 0\n"}
    _cgroup_tree(tmp_path, monkeypatch, "0::/user.slice/run.scope\n",
                 ["/ {tmp}/u rw - cgroup2 cgroup2 rw"],
                 {"u": v2("max", 1 << 40), "u/user.slice": v2(4 << 30, 1 << 30),
                  "u/user.slice/run.scope": v2(8 << 30, 1 << 30)})
    assert limits._cgroup_left() == (3 << 30, "the cgroup's memory limit")


def test_a_namespaced_cgroup_view_reads_its_mount_root(tmp_path, monkeypatch):
    """In a container, /proc/self/cgroup may name a path the mount does not show (its
    root is the container's cgroup): the mount's root is read."""
    _cgroup_tree(tmp_path, monkeypatch, "4:memory:/docker/abc123\n",
                 ["/ {tmp}/m rw - cgroup cgroup rw,memory"], {"m": _v1(2 << 30, 1 << 30)})
    assert limits._cgroup_left() == (1 << 30, "the cgroup's memory limit")
    _cgroup_tree(tmp_path, monkeypatch, "4:memory:/docker/abc123\n",
                 ["/docker/abc123 {tmp}/m rw - cgroup cgroup rw,memory"], {})
    assert limits._cgroup_left() == (1 << 30, "the cgroup's memory limit")    # mount root
    _cgroup_tree(tmp_path, monkeypatch, "4:memory:/\n",
                 ["/ {tmp}/m rw - cgroup cgroup rw,memory"], {"m": _v1(_UNLIMITED, 1)})
    assert limits._cgroup_left() is None


def _v1_cpu(quota, period=100000):
    return {"cpu.cfs_quota_us": f"{quota}\n", "cpu.cfs_period_us": f"{period}\n"}


def test_a_cpu_quota_bounds_the_pool_threads(tmp_path, monkeypatch):
    """A container given 2.5 CPUs of a larger host (v1 quota on its cgroup, none above):
    3 threads, not one per core; the tightest quota on the way up wins."""
    _cgroup_tree(tmp_path, monkeypatch, "6:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n",
                 ["/ {tmp}/cpu rw - cgroup cgroup rw,cpu,cpuacct"],
                 {"cpu": _v1_cpu(-1), "cpu/kubepods": _v1_cpu(-1),
                  "cpu/kubepods/pod1": _v1_cpu(400000), "cpu/kubepods/pod1/c1": _v1_cpu(250000)})
    assert cgroups.cpu_quota() == 3
    monkeypatch.setattr(pool, "_cpus", None)
    monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert pool.cpus() == 3
    monkeypatch.setattr(pool, "_cpus", None)
    monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert pool.cpus() == 2                                  # the affinity is tighter
    monkeypatch.setattr(pool, "_cpus", None)


def test_cpu_max_of_cgroup_v2_and_no_quota(tmp_path, monkeypatch):
    cpu_max = lambda text: {"cpu.max": text + "\n"}
    _cgroup_tree(tmp_path, monkeypatch, "0::/system.slice/job.service\n",
                 ["/ {tmp}/u rw - cgroup2 cgroup2 rw"],
                 {"u": {}, "u/system.slice": cpu_max("max 100000"),
                  "u/system.slice/job.service": cpu_max("150000 100000")})
    assert cgroups.cpu_quota() == 2
    _cgroup_tree(tmp_path, monkeypatch, "0::/system.slice/job.service\n",
                 ["/ {tmp}/u rw - cgroup2 cgroup2 rw"],
                 {"u/system.slice/job.service": cpu_max("max 100000")})
    assert cgroups.cpu_quota() is None
    monkeypatch.setattr(cgroups, "PROC_CGROUP", str(tmp_path / "absent"))
    assert cgroups.cpu_quota() is None and limits._cgroup_left() is None


def test_a_load_into_the_callers_tensors_needs_no_memory_for_them(tmp_path, monkeypatch):
    """Under "auto" a load is held to the memory left; tensors decoded straight into the
    caller's ``into=`` targets take none, so a model that fills most of a container's
    limit restores into itself (lcckpt.load and a chain, keyframe and delta), where a load
    that allocates is refused, as is one whose targets do not fit."""
    import torch
    import lcckpt
    state = {"a": torch.randn(3_000_000), "b": torch.randn(2_000_000)}     # 20 MB
    lcckpt.save(state, tmp_path / "raw.lcc")
    lcckpt.save(state, tmp_path / "coded.lcc", compress=True)
    d = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    d.save(0, state)
    d.save(1, {k: v + 0.01 for k, v in state.items()})
    monkeypatch.setattr(limits, "usable_memory", lambda: (4 << 20, "the cgroup's memory limit"))
    loads = [lambda into: lcckpt.load(tmp_path / "raw.lcc", into=into),
             lambda into: lcckpt.load(tmp_path / "coded.lcc", into=into),
             lambda into: lcckpt.DeltaCheckpointer(tmp_path / "chain").load(0, into=into),
             lambda into: lcckpt.DeltaCheckpointer(tmp_path / "chain").load(1, into=into)]
    for load in loads:
        targets = {k: torch.zeros_like(v) for k, v in state.items()}
        out = load(targets)
        assert out["a"].data_ptr() == targets["a"].data_ptr()
        assert torch.allclose(targets["b"], state["b"], atol=0.02)
        with pytest.raises(lcckpt.ResourceLimitError, match="memory limit leaves this process"):
            load(None)
        with pytest.raises(lcckpt.ResourceLimitError, match="memory limit leaves this process"):
            load({k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()})
