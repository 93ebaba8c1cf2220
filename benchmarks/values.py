"""Plain Python values in a checkpoint: save and load against torch.save / torch.load.

    python benchmarks/values.py [--floats 1000000] [--reps 3] [--json]

A training history as users keep it beside the model: ``--floats`` losses (a list of
floats), a tenth as many step names (strings) and a dict of as many ints keyed by step.
lcckpt stores such values in its JSON header; torch pickles them. Times, as medians of
``--reps`` runs in this process, to files in a temporary directory (page cache, no fsync
on either side), the files' sizes, and each lcckpt time over torch's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lcckpt  # noqa: E402
from lcckpt.bench.timing import median_time as _time  # noqa: E402


def history(n: int) -> dict:
    return {"loss": [i * 1e-3 for i in range(n)], "names": [f"s{i}" for i in range(n // 10)],
            "by_step": {i: i for i in range(n // 10)}}


def run(floats: int, reps: int) -> dict:
    obj = history(floats)
    lcckpt.warmup()
    with tempfile.TemporaryDirectory() as d:
        pt, lc = os.path.join(d, "x.pt"), os.path.join(d, "x.lcc")
        res = {"torch.save": _time(lambda: torch.save(obj, pt), reps),
               "torch.load": _time(lambda: torch.load(pt, weights_only=True), reps),
               "lcckpt.save": _time(lambda: lcckpt.save(obj, lc), reps),
               "lcckpt.load": _time(lambda: lcckpt.load(lc), reps)}
        assert lcckpt.load(lc) == obj
        sizes = {"torch.save": os.path.getsize(pt), "lcckpt.save": os.path.getsize(lc)}
    ratios = {k: res[k] / res["torch.load" if "load" in k else "torch.save"]
              for k in res if not k.startswith("torch")}
    return {"floats": floats, "reps": reps, "seconds": res, "over_torch": ratios,
            "bytes": sizes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floats", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.floats, args.reps)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{res['floats']:,} floats, {res['floats'] // 10:,} strings and {res['floats'] // 10:,} "
          f"int items; medians of {res['reps']} runs")
    for k, s in res["seconds"].items():
        r = res["over_torch"].get(k)
        print(f"  {k:12} {s:7.2f} s" + (f"   {r:5.2f}x torch" if r is not None else ""))
    print("  file bytes: " + ", ".join(f"{k} {v:,}" for k, v in res["bytes"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
