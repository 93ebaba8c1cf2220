"""Python's garbage collector during saves and loads: held off (the main thread) or not.

    python benchmarks/collector.py [--tensors 2000] [--elements 64] [--steps 8] [--rounds 2]

A chain of ``--steps`` saves (a keyframe, then deltas with every value moved) of a state
of ``--tensors`` fp32 tensors of ``--elements`` each, three loads of its newest step, and
an ``lcckpt.save(compress=True)`` and ``lcckpt.load`` of the last state. Each round runs
this workload twice, on a fresh chain each time: once in the main thread, where lcckpt
holds the collector off during its calls (lcckpt/util/collector.py), and once in a
thread of its own, where it leaves the collector on (as it does for the manager's writer),
the order alternating by round. Prints, per case, the median delta save and chain load,
the ``lcckpt.save`` and ``lcckpt.load``, the whole workload, and the seconds the collector
ran during it (timed with ``gc.callbacks``), with how many of its runs were full
collections.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lcckpt  # noqa: E402


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


def in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    if not out:
        raise RuntimeError("the workload failed in its thread")
    return out[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--elements", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lcckpt.warmup()
    clock = CollectorClock()
    cases: dict[str, list[dict]] = {"held off (main thread)": [], "on (own thread)": []}
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(cases)[::-1]
        for case in order:
            with tempfile.TemporaryDirectory() as d:
                run = lambda: workload(d, args.tensors, args.elements, args.steps, clock)  # noqa: E731
                cases[case].append(run() if case.startswith("held") else in_thread(run))
    if args.json:
        print(json.dumps({"args": vars(args), "runs": cases}, indent=1))
        return 0
    print(f"{args.tensors:,} fp32 tensors of {args.elements} elements, {args.steps} saves, "
          f"{args.rounds} rounds; medians of the rounds")
    keys = list(next(iter(cases.values()))[0])
    print(f"  {'collector':24}" + "".join(f"{k:>18}" for k in keys))
    for case, runs in cases.items():
        cells = [statistics.median(run[k] for run in runs) for k in keys]
        print(f"  {case:24}" + "".join(f"{c:>16.3f} s" if k != "full collections"
                                         else f"{c:>18.1f}" for k, c in zip(keys, cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
