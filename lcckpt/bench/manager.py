"""What CheckpointManager costs a real training loop.

An MLP (64 -> hidden -> hidden -> 10, Adam) trains on scikit-learn's digits twice, without a
manager and with one, in alternating blocks of iterations so that both see the same load of
the machine; the result is the time per iteration of both (wall clock, the training
thread's CPU time and the whole process's CPU time) at the checkpoint rate the manager's own
plan picks for the given MTBF (or a fixed ``every``). A short untimed run first loads the
compiled kernels, as a long training job would have done long before.

The loop uses ``threads`` torch threads; the background writer needs a core of its own to
stay out of the loop's way, as it has on a training machine whose accelerator does the math.
It does not measure failures or restarts: see the scheduler's benchmark for that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..training.manager import CheckpointManager
from .timing import environment, format_table


def _data():
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("scikit-learn is needed for lcckpt's benchmarks; install it with "
                          "pip install 'lcckpt[bench]'") from exc
    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)


class _Job:
    """One training run that can be advanced a block of iterations at a time."""

    def __init__(self, x, y, hidden, batch, seed, manager_kwargs=None, directory=None):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                   nn.ReLU(), nn.Linear(hidden, 10))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.x, self.y, self.batch = x, y, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.mgr = (CheckpointManager(directory, self.model, self.opt, **manager_kwargs)
                    if manager_kwargs else None)
        self.blocks: list[dict[str, float]] = []
        self.loss = float("nan")

    def run(self, n: int) -> None:
        """``n`` iterations, timed: wall, this thread's CPU, the whole process's CPU.

        With a manager, the block ends when its last save is durable, so no background work
        spills into the other job's block (this charges the manager a little extra wait).
        """
        idx = torch.randint(len(self.x), (n, self.batch), generator=self.gen)
        c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        for i in range(n):
            loss = F.cross_entropy(self.model(self.x[idx[i]]), self.y[idx[i]])
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if self.mgr is not None:
                self.mgr.step(loss)
        if self.mgr is not None:
            self.mgr.wait()
        t1, p1, c1 = time.perf_counter(), time.process_time(), time.thread_time()
        self.blocks.append({"wall": t1 - t0, "thread_cpu": c1 - c0, "process_cpu": p1 - p0})
        self.loss = loss.item()

    def total(self, key: str) -> float:
        return sum(b[key] for b in self.blocks)


def run(hidden: int = 1024, steps: int = 3000, block: int = 250, batch: int = 128,
        mtbf: float = 100.0, policy: str = "convergence", every: int | None = None,
        threads: int = 1, seed: int = 0, background: bool | str = True) -> dict[str, Any]:
    """Train with and without the manager in alternating blocks; returns a JSON-able dict.

    Two identical jobs (same seed, same batches) advance ``block`` iterations in turn, the
    order swapped every round, so both see the same background load of the machine.
    The manager does not change training: both end with the same loss.
    """
    torch.set_num_threads(threads)
    x, y = _data()
    kwargs: dict[str, Any] = {"policy": policy, "mtbf": mtbf} if every is None else {"every": every}
    kwargs["background"] = background
    with tempfile.TemporaryDirectory() as tmp:      # untimed: load the compiled kernels
        warm = _Job(x, y, hidden, batch, seed, {"every": 10, "backpressure": "wait"}, tmp)
        warm.run(40)
        warm.mgr.close()
    with tempfile.TemporaryDirectory() as tmp:
        base = _Job(x, y, hidden, batch, seed)
        man = _Job(x, y, hidden, batch, seed, kwargs, tmp)
        for r in range(max(1, steps // block)):
            for job in ((base, man) if r % 2 == 0 else (man, base)):
                job.run(block)
        man.mgr.close()
        mgr = man.mgr
        n = len(base.blocks) * block
        ratios = [m["wall"] / b["wall"] for b, m in zip(base.blocks, man.blocks)]
        plan, costs = mgr.plan_summary, mgr.costs
        params = sum(p.numel() for p in base.model.parameters())
        return {
            "benchmark": "manager", "environment": environment(), "threads": threads,
            "settings": {"hidden": hidden, "params": params, "steps": n, "block": block,
                         "batch": batch, "mtbf_s": mtbf, "policy": policy, "every": every,
                         "background": background},
            "baseline_ms_per_it": base.total("wall") / n * 1e3,
            "manager_ms_per_it": man.total("wall") / n * 1e3,
            "overhead_wall_pct": (man.total("wall") / base.total("wall") - 1) * 100,
            "overhead_wall_median_block_pct": (statistics.median(ratios) - 1) * 100,
            "overhead_thread_cpu_pct": (man.total("thread_cpu") / base.total("thread_cpu") - 1) * 100,
            "overhead_process_cpu_pct": (man.total("process_cpu") / base.total("process_cpu") - 1) * 100,
            "block_ratios": ratios,
            "checkpoints": mgr.stats["checkpoints"], "deferred": mgr.stats["deferred"],
            "plans": mgr.stats["plans"], "stall_ms_total": mgr.stats["stall_s"] * 1e3,
            "snapshot_ms": costs["snapshot"] * 1e3, "persist_ms": costs["persist"] * 1e3,
            "interference_ms": costs["interference"] * 1e3,
            "planned_gap": None if plan is None else plan["gap"],
            "young_daly_gap": None if plan is None else plan["young_daly_gap"],
            "policy_used": None if plan is None else plan["policy"],
            "same_final_loss": base.loss == man.loss, "final_loss": man.loss,
            "explain": mgr.explain(),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--mtbf", type=float, default=100.0, help="seconds between failures")
    ap.add_argument("--policy", default="convergence")
    ap.add_argument("--every", type=int, default=None, help="fixed interval instead of a plan")
    ap.add_argument("--block", type=int, default=250, help="iterations per alternating block")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the loop")
    ap.add_argument("--background", choices=("true", "false", "overlap"), default="true",
                    help="the manager's background mode")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = ap.parse_args(argv)
    background = {"true": True, "false": False}.get(args.background, args.background)
    res = run(args.hidden, args.steps, args.block, args.batch, args.mtbf, args.policy,
              args.every, args.threads, background=background)
    s = res["settings"]
    print(f"MLP {s['params']:,} parameters + Adam, {s['steps']} iterations of batch {s['batch']}, "
          f"{res['threads']} torch thread(s); policy {s['policy']}, MTBF {s['mtbf_s']:g} s"
          + (f", every {s['every']}" if s["every"] else "") + f", background={s['background']!r}")
    rows = [{"": "per iteration, ms", "without": res["baseline_ms_per_it"],
             "with manager": res["manager_ms_per_it"], "added %": res["overhead_wall_pct"]},
            {"": "median block ratio", "added %": res["overhead_wall_median_block_pct"]},
            {"": "training thread CPU", "added %": res["overhead_thread_cpu_pct"]},
            {"": "process CPU (all threads)", "added %": res["overhead_process_cpu_pct"]}]
    print(format_table(rows, ["", "without", "with manager", "added %"]))
    print(f"{res['checkpoints']} checkpoints ({res['deferred']} deferred, {res['plans']} plans), "
          f"snapshot {res['snapshot_ms']:.3g} ms (stall), persist {res['persist_ms']:.3g} ms "
          f"(background), stalls {res['stall_ms_total']:.4g} ms in all, interference "
          f"{res['interference_ms']:.3g} ms; planned gap {res['planned_gap']} iterations, "
          f"Young/Daly {res['young_daly_gap']}; same final loss: {res['same_final_loss']}")
    print(res["explain"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
