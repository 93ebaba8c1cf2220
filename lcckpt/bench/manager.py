"""What CheckpointManager costs a real training loop.

An MLP (64 -> hidden -> hidden -> 10, Adam) trains on scikit-learn's digits, once without a
manager and once with one, alternately, ``repeats`` times each; the result is the time per
iteration of both and the difference, at the checkpoint rate the manager's own plan picks
for the given MTBF (or a fixed ``every``). A short untimed run first loads the compiled
kernels, as a long training job would have done long before.

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

from ..manager import CheckpointManager
from .timing import environment, format_table


def _data():
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("scikit-learn is needed for lcckpt's benchmarks; install it with "
                          "pip install 'lcckpt[bench]'") from exc
    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)


def _loop(x, y, hidden, steps, batch, seed, manager_kwargs=None, directory=None):
    """Train ``steps`` iterations; returns (seconds, final loss, manager or None)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(x), (steps, batch), generator=gen)
    mgr = CheckpointManager(directory, model, opt, **manager_kwargs) if manager_kwargs else None
    t0 = time.perf_counter()
    for i in range(steps):
        loss = F.cross_entropy(model(x[idx[i]]), y[idx[i]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mgr is not None:
            mgr.step(loss)
    seconds = time.perf_counter() - t0      # the loop only; the last save may still run
    if mgr is not None:
        mgr.close()
    return seconds, float(loss), mgr


def run(hidden: int = 1024, steps: int = 3000, batch: int = 128, mtbf: float = 100.0,
        policy: str = "convergence", every: int | None = None, repeats: int = 3,
        threads: int = 1, seed: int = 0) -> dict[str, Any]:
    """Time the loop with and without the manager; returns a JSON-able dict."""
    torch.set_num_threads(threads)
    x, y = _data()
    kwargs: dict[str, Any] = {"policy": policy, "mtbf": mtbf} if every is None else {"every": every}
    params = sum(p.numel() for p in nn.Sequential(nn.Linear(64, hidden), nn.Linear(hidden, hidden),
                                                  nn.Linear(hidden, 10)).parameters())
    with tempfile.TemporaryDirectory() as tmp:      # untimed: load the compiled kernels
        _loop(x, y, hidden, 40, batch, seed, {"every": 10, "backpressure": "wait"}, tmp)
        _loop(x, y, hidden, 200, batch, seed)
    base, with_mgr, runs = [], [], []
    for r in range(repeats):
        base.append(_loop(x, y, hidden, steps, batch, seed)[0])
        with tempfile.TemporaryDirectory() as tmp:
            seconds, loss, mgr = _loop(x, y, hidden, steps, batch, seed, kwargs, tmp)
        with_mgr.append(seconds)
        plan, costs = mgr.plan_summary, mgr.costs
        runs.append({
            "repeat": r, "baseline_ms_per_it": base[-1] / steps * 1e3,
            "manager_ms_per_it": seconds / steps * 1e3,
            "overhead_pct": (seconds / base[-1] - 1) * 100,
            "checkpoints": mgr.stats["checkpoints"], "deferred": mgr.stats["deferred"],
            "plans": mgr.stats["plans"],
            "stall_ms_total": mgr.stats["stall_s"] * 1e3,
            "snapshot_ms": costs["snapshot"] * 1e3, "persist_ms": costs["persist"] * 1e3,
            "planned_gap": None if plan is None else plan["gap"],
            "policy_used": None if plan is None else plan["policy"],
            "final_loss": loss,
        })
        explain = mgr.explain()
    b, m = statistics.median(base), statistics.median(with_mgr)
    return {
        "benchmark": "manager", "environment": environment(), "threads": threads,
        "settings": {"hidden": hidden, "params": params, "steps": steps, "batch": batch,
                     "mtbf_s": mtbf, "policy": policy, "every": every, "repeats": repeats},
        "baseline_ms_per_it": b / steps * 1e3, "manager_ms_per_it": m / steps * 1e3,
        "overhead_pct": (m / b - 1) * 100, "runs": runs, "explain_last": explain,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--mtbf", type=float, default=100.0, help="seconds between failures")
    ap.add_argument("--policy", default="convergence")
    ap.add_argument("--every", type=int, default=None, help="fixed interval instead of a plan")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the loop")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = ap.parse_args(argv)
    res = run(args.hidden, args.steps, args.batch, args.mtbf, args.policy, args.every,
              args.repeats, args.threads)
    s = res["settings"]
    print(f"MLP {s['params']:,} parameters + Adam, {s['steps']} iterations of batch {s['batch']}, "
          f"{res['threads']} torch thread(s); policy {s['policy']}, MTBF {s['mtbf_s']:g} s"
          + (f", every {s['every']}" if s["every"] else ""))
    print(format_table(res["runs"], ["repeat", "baseline_ms_per_it", "manager_ms_per_it",
                                     "overhead_pct", "checkpoints", "deferred", "snapshot_ms",
                                     "persist_ms", "planned_gap", "policy_used"]))
    print(f"median: {res['baseline_ms_per_it']:.3f} ms/it without, {res['manager_ms_per_it']:.3f} "
          f"ms/it with the manager: {res['overhead_pct']:+.2f}%")
    print(res["explain_last"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
