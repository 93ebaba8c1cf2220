"""Python's garbage collector during saves and loads: held off by lcckpt, or left on.

    python benchmarks/collector.py [--tensors 2000] [--elements 64] [--steps 8]
                                   [--manager-steps 120] [--rounds 2] [--json]

Two workloads, each run once with lcckpt holding the collector off during its calls (the
default, lcckpt/util/collector.py) and once with ``collector.HOLD_OFF = False``, on a
fresh directory each time, the order alternating by round:

* calls: a chain of ``--steps`` saves (a keyframe, then deltas with every value moved) of
  a state of ``--tensors`` fp32 tensors of ``--elements`` each, three loads of its newest
  step, and an ``lcckpt.save(compress=True)`` and ``lcckpt.load`` of the last state;
* manager: ``--manager-steps`` AdamW steps of a stack of 150 ``Linear(64, 64)`` +
  ``LayerNorm`` blocks (1,200 tensors with the moments) on one torch thread, with a
  ``CheckpointManager(every=10)`` writing in its background thread.

Prints, per case, the medians over the rounds of: the delta save and chain load, the
``lcckpt.save`` and ``lcckpt.load`` (calls) or the training step's median and worst
(manager), the whole workload, the seconds the collector ran during it (timed with
``gc.callbacks``, in any thread) and how many of its runs were full collections.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lcckpt  # noqa: E402
from lcckpt.util import collector  # noqa: E402


class CollectorClock:
    """Seconds the collector ran, and full collections, since :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0


def workload(directory: str, tensors: int, elements: int, steps: int, clock) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.w": torch.randn(elements, generator=g) for i in range(tensors)}
    ck = lcckpt.DeltaCheckpointer(os.path.join(directory, "chain"))
    saves, loads = [], []
    clock.reset()
    start = time.perf_counter()
    for step in range(steps):
        if step:
            state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}
        t = time.perf_counter()
        ck.save(step, state)
        saves.append(time.perf_counter() - t)
    for _ in range(3):
        t = time.perf_counter()
        ck.load()
        loads.append(time.perf_counter() - t)
    ck.close()
    path = os.path.join(directory, "state.lcc")
    t = time.perf_counter()
    lcckpt.save(state, path, compress=True)
    t_save = time.perf_counter() - t
    t = time.perf_counter()
    lcckpt.load(path)
    t_load = time.perf_counter() - t
    return {"delta save": statistics.median(saves[1:]), "chain load": statistics.median(loads),
            "lcckpt.save": t_save, "lcckpt.load": t_load,
            "whole": time.perf_counter() - start, "collector": clock.seconds,
            "full collections": clock.full}


def manager_workload(directory: str, steps: int, clock) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(150)
                                  for m in (torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))])
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x = torch.randn(32, 64)
    mgr = lcckpt.CheckpointManager(directory, model, opt, every=10)
    times = []
    clock.reset()
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        mgr.step()
        times.append(time.perf_counter() - t)
    mgr.close()
    return {"step": statistics.median(times), "worst step": max(times),
            "whole": time.perf_counter() - start, "collector": clock.seconds,
            "full collections": clock.full}


def table(title: str, cases: dict[str, list[dict]]) -> None:
    print(title)
    keys = list(next(iter(cases.values()))[0])
    print(f"  {'collector':12}" + "".join(f"{k:>18}" for k in keys))
    for case, runs in cases.items():
        cells = [statistics.median(run[k] for run in runs) for k in keys]
        print(f"  {case:12}" + "".join(f"{c:>16.3f} s" if k != "full collections"
                                       else f"{c:>18.1f}" for k, c in zip(keys, cells)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--elements", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--manager-steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lcckpt.warmup()
    torch.set_num_threads(1)
    clock = CollectorClock()
    runs: dict[str, dict[str, list[dict]]] = {
        "calls": {"held off": [], "on": []}, "manager": {"held off": [], "on": []}}
    for r in range(args.rounds):
        for case in (["held off", "on"] if r % 2 == 0 else ["on", "held off"]):
            collector.HOLD_OFF = case == "held off"
            with tempfile.TemporaryDirectory() as d:
                runs["calls"][case].append(
                    workload(d, args.tensors, args.elements, args.steps, clock))
            with tempfile.TemporaryDirectory() as d:
                runs["manager"][case].append(manager_workload(d, args.manager_steps, clock))
    collector.HOLD_OFF = True
    if args.json:
        print(json.dumps({"args": vars(args), "runs": runs}, indent=1))
        return 0
    table(f"calls: {args.tensors:,} fp32 tensors of {args.elements} elements, {args.steps} "
          f"saves; medians of {args.rounds} rounds", runs["calls"])
    table(f"manager: {args.manager_steps} steps, a background save every 10; medians of "
          f"{args.rounds} rounds", runs["manager"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
