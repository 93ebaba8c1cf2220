"""Many tiny tensors: save, delta save and load against torch.save / torch.load.

    python benchmarks/many_tensors.py [--tensors 100000] [--elements 3] [--reps 3] [--json]

A state of ``--tensors`` fp32 tensors of ``--elements`` each (a model of many small
parameters, or an optimizer's per-parameter scalars). Times, as medians of ``--reps``
runs in this process, to files in a temporary directory (page cache, no fsync on either
side): ``torch.save`` and ``torch.load`` (weights only), ``lcckpt.save`` and
``lcckpt.load``, and a ``DeltaCheckpointer``'s keyframe save, delta save (every value
moved) and load of the delta step. Prints seconds and each lcckpt time over torch's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lcckpt  # noqa: E402
from lcckpt.bench.timing import median_time as _time  # noqa: E402


def run(tensors: int, elements: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.p": torch.randn(elements, generator=g) for i in range(tensors)}
    moved = {k: v + 0.01 for k, v in state.items()}
    lcckpt.warmup()
    with tempfile.TemporaryDirectory() as d:
        pt, lc = os.path.join(d, "x.pt"), os.path.join(d, "x.lcc")
        res = {"torch.save": _time(lambda: torch.save(state, pt), reps),
               "torch.load": _time(lambda: torch.load(pt, weights_only=True), reps),
               "lcckpt.save": _time(lambda: lcckpt.save(state, lc), reps),
               "lcckpt.load": _time(lambda: lcckpt.load(lc), reps)}
        kf, delta, load = [], [], []
        for r in range(reps):
            ck = lcckpt.DeltaCheckpointer(os.path.join(d, f"ck{r}"))
            kf.append(_time(lambda: ck.save(0, state), 1))
            delta.append(_time(lambda: ck.save(1, moved), 1))
            assert ck.last_save["kind"] == "delta"
            load.append(_time(lambda: ck.load(1), 1))
            ck.close()
        res.update({"chain keyframe save": statistics.median(kf),
                    "chain delta save": statistics.median(delta),
                    "chain load (delta step)": statistics.median(load)})
    ratios = {k: res[k] / res["torch.load" if "load" in k else "torch.save"]
              for k in res if not k.startswith("torch")}
    return {"tensors": tensors, "elements": elements, "reps": reps, "seconds": res,
            "over_torch": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--elements", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.tensors, args.elements, args.reps)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{res['tensors']:,} fp32 tensors of {res['elements']} elements; medians of "
          f"{res['reps']} runs")
    for k, s in res["seconds"].items():
        r = res["over_torch"].get(k)
        print(f"  {k:26} {s:7.2f} s" + (f"   {r:5.2f}x torch" if r is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
